"""SFT semantics in the packed loader (issue 24 items 1 and 2): a labels or loss-mask column and
the user's per-token columns travel with every document through the sampler's pieces, padding
and CP sharding; ``labels``/``shift_labels`` train exactly the user's tokens and the loss-token
counts count exactly those, against an unpacked per-document reference."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from balancer import CostModel, Layout, PlannerConfig, SampleTable
from balancer.loader.collate import (IGNORE, FetchedMicrobatch, FlatTokens, PackedCollator,
                                     PackedDataset, pack_documents)
from balancer.loader.columns import LossTokens
from balancer.loader.sampler import PackedBatchSampler

COST = CostModel.quadratic(65536)


# ---- the unpacked reference ---------------------------------------------------------------

def ref_document(tokens, trained, start=0, length=None):
    """One document (a sample's ``[start, start + length)`` piece) as an unpacked trainer sees
    it: labels = the token where trained and -100 elsewhere, its first token never; shift the
    next token's label; the number of loss targets."""
    length = len(tokens) - start if length is None else length
    t = [int(x) for x in tokens[start:start + length]]
    m = [bool(x) for x in trained[start:start + length]]
    lab = [IGNORE] + [t[j] if m[j] else IGNORE for j in range(1, length)]
    shift = lab[1:] + [IGNORE]
    return t, lab, shift, sum(m[1:])


def unshard_all(outs, key, total, fill):
    full = np.full(total, fill, np.asarray(outs[0][key]).dtype)
    for o in outs:
        full[o["cp_index"]] = o[key]
    return full


docs_st = st.lists(st.lists(st.tuples(st.integers(0, 99), st.booleans(),
                                      st.floats(-2, 2, allow_nan=False)),
                            min_size=1, max_size=17), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(docs_st, st.sampled_from([1, 2, 3]), st.booleans(), st.randoms(use_true_random=False))
def test_pack_with_labels_and_columns_matches_unpacked_reference(docs, cp, whole, rnd):
    tokens = [np.array([t for t, _, _ in d], np.int64) for d in docs]
    trained = [np.array([m for _, m, _ in d]) for d in docs]
    labels = [np.where(m, t, IGNORE) for t, m in zip(tokens, trained)]
    adv = [np.array([a for _, _, a in d], np.float32) for d in docs]
    tti = [np.arange(len(d), dtype=np.int32) % 2 for d in docs]
    owner = np.array([rnd.randrange(-1, cp) for _ in docs], np.int64) if whole and cp > 1 \
        else None
    outs = [pack_documents(tokens, cp, r, owner, labels=labels,
                           columns={"advantages": adv, "token_type_ids": tti})
            for r in range(cp)]
    ref = [ref_document(t, m) for t, m in zip(tokens, trained)]
    want_lab = [x for r in ref for x in r[1]]
    want_shift = [x for r in ref for x in r[2]]
    trained_total = sum(r[3] for r in ref)
    for o in outs:
        assert o["microbatch_loss_tokens"] == trained_total
        assert o["num_loss_tokens"] == int((o["shift_labels"] != IGNORE).sum())
    assert sum(o["num_loss_tokens"] for o in outs) == trained_total
    if cp == 1:
        o = outs[0]
        assert o["labels"].tolist() == want_lab and o["shift_labels"].tolist() == want_shift
        assert o["advantages"].dtype == np.float32
        assert np.array_equal(o["advantages"], np.concatenate(adv))
        assert np.array_equal(o["token_type_ids"], np.concatenate(tti))
        return
    total = int(outs[0]["cu_seqlens_padded"][-1])
    cu, cu_pad = outs[0]["cu_seqlens"], outs[0]["cu_seqlens_padded"]
    real = np.concatenate([np.arange(cu_pad[d], cu_pad[d] + cu[d + 1] - cu[d])
                           for d in range(len(docs))])
    pad = np.setdiff1d(np.arange(total), real)
    for key, want in (("labels", want_lab), ("shift_labels", want_shift)):
        full = unshard_all(outs, key, total, 12345)
        assert full[real].tolist() == want and (full[pad] == IGNORE).all(), key
    for key, want in (("advantages", adv), ("token_type_ids", tti)):
        full = unshard_all(outs, key, total, 7)
        assert full.dtype == want[0].dtype
        assert np.array_equal(full[real], np.concatenate(want)) and (full[pad] == 0).all()
    ids = unshard_all(outs, "input_ids", total, -1)
    assert np.array_equal(ids[real], np.concatenate(tokens))


def test_no_labels_is_unchanged():
    docs = [np.arange(5), np.arange(3) + 7]
    a = pack_documents(docs, 2, 1)
    b = pack_documents(docs, 2, 1, labels=[d.copy() for d in docs])  # every token trained
    for k in a:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    assert a["microbatch_loss_tokens"] == 4 + 2


# ---- datasets with a labels or mask column through the sampler ----------------------------

def sft_rows(L, seed=0):
    """Rows of token ids, a 0/1 completion mask (a prompt then a completion, some rows all
    prompt: nothing trained), HF labels and two per-token columns."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(L.tolist()):
        ids = rng.integers(0, 1000, n)
        prompt = int(rng.integers(0, n + 1)) if i % 7 else n  # every 7th: no trained token
        mask = (np.arange(n) >= prompt).astype(np.int64)
        mask[rng.random(n) < 0.1] = 0  # holes inside the completion (multi-turn)
        rows.append({"input_ids": ids, "completion_mask": mask,
                     "labels": np.where(mask == 1, ids, IGNORE),
                     "advantages": rng.standard_normal(n).astype(np.float32),
                     "token_type_ids": (np.arange(n) % 3).astype(np.int64)})
    return rows


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _loader(L, ds, packed, dp, cp=1, rank=0, cp_rank=0, cap=512, loss_tokens="dataset",
            cp_balance="zigzag"):
    lay = Layout(dp=dp, cp=cp, microbatches=2, capacity=cap)
    lt = packed.loss_tokens() if isinstance(loss_tokens, str) else loss_tokens
    s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"),
                           dp_rank=rank, cp_rank=cp_rank, loss_tokens=lt)
    return torch.utils.data.DataLoader(packed, batch_sampler=s,
                                       collate_fn=PackedCollator(cp_balance=cp_balance))


def _lengths(seed=3, n=120):
    L = np.random.default_rng(seed).integers(1, 1300, n)  # some over 512: chunk pieces
    L[5] = 1200  # cut into pieces, and (5 % 7 != 0) partly trained
    L[14] = 1100  # cut into pieces with nothing trained (14 % 7 == 0)
    return L


def _dataset(rows, hf):
    if not hf:
        return Rows(rows)
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_dict({k: [r[k].tolist() for r in rows] for k in rows[0]})


@pytest.mark.parametrize("column", ["completion_mask", "labels"])
@pytest.mark.parametrize("hf", [False, True])
def test_trained_tokens_through_pieces_and_steps_equal_the_unpacked_reference(column, hf):
    L = _lengths()
    rows = sft_rows(L)
    kw = {"loss_mask_column": column} if column == "completion_mask" else {"labels_column": column}
    packed = PackedDataset(_dataset(rows, hf), **kw, token_columns=["advantages",
                                                                    "token_type_ids"])
    steps, seen = {}, []
    for r in range(2):
        for b in _loader(L, None, packed, dp=2, rank=r):
            cu = b["cu_seqlens"].tolist()
            mb_trained = 0
            for j, (s, a) in enumerate(zip(b["sample_ids"].tolist(),
                                           b["sample_starts"].tolist())):
                n = cu[j + 1] - cu[j]
                t, lab, shift, k = ref_document(rows[s]["input_ids"], rows[s]["completion_mask"],
                                                a, n)
                sl = slice(cu[j], cu[j + 1])
                assert b["input_ids"][sl].tolist() == t
                assert b["labels"][sl].tolist() == lab and b["shift_labels"][sl].tolist() == shift
                assert torch.equal(b["advantages"][sl],
                                   torch.from_numpy(rows[s]["advantages"][a:a + n]))
                assert b["token_type_ids"][sl].tolist() == \
                    rows[s]["token_type_ids"][a:a + n].tolist()
                mb_trained += k
                seen.append((s, a, n))
            assert b["num_loss_tokens"] == b["microbatch_loss_tokens"] == mb_trained
            steps.setdefault(b["step"], []).append(b)
    assert any(a > 0 for _, a, _ in seen) and {5, 14} <= {s for s, a, _ in seen if a > 0}
    assert sum(n for _, _, n in seen) == L.sum()
    for bs in steps.values():
        total = sum(b["num_loss_tokens"] for b in bs)
        assert all(b["step_loss_tokens"] == total for b in bs)
    # the counts the sampler used: per sample, trained tokens after the first
    lt = packed.loss_tokens()
    assert lt.per_sample.tolist() == [ref_document(r["input_ids"], r["completion_mask"])[3]
                                      for r in rows]
    assert lt.per_sample[14] == 0 and lt.per_sample[5] > 0


@pytest.mark.parametrize("balance", ["zigzag", "auto"])
def test_cp_shards_train_the_same_tokens(balance):
    L = np.random.default_rng(4).integers(1, 700, 50)
    rows = sft_rows(L, seed=1)
    packed = PackedDataset(Rows(rows), loss_mask_column="completion_mask",
                           token_columns=["advantages"])
    shards = [list(_loader(L, None, packed, dp=1, cp=4, cp_rank=r, cp_balance=balance))
              for r in range(4)]
    assert len(shards[0]) > 0 and len({len(s) for s in shards}) == 1
    whole = 0
    for k in range(len(shards[0])):
        outs = [{key: v.numpy() if isinstance(v, torch.Tensor) else v for key, v in s[k].items()}
                for s in shards]
        o0 = outs[0]
        total = int(o0["cu_seqlens_padded"][-1])
        cu, cu_pad = o0["cu_seqlens"], o0["cu_seqlens_padded"]
        whole += int((o0["cp_owner"] >= 0).sum())
        full = {key: unshard_all(outs, key, total, 99)
                for key in ("input_ids", "labels", "shift_labels", "advantages")}
        trained = 0
        for d, (s, a) in enumerate(zip(o0["sample_ids"].tolist(), o0["sample_starts"].tolist())):
            n = int(cu[d + 1] - cu[d])
            t, lab, shift, c = ref_document(rows[s]["input_ids"], rows[s]["completion_mask"], a, n)
            sl, pad = slice(cu_pad[d], cu_pad[d] + n), slice(cu_pad[d] + n, cu_pad[d + 1])
            assert full["input_ids"][sl].tolist() == t
            assert full["labels"][sl].tolist() == lab and full["shift_labels"][sl].tolist() == shift
            assert np.array_equal(full["advantages"][sl], rows[s]["advantages"][a:a + n])
            assert (full["labels"][pad] == IGNORE).all() and (full["advantages"][pad] == 0).all()
            trained += c
        assert sum(o["num_loss_tokens"] for o in outs) == trained
        assert all(o["microbatch_loss_tokens"] == trained for o in outs)
        assert len({o["step_loss_tokens"] for o in outs}) == 1
    assert balance == "zigzag" or whole > 0


def test_sampler_without_the_dataset_counts_is_refused_by_the_collator():
    L = _lengths(n=40)
    packed = PackedDataset(Rows(sft_rows(L)), loss_mask_column="completion_mask")
    with pytest.raises(ValueError, match=r"trained tokens but the sampler counted .*loss_tokens="):
        list(_loader(L, None, packed, dp=1, loss_tokens=None))


def test_per_sample_counts_without_pieces():
    L = np.random.default_rng(8).integers(1, 400, 40)  # nothing over 512: no pieces
    rows = sft_rows(L)
    packed = PackedDataset(Rows(rows), loss_mask_column="completion_mask")
    counts = packed.loss_tokens().per_sample
    a = [b["step_loss_tokens"] for b in _loader(L, None, packed, dp=1, loss_tokens=counts)]
    b = [b["step_loss_tokens"] for b in _loader(L, None, packed, dp=1)]
    assert a == b
    Lc = _lengths(n=40)
    with pytest.raises(ValueError, match=r"cuts sample \d+ into pieces"):
        list(_loader(Lc, None, PackedDataset(Rows(sft_rows(Lc)),
                                             loss_mask_column="completion_mask"),
                     dp=1, loss_tokens=LossTokens(np.zeros(len(Lc), np.int64))))
    with pytest.raises(ValueError, match=r"covers 3 samples but the plan 40"):
        list(_loader(L, None, packed, dp=1, loss_tokens=np.zeros(3, np.int64)))


# ---- refusals naming the sample -----------------------------------------------------------

def _fetch(rows, **kw):
    packed = PackedDataset(Rows(rows), **kw)
    return packed.__getitems__(list(range(len(rows))))


def _rows(n=4, m=6):
    return [{"input_ids": np.arange(m), "mask": np.ones(m, np.int64),
             "labels": np.arange(m), "adv": np.zeros(m)} for _ in range(n)]


@pytest.mark.parametrize("kw,col", [({"loss_mask_column": "mask"}, "mask"),
                                    ({"labels_column": "labels"}, "labels"),
                                    ({"token_columns": ["adv"]}, "adv")])
def test_row_length_differs_from_tokens(kw, col):
    rows = _rows()
    rows[2][col] = rows[2][col][:-1]
    with pytest.raises(ValueError, match=rf"sample 2: column '{col}' has 5 values but its "
                                         rf"tokens \('input_ids'\) have 6"):
        _fetch(rows, **kw)


def test_mask_values_other_than_0_1_are_refused():
    rows = _rows()
    rows[3]["mask"] = np.array([0, 1, 2, 1, 1, 1])
    with pytest.raises(ValueError, match=r"sample 3: loss mask column 'mask' holds 2 at token 2"):
        _fetch(rows, loss_mask_column="mask")
    rows[3]["mask"] = np.array([0, 1, 0.5, 1, 1, 1])
    with pytest.raises(ValueError, match=r"sample 3: .* holds 0.5 at token 2"):
        _fetch(rows, loss_mask_column="mask")
    rows[3]["mask"] = np.array([False, True, True, False, True, True])  # bool and 0./1. are fine
    rows[1]["mask"] = np.array([0., 1., 1., 0., 1., 1.])
    f = _fetch(rows, loss_mask_column="mask")
    assert f.labels[3].tolist() == [IGNORE, 1, 2, IGNORE, 4, 5] == f.labels[1].tolist()
    with pytest.raises(ValueError, match=r"sample 3: loss mask column 'mask' holds 2 at token 2"):
        rows[3]["mask"] = np.array([0, 1, 2, 1, 1, 1])
        PackedDataset(Rows(rows), loss_mask_column="mask").loss_tokens()


def test_labels_of_another_dtype_or_value_are_refused():
    rows = _rows()
    rows[1]["labels"] = np.arange(6, dtype=np.float32)
    with pytest.raises(ValueError, match=r"sample 1: labels column 'labels' has dtype float32"):
        _fetch(rows, labels_column="labels")
    rows[1]["labels"] = np.array([IGNORE, 1, -3, 3, 4, 5])
    with pytest.raises(ValueError, match=r"sample 1: labels column 'labels' holds -3 at token 2"):
        _fetch(rows, labels_column="labels")


def test_hf_labels_column_of_floats_is_refused():
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5]],
                                     "labels": [[1.0, 2.0, 3.0], [4.0, 5.0]]})
    with pytest.raises(ValueError, match=r"sample 0: labels column 'labels' has dtype float"):
        PackedDataset(ds, labels_column="labels").loss_tokens()
    with pytest.raises(ValueError, match=r"no column 'mask'"):
        PackedDataset(ds, loss_mask_column="mask")


def test_constructor_refusals():
    with pytest.raises(ValueError, match="not both"):
        PackedDataset(Rows(_rows()), labels_column="labels", loss_mask_column="mask")
    with pytest.raises(ValueError, match="overwrite the batch's own 'position_ids'"):
        PackedDataset(Rows(_rows()), token_columns=["position_ids"])
    with pytest.raises(ValueError, match="named twice"):
        PackedDataset(Rows(_rows()), labels_column="labels", token_columns=["labels"])
    with pytest.raises(ValueError, match="list of column names"):
        PackedDataset(Rows(_rows()), token_columns="adv")
    with pytest.raises(ValueError, match="bare token array, so it has no column 'mask'"):
        PackedDataset(FlatTokens.from_lengths([3, 4]), loss_mask_column="mask").__getitems__([0])


def test_document_with_no_trained_token_is_allowed_and_counted():
    rows = _rows(2)
    rows[0]["mask"] = np.zeros(6, np.int64)
    f = _fetch(rows, loss_mask_column="mask")
    out = PackedCollator(return_tensors="np")(f)
    assert out["labels"][:6].tolist() == [IGNORE] * 6
    assert out["num_loss_tokens"] == out["microbatch_loss_tokens"] == 5
    assert PackedDataset(Rows(rows), loss_mask_column="mask").loss_tokens().per_sample.tolist() \
        == [0, 5]
    assert isinstance(f, FetchedMicrobatch)


# ---- two gloo processes: step_loss_tokens is the trained tokens over DP --------------------

def _dp_step_loss(rank, world, out):
    import json
    import torch.distributed as dist
    L = _lengths()
    rows = sft_rows(L)
    packed = PackedDataset(Rows(rows), loss_mask_column="completion_mask")
    lay = Layout(dp=world, microbatches=2, capacity=512)
    s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"),
                           loss_tokens=packed.loss_tokens())  # ranks from the process group
    dl = torch.utils.data.DataLoader(packed, batch_sampler=s, collate_fn=PackedCollator())
    mine, claimed, ref = {}, {}, {}
    for b in dl:
        st_ = b["step"]
        mine[st_] = mine.get(st_, 0) + b["num_loss_tokens"]
        claimed.setdefault(st_, set()).add(b["step_loss_tokens"])
        cu = b["cu_seqlens"].tolist()
        ref[st_] = ref.get(st_, 0) + sum(
            ref_document(rows[i]["input_ids"], rows[i]["completion_mask"], a,
                         cu[j + 1] - cu[j])[3]
            for j, (i, a) in enumerate(zip(b["sample_ids"].tolist(),
                                           b["sample_starts"].tolist())))
    n = len(s.plan.step_mbs)
    t = torch.zeros(2, n, dtype=torch.int64)
    for st_ in mine:
        t[0, st_], t[1, st_] = mine[st_], ref[st_]
    dist.all_reduce(t)
    ok = all(claimed[st_] == {int(t[0, st_])} and int(t[0, st_]) == int(t[1, st_])
             for st_ in claimed) and len(claimed) == n and int(t[0].sum()) < int(L.sum() - len(L))
    with open(f"{out}/dp_step_loss_{rank}.json", "w") as f:
        json.dump({"ok": ok, "trained": int(t[0].sum())}, f)


@pytest.mark.slow
def test_step_loss_tokens_over_two_gloo_ranks(tmp_path):
    import json
    from tests.common.gloo import run_ranks
    run_ranks(_dp_step_loss, 2, tmp_path)
    res = [json.loads((tmp_path / f"dp_step_loss_{r}.json").read_text()) for r in range(2)]
    rows = sft_rows(_lengths())
    assert all(r["ok"] for r in res)
    # every token of every sample is planned once here (no tail carried): the step totals add
    # up to the unpacked reference's trained tokens, pieces' lost first targets aside
    assert res[0]["trained"] == res[1]["trained"] > 0
    assert res[0]["trained"] <= sum(ref_document(r["input_ids"], r["completion_mask"])[3]
                                    for r in rows)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), max_size=9), min_size=1, max_size=12),
       st.integers(1, 5), st.booleans())
def test_arrow_counts_in_blocks_equal_row_by_row(masks, block, as_labels):
    datasets = pytest.importorskip("datasets")
    ids = [[7 + j for j in range(len(m))] for m in masks]
    col = [[t if b else IGNORE for t, b in zip(i, m)] for i, m in zip(ids, masks)] \
        if as_labels else masks
    name = "labels" if as_labels else "completion_mask"
    ds = datasets.Dataset.from_dict({"input_ids": ids, name: col})
    kw = {"labels_column": name} if as_labels else {"loss_mask_column": name}
    got = PackedDataset(ds, **kw).loss_tokens(block=block).per_sample.tolist()
    want = [sum(m[1:]) for m in masks]
    assert got == want
    assert PackedDataset(Rows([{"input_ids": np.array(i, np.int64), name: np.array(c, np.int64)}
                               for i, c in zip(ids, col)]), **kw).loss_tokens() \
        .per_sample.tolist() == want


def test_arrow_counts_name_the_bad_sample_in_a_later_block():
    datasets = pytest.importorskip("datasets")
    masks = [[1, 0, 1]] * 9 + [[], [0, 1, 2]]
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * len(m) for m in masks],
                                     "completion_mask": masks})
    with pytest.raises(ValueError, match=r"sample 10: loss mask column 'completion_mask' holds "
                                         r"2 at token 2"):
        PackedDataset(ds, loss_mask_column="completion_mask").loss_tokens(block=4)
    labels = [[1, IGNORE, 3]] * 5 + [[1, -7]]
    ds = datasets.Dataset.from_dict({"input_ids": [[1] * len(x) for x in labels],
                                     "labels": labels})
    with pytest.raises(ValueError, match=r"sample 5: labels column 'labels' holds -7 at token 1"):
        PackedDataset(ds, labels_column="labels").loss_tokens(block=4)
