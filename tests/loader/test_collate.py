"""The packed collator and its adapters against a slow reference; packed == unpacked for the tiny
transformer (logits, summed loss, no cross-document attention) and gradient equivalence of
packing + accumulation with the unpacked token-mean loss."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from balancer import CostModel, Layout, PlannerConfig, SampleTable
from balancer.loader.adapters import (dense_document_mask, document_mask_mod, flash_attn_kwargs,
    flex_block_mask, hf_flattening, packed_seq_params)
from balancer.loader.collate import (FetchedMicrobatch, FlatTokens, PackedCollator, PackedDataset,
    pack_documents)
from balancer.loader.sampler import PackedBatchSampler

from tools.tiny_lm import TinyLM, token_loss_sum  # noqa: E402

COST = CostModel.quadratic(65536)


def naive_pack(docs):
    ids, labels, shift, pos, doc = [], [], [], [], []
    for d, x in enumerate(docs):
        x = [int(v) for v in x]
        ids += x
        labels += [-100] + x[1:]
        shift += x[1:] + [-100]
        pos += list(range(len(x)))
        doc += [d] * len(x)
    return ids, labels, shift, pos, doc


@given(st.lists(st.lists(st.integers(0, 99), min_size=1, max_size=20), min_size=1, max_size=8))
def test_pack_matches_reference(docs):
    arrs = [np.array(d, np.int64) for d in docs]
    out = pack_documents(arrs)
    ids, labels, shift, pos, doc = naive_pack(docs)
    assert out["input_ids"].tolist() == ids
    assert out["labels"].tolist() == labels
    assert out["shift_labels"].tolist() == shift
    assert out["position_ids"].tolist() == pos
    assert out["document_ids"].tolist() == doc
    assert out["cu_seqlens"].dtype == np.int32
    assert out["cu_seqlens"].tolist() == [0] + np.cumsum([len(d) for d in docs]).tolist()
    assert type(out["max_seqlen"]) is int and out["max_seqlen"] == max(map(len, docs))
    assert out["num_loss_tokens"] == sum(len(d) - 1 for d in docs)


def _epoch_batches(L, ds, dp, cap=512, **cfg):
    cfg.setdefault("over_length", "chunk")
    lay = Layout(dp=dp, microbatches=2, capacity=cap)
    out = []
    for r in range(dp):
        s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(**cfg), dp_rank=r)
        dl = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=s,
                                         collate_fn=PackedCollator())
        out.append(list(dl))
    return out


def test_chunk_pieces_rebuild_samples_and_step_loss_tokens_add_up():
    rng = np.random.default_rng(3)
    L = rng.integers(1, 1300, 120)  # some longer than the capacity: cut into pieces
    ds = FlatTokens.from_lengths(L, vocab=1000, seed=1)
    per_rank = _epoch_batches(L, ds, dp=2)
    pieces = {}
    steps = {}
    for batches in per_rank:
        for b in batches:
            cu = b["cu_seqlens"].tolist()
            for j, (s, a) in enumerate(zip(b["sample_ids"].tolist(), b["sample_starts"].tolist())):
                pieces.setdefault(s, []).append((a, b["input_ids"][cu[j]:cu[j + 1]].numpy()))
            steps.setdefault(b["step"], []).append(b)
            assert b["num_loss_tokens"] == int((b["shift_labels"] != -100).sum())
    assert any(len(p) > 1 for p in pieces.values())
    for s in range(len(L)):
        rebuilt = np.concatenate([x for _, x in sorted(pieces[s], key=lambda t: t[0])])
        assert np.array_equal(rebuilt, ds[s])
    for bs in steps.values():
        total = sum(b["num_loss_tokens"] for b in bs)
        assert all(b["step_loss_tokens"] == total for b in bs)
        assert sum(b["last_in_step"] for b in bs) == 2


def test_batch_tensors_own_their_memory_so_in_place_writes_leave_the_plan_alone(tmp_path):
    # batch["sample_starts"] used to alias the plan's read-only entry_start: torch warned, an
    # in-place write changed the plan (the next pass fetched other tokens) and, with a plan
    # store (a read-only memory map), crashed the process with SIGSEGV
    import warnings
    from balancer import plan_epoch
    from balancer.store.plan_store import save_plan
    L = np.random.default_rng(5).integers(5, 600, 120)  # over the capacity: cut, starts > 0
    ds = FlatTokens.from_lengths(L, vocab=500, seed=2)
    lay, cfg = Layout(dp=1, microbatches=2, capacity=256), PlannerConfig(seed=0, over_length="chunk")
    table = SampleTable(L)
    save_plan(plan_epoch(table, COST, lay, cfg, epoch=0), tmp_path / "plan",
              lengths_fingerprint=table.fingerprint())
    for kw in ({}, {"plan_dir": tmp_path / "plan"}):
        s = PackedBatchSampler(table, COST, lay, cfg, dp_rank=0, **kw)
        before = [(list(r), np.array(r.starts), np.array(r.lengths)) for r in s]
        dl = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=s,
                                         collate_fn=PackedCollator())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "NumPy array is not writable"
            batches = list(dl)
        assert any(b["sample_starts"].any() for b in batches)
        for b in batches:
            for k, v in b.items():
                if isinstance(v, torch.Tensor):
                    for arr in (s.plan.entry_start, s.plan.entry_length):
                        assert not np.shares_memory(v.numpy(), np.asarray(arr)), k
        if not kw:  # writing is safe only once nothing aliases: the in-memory plan
            for b in batches:
                b["sample_starts"].fill_(12345)
            after = [(list(r), np.array(r.starts), np.array(r.lengths)) for r in s]
            assert all(a[0] == b_[0] and np.array_equal(a[1], b_[1]) and
                       np.array_equal(a[2], b_[2]) for a, b_ in zip(before, after))


def test_hf_dataset_matches_in_memory_tokens():
    datasets = pytest.importorskip("datasets")
    L = np.random.default_rng(0).integers(1, 300, 80)
    flat = FlatTokens.from_lengths(L, vocab=500)
    hf = datasets.Dataset.from_dict({"input_ids": [flat[i].tolist() for i in range(len(L))]})
    a = _epoch_batches(L, flat, dp=1)[0]
    b = _epoch_batches(L, hf, dp=1)[0]
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
    with pytest.raises(ValueError, match="no column 'tokens'"):
        PackedDataset(hf, tokens_column="tokens")


def test_collator_refuses_unwrapped_dataset_rows():
    with pytest.raises(ValueError, match="PackedDataset"):
        PackedCollator()([np.arange(3)])


def _batch(docs):
    return PackedCollator()(FetchedMicrobatch(list(range(len(docs))),
                                              [np.asarray(d, np.int64) for d in docs]))


def test_adapters():
    b = _batch([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    fa = flash_attn_kwargs(b)
    assert fa["cu_seqlens_q"].dtype == torch.int32 and fa["cu_seqlens_q"].tolist() == [0, 3, 5, 9]
    assert fa["max_seqlen_q"] == fa["max_seqlen_k"] == 4 and type(fa["max_seqlen_k"]) is int
    hf = hf_flattening(b)
    assert set(hf) == {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
                       "max_length_q", "max_length_k", "use_cache"}
    assert hf["use_cache"] is False  # a cache object switches off transformers' document mask
    assert hf["input_ids"].shape == (1, 9) and hf["labels"][0].tolist() == \
        [-100, 2, 3, -100, 5, -100, 7, 8, 9]
    assert hf["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    p = packed_seq_params(b).as_dict()
    assert p["qkv_format"] == "thd" and p["cu_seqlens_q_padded"].tolist() == [0, 3, 5, 9]
    assert p["max_seqlen_q"] == 4


def test_flex_block_mask_equals_dense_mask():
    b = _batch([[1] * 70, [2] * 200, [3] * 30])
    doc, pos = b["document_ids"], b["position_ids"]
    dense = dense_document_mask(doc, pos)
    t = doc.shape[0]
    fn = document_mask_mod(doc, pos)
    q, k = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
    assert torch.equal(fn(0, 0, q, k), dense)
    from torch.nn.attention.flex_attention import flex_attention
    bm = flex_block_mask(b)
    q, k, v = torch.randn(3, 1, 2, t, 8, dtype=torch.float64).unbind(0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=bm), want)


# ---- the tiny transformer on packed data ----------------------------------------------------

def _model(attention="loop"):
    torch.manual_seed(0)
    return TinyLM(vocab=64, dim=32, layers=2, heads=4, attention=attention).double()


def _run(model, b):
    return model(b["input_ids"], b["position_ids"], b["cu_seqlens"], b["max_seqlen"])


def test_packed_equals_unpacked_logits_and_loss():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 64, n) for n in (17, 1, 40, 5, 23)]
    model = _model()
    b = _batch(docs)
    logits = _run(model, b)
    cu = b["cu_seqlens"].tolist()
    total = 0.0
    for j, d in enumerate(docs):
        one = _batch([d])
        lo = _run(model, one)
        torch.testing.assert_close(logits[cu[j]:cu[j + 1]], lo, rtol=1e-10, atol=1e-10)
        total = total + token_loss_sum(lo, one["shift_labels"])
    torch.testing.assert_close(token_loss_sum(logits, b["shift_labels"]), total)
    # the block-diagonal mask path agrees with the per-document path
    masked = _model("mask")
    torch.testing.assert_close(_run(masked, b), logits, rtol=1e-10, atol=1e-10)


def test_tiled_attention_equals_untiled(monkeypatch):
    # documents longer, shorter and a multiple of the tile; tiles of 8 tokens
    import tools.tiny_lm as tl
    monkeypatch.setattr(tl, "TILE", 8)
    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 64, n) for n in (37, 3, 16, 8, 21)]
    b = _batch(docs)
    loop, tiled = _model("loop"), _model("tiled")
    out = _run(tiled, b)
    torch.testing.assert_close(out, _run(loop, b), rtol=1e-10, atol=1e-10)
    out.sum().backward()
    _run(loop, b).sum().backward()
    for p, q in zip(tiled.parameters(), loop.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10)


def test_no_attention_across_documents():
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 64, n) for n in (12, 9, 15)]
    model = _model("mask")
    base = _run(model, _batch(docs))
    changed = [docs[0], (docs[1] + 1) % 64, docs[2]]
    out = _run(model, _batch(changed))
    # documents 0 and 2 are untouched by a change inside document 1
    torch.testing.assert_close(out[:12], base[:12], rtol=0, atol=0)
    torch.testing.assert_close(out[21:], base[21:], rtol=0, atol=0)
    assert not torch.allclose(out[12:21], base[12:21])


def test_gradients_packed_accumulation_equal_unpacked_token_mean():
    """One step: every DP rank's microbatches, summed loss / step loss tokens, accumulated, vs
    every document alone with the token-mean loss of the whole global batch."""
    rng = np.random.default_rng(2)
    L = rng.integers(2, 120, 60)
    ds = FlatTokens.from_lengths(L, vocab=64, seed=2)
    per_rank = _epoch_batches(L, ds, dp=2, cap=256)
    step0 = [b for batches in per_rank for b in batches if b["step"] == 0]
    assert len(step0) >= 3
    packed = _model()
    for b in step0:
        (token_loss_sum(_run(packed, b), b["shift_labels"]) / b["step_loss_tokens"]).backward()
    ref = _model()
    losses, count = [], 0
    for b in step0:
        for s, a, ln in zip(b["sample_ids"].tolist(), b["sample_starts"].tolist(),
                            np.diff(b["cu_seqlens"].numpy()).tolist()):
            one = _batch([ds[s][a:a + ln]])
            losses.append(token_loss_sum(_run(ref, one), one["shift_labels"]))
            count += ln - 1
    (torch.stack(losses).sum() / count).backward()
    assert count == step0[0]["step_loss_tokens"]
    for (n, p), q in zip(packed.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=n)


# ---- rows whose token count differs from the plan (issue #13 item 4) ---------------------------

def _resized(L, k, delta):
    """FlatTokens whose sample ``k`` has ``delta`` more (or fewer) tokens than planned."""
    real = np.array(L, np.int64)
    real[k] += delta
    return FlatTokens.from_lengths(real, vocab=50)


def _fetch_all(sampler, ds):
    pd = PackedDataset(ds)
    return [pd.__getitems__(r) for r in sampler]


@pytest.mark.parametrize("delta", [+7, -3])
@pytest.mark.parametrize("chunked", [False, True])
def test_row_longer_or_shorter_than_planned_is_an_error_naming_it(delta, chunked):
    rng = np.random.default_rng(5)
    L = rng.integers(10, 400, 60)
    if chunked:
        L[17] = 1100  # cut into pieces of 512: 0..512, 512..1024, 1024..1100
    k = 17
    lay = Layout(dp=1, microbatches=2, capacity=512)
    s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"),
                           dp_rank=0)
    with pytest.raises(ValueError) as e:
        _fetch_all(s, _resized(L, k, delta))
    msg = str(e.value)
    assert f"sample {k}" in msg and f"{L[k] + delta} tokens" in msg and f"{L[k]}" in msg
    assert "plan" in msg and ("re-plan" in msg or "same lengths" in msg)
    # the planned lengths fetch every token exactly once (a fresh sampler: the one above
    # stopped mid-epoch, and a sampler resumes where it stopped)
    s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(over_length="chunk"),
                           dp_rank=0)
    got = _fetch_all(s, FlatTokens.from_lengths(L, vocab=50))
    assert sum(len(d) for f in got for d in f.docs) == L.sum()


def test_row_length_checked_with_a_prebuilt_plan_and_no_sample_table():
    from balancer import plan_epoch
    L = np.random.default_rng(6).integers(10, 400, 60)
    lay = Layout(dp=1, microbatches=2, capacity=512)
    plan = plan_epoch(SampleTable(L), COST, lay, PlannerConfig(), 0)
    s = PackedBatchSampler(plan=plan, dp_rank=0)  # lengths known only from the plan
    with pytest.raises(ValueError, match=rf"sample 3 has {L[3] + 1} tokens but the plan .*{L[3]}"):
        _fetch_all(s, _resized(L, 3, +1))


def test_rows_through_a_dataloader_with_workers_name_the_sample():
    L = np.random.default_rng(7).integers(10, 400, 40)
    lay = Layout(dp=1, microbatches=2, capacity=512)
    s = PackedBatchSampler(SampleTable(L), COST, lay, PlannerConfig(), dp_rank=0)
    dl = torch.utils.data.DataLoader(PackedDataset(_resized(L, 0, +4000)), batch_sampler=s,
                                     collate_fn=PackedCollator(), num_workers=2)
    with pytest.raises(ValueError, match=r"sample 0 has \d+ tokens but the plan"):
        list(dl)
