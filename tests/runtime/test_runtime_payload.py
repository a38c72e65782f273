"""Payload columns and their byte encoding (round trips, views, schema checks), padded and
list rollouts into columns, and the balancer in a one-process world (no process group): packed
keys equal the collator's, results come back in the original order."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from balancer import CostModel, Layout
from balancer.loader.collate import FetchedMicrobatch, PackedCollator
from balancer.runtime import Columns, RuntimeBalancer, balance_rollout
from balancer.runtime.exchange import decode, encode, message_bytes
from balancer.runtime.payload import csr_positions

DTYPES = [torch.int64, torch.int32, torch.float32, torch.float16, torch.bfloat16, torch.bool,
          torch.uint8, torch.float64]


@given(st.lists(st.integers(0, 9), max_size=8), st.sampled_from(DTYPES), st.sampled_from(DTYPES),
       st.sampled_from([(), (3,), (2, 2)]))
@settings(max_examples=60, deadline=None)
def test_encode_decode_round_trip(lengths, tok_dtype, smp_dtype, trailing):
    g = torch.Generator().manual_seed(len(lengths))
    n, t = len(lengths), sum(lengths)
    tokens = torch.randint(0, 100, (t,), generator=g)
    extra = (torch.randn((t, *trailing), generator=g) * 10).to(tok_dtype)
    rows = (torch.randn((n, 5), generator=g) * 10).to(smp_dtype)
    cols = Columns(np.array(lengths, np.int64), {"input_ids": tokens, "x": extra}, {"r": rows})
    buf = encode(cols, cols.schema)
    assert buf.dtype == torch.uint8 and buf.numel() == message_bytes(cols.schema, cols.lengths)
    assert buf.numel() % 8 == 0
    back = decode(buf, cols.lengths, cols.schema)
    for k in cols.token:
        assert torch.equal(back.token[k], cols.token[k])
    assert torch.equal(back.sample["r"], rows)
    # take: any order, repeated, empty
    idx = np.array([i for i in range(n)][::-1] + ([0] if n else []), np.int64)
    sub = cols.take(idx)
    for j, i in enumerate(idx):
        assert torch.equal(sub.rows("x", j), cols.rows("x", int(i)))
        assert torch.equal(sub.rows("r", j), cols.rows("r", int(i)))
    assert len(cols.take(np.zeros(0, np.int64))) == 0


def test_csr_positions():
    off = np.array([0, 3, 3, 7])
    assert csr_positions(off, np.array([2, 0])).tolist() == [3, 4, 5, 6, 0, 1, 2]
    assert csr_positions(off, np.array([1])).tolist() == []


def test_schema_mismatch_is_named():
    cols = Columns(np.array([2]), {"input_ids": torch.arange(2)}, {})
    other = Columns(np.array([2]), {"input_ids": torch.arange(2).int()}, {})
    with pytest.raises(ValueError, match="input_ids"):
        encode(other, cols.schema)
    with pytest.raises(ValueError, match="expected a tensor of 3 rows"):
        Columns(np.array([3]), {"input_ids": torch.arange(2)}, {})
    with pytest.raises(ValueError, match="wider than 8 bytes"):
        from balancer.runtime.exchange import check_schema
        check_schema(Columns(np.array([1]), {"input_ids": torch.arange(1)},
                             {"c": torch.zeros(1, dtype=torch.complex128)}).schema)


def test_from_padded_left_and_right_padding():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]])
    ids = torch.arange(15).reshape(3, 5) * mask
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1),
             "lp": ids.float() / 2, "adv": torch.randn(3, 2), "reward": torch.tensor([1., 2, 3])}
    cols = Columns.from_padded(batch)
    assert cols.lengths.tolist() == [3, 5, 1]
    assert cols.rows("input_ids", 0).tolist() == [1, 2, 3]
    assert cols.rows("input_ids", 2).tolist() == [12]
    assert "position_ids" not in cols.token and set(cols.sample) == {"adv", "reward"}
    assert torch.equal(cols.rows("lp", 1), ids[1].float() / 2)
    with pytest.raises(ValueError, match="only tensors travel"):
        Columns.from_padded(dict(batch, uid=["a", "b", "c"]))


def test_one_rank_balancer_matches_the_collator_and_restores():
    rng = np.random.default_rng(0)
    L = rng.integers(1, 300, 40)
    seqs = [torch.as_tensor(rng.integers(0, 50, n)) for n in L]
    lp = [torch.randn(int(n)) for n in L]
    r = balance_rollout(seqs, CostModel.quadratic(512), 512, extras={"lp": lp})
    assert r.plan.microbatches == len(r.microbatches) >= -(-int(L.sum()) // 512)
    seen = []
    for mb in r.microbatches:
        docs = [seqs[i].numpy() for i in mb["source_index"].tolist()]
        ref = PackedCollator()(FetchedMicrobatch(list(range(len(docs))), docs))
        for k in ("input_ids", "labels", "shift_labels", "position_ids", "cu_seqlens",
                  "document_ids"):
            assert torch.equal(mb[k], ref[k]), k
        assert mb["max_seqlen"] == ref["max_seqlen"] and int(mb["cu_seqlens"][-1]) <= 512
        assert mb["step_loss_tokens"] == int((L - 1).sum())
        seen += mb["source_index"].tolist()
    assert sorted(seen) == list(range(40))
    back = r.restore([{"out": mb["lp"] + mb["input_ids"], "n": mb["cu_seqlens"][1:] * 1.0}
                      for mb in r.microbatches], kinds={"n": "sample"})
    for i in range(40):
        assert torch.equal(back["out"][i], lp[i] + seqs[i])
    assert back["n"].shape == (40,)


def test_balancer_carries_and_offers_again():
    lay = Layout(dp=1, microbatches=1, capacity=100)
    bal = RuntimeBalancer(CostModel.quadratic(128), lay)
    cols = Columns.from_sequences([torch.arange(60), torch.arange(70), torch.arange(10)])
    r = bal.step(cols, ids=[5, 6, 7])
    ids, ages, held = bal.held
    got = sorted(r.microbatches[0]["sample_ids"].tolist())
    assert sorted(got + ids.tolist()) == [5, 6, 7] and (ages == 1).all()
    r2 = bal.step(None, final=True)
    assert sorted(got + [i for b in r2.microbatches for i in b["sample_ids"].tolist()]) == [5, 6, 7]
    assert len(bal.held[0]) == 0 and r2.plan.offers.age.max() == 1
    with pytest.raises(ValueError, match="layout.dp 2 differs"):
        RuntimeBalancer(CostModel.quadratic(128), lay.model_copy(update={"dp": 2}))
    with pytest.raises(ValueError, match="collide"):
        bal.step(Columns(np.array([2]), {"input_ids": torch.arange(2), "labels": torch.arange(2)},
                         {}))


def test_public_names():
    import balancer.runtime as rt
    for name in rt.__all__:
        assert getattr(rt, name) is not None and name in dir(rt)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rt.nope


def test_token_ids_must_be_integers():
    """A float, complex or bool token tensor is refused naming the sample (a cast would
    truncate silently); integer dtypes of any width become int64."""
    with pytest.raises(ValueError, match=r"sample 1: token ids of dtype torch.float32"):
        Columns.from_sequences([torch.arange(3), torch.tensor([1.5, 2.0])])
    mask = torch.ones(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"batch\['input_ids'\]: token ids of dtype torch.bool"):
        Columns.from_padded({"input_ids": mask.bool(), "attention_mask": mask})
    cols = Columns.from_sequences([torch.arange(3, dtype=torch.int32), [4, 5]])
    assert cols.token["input_ids"].dtype == torch.int64 and cols.lengths.tolist() == [3, 2]
    with pytest.raises(ValueError, match="input refused on rank 0: sample 0: token ids"):
        balance_rollout([torch.tensor([0.5])], CostModel.quadratic(64), 64)


def test_extras_are_never_dropped_silently():
    """extras= with a padded dict batch were ignored (the advantages never reached the
    microbatches); now they travel like the dict's own fields. A per-sample extra with the wrong
    number of rows, in either input, and a name that collides with the batch's are errors."""
    cost = CostModel.quadratic(64)
    ids = torch.arange(24).reshape(4, 6) % 7
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    adv = torch.tensor([0.5, -1.0, 2.0, 3.5])
    r = balance_rollout({"input_ids": ids, "attention_mask": mask}, cost, 64,
                        extras={"advantages": adv})
    got = {int(i): float(a) for mb in r.microbatches
           for i, a in zip(mb["source_index"].tolist(), mb["advantages"].tolist())}
    assert got == {0: 0.5, 1: -1.0, 2: 2.0, 3: 3.5}
    with pytest.raises(ValueError, match=r"extras\['input_ids'\] collides with the batch's own "
                                         r"'input_ids'"):
        balance_rollout({"input_ids": ids, "attention_mask": mask}, cost, 64,
                        extras={"input_ids": adv})
    with pytest.raises(ValueError, match=r"batch\['advantages'\] has shape \(3,\)"):
        balance_rollout({"input_ids": ids, "attention_mask": mask}, cost, 64,
                        extras={"advantages": adv[:3]})
    seqs = [torch.arange(3), torch.arange(5), torch.arange(2), torch.arange(4)]
    with pytest.raises(ValueError, match=r"sample field 'advantages': 3 rows for 4 samples"):
        balance_rollout(seqs, cost, 64, extras={"advantages": adv[:3]})
    with pytest.raises(ValueError, match=r"sample field 'advantages': 3 rows for 4 samples"):
        Columns.from_sequences(seqs, None, {"advantages": [adv[0], adv[1], adv[2]]})
