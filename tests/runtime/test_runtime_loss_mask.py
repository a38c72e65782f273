"""The run-time balancer with a labels or loss-mask payload field (issue 24 item 1, the
run-time path) and per-token fields CP-sharded like the tokens (item 2): labels train exactly the
masked tokens, the counts count them over DP x CP, against the unpacked per-sample reference."""
import numpy as np
import pytest
import torch

from balancer import CostModel, Layout
from balancer.loader.collate import IGNORE
from balancer.runtime.payload import Columns
from balancer.runtime.runtime_balancer import RuntimeBalancer

from tests.loader.test_loss_mask import ref_document

COST = CostModel.quadratic(256)


def samples(n=40, seed=0):
    rng = np.random.default_rng(seed)
    L = rng.integers(1, 90, n)
    toks = [torch.as_tensor(rng.integers(0, 500, k)) for k in L]
    masks = [torch.as_tensor((rng.random(k) < 0.5).astype(np.int64)) if i % 6 else
             torch.zeros(k, dtype=torch.int64) for i, k in enumerate(L)]
    adv = [torch.randn(k, generator=torch.Generator().manual_seed(i)) for i, k in enumerate(L)]
    return toks, masks, adv


@pytest.mark.parametrize("field", ["loss_mask", "target_ids"])
def test_runtime_batches_train_the_masked_tokens(field):
    toks, masks, adv = samples(12)
    lay = Layout(dp=1, microbatches=3, capacity=400)
    vals = masks if field == "loss_mask" else [torch.where(m == 1, t, IGNORE)
                                              for t, m in zip(toks, masks)]
    kw = {"loss_mask_field": field} if field == "loss_mask" else {"labels_field": field}
    bal = RuntimeBalancer(COST, lay, **kw)
    r = bal.step(Columns.from_sequences(toks, {field: vals, "adv": adv}),
                 ids=np.arange(len(toks)) + 100, final=True)
    step_total, seen = 0, []
    for b in r.microbatches:
        cu = b["cu_seqlens"].tolist()
        mb_total = 0
        for j, s in enumerate(b["sample_ids"].tolist()):
            i = s - 100
            t, lab, shift, k = ref_document(toks[i].numpy(), masks[i].numpy())
            sl = slice(cu[j], cu[j + 1])
            assert b["labels"][sl].tolist() == lab and b["shift_labels"][sl].tolist() == shift
            assert torch.equal(b["adv"][sl], adv[i])
            mb_total += k
            seen.append(i)
        assert b["num_loss_tokens"] == b["microbatch_loss_tokens"] == mb_total
        step_total += mb_total
    assert sorted(seen) == list(range(len(toks)))
    assert all(b["step_loss_tokens"] == step_total for b in r.microbatches)
    assert step_total < sum(len(t) - 1 for t in toks)


def test_runtime_cp_shards_carry_labels_and_token_fields():
    toks, masks, adv = samples(10, seed=1)
    lay = Layout(dp=1, cp=2, microbatches=2, capacity=512)
    outs = []
    for c in range(2):
        bal = RuntimeBalancer(COST, lay, cp_rank=c, loss_mask_field="loss_mask")
        outs.append(bal.step(Columns.from_sequences(toks, {"loss_mask": masks, "adv": adv}),
                             final=True).microbatches)
    assert len(outs[0]) == len(outs[1]) > 0
    assert sorted(i for b in outs[0] for i in b["sample_ids"].tolist()) == list(range(10))
    for b0, b1 in zip(*outs):
        total = int(b0["cu_seqlens_padded"][-1])
        full = {}
        for key in ("labels", "shift_labels", "adv", "loss_mask"):
            full[key] = torch.full((total,), 99, dtype=b0[key].dtype)
            for b in (b0, b1):
                full[key][b["cp_index"]] = b[key]
        cu, cup = b0["cu_seqlens"].tolist(), b0["cu_seqlens_padded"].tolist()
        want = 0
        for j, s in enumerate(b0["sample_ids"].tolist()):
            i = s // 1  # ids default to rank + dp * index: the index with dp 1
            t, lab, shift, k = ref_document(toks[i].numpy(), masks[i].numpy())
            n = cu[j + 1] - cu[j]
            sl, pad = slice(cup[j], cup[j] + n), slice(cup[j] + n, cup[j + 1])
            assert full["labels"][sl].tolist() == lab and full["shift_labels"][sl].tolist() == shift
            assert torch.equal(full["adv"][sl], adv[i]) and (full["adv"][pad] == 0).all()
            assert torch.equal(full["loss_mask"][sl], masks[i])
            want += k
        assert b0["num_loss_tokens"] + b1["num_loss_tokens"] == want
        assert b0["microbatch_loss_tokens"] == b1["microbatch_loss_tokens"] == want


def test_runtime_refusals():
    toks, masks, _ = samples(5)
    lay = Layout(dp=1, microbatches=1, capacity=500)
    with pytest.raises(ValueError, match="not both"):
        RuntimeBalancer(COST, lay, labels_field="a", loss_mask_field="b")
    bad = [m.clone() for m in masks]
    bad[2][0] = 3
    with pytest.raises(ValueError, match=r"sample 2: loss mask column 'loss_mask' holds 3"):
        RuntimeBalancer(COST, lay, loss_mask_field="loss_mask").step(
            Columns.from_sequences(toks, {"loss_mask": bad}), ids=np.arange(5), final=True)
    with pytest.raises(ValueError, match=r"no per-token field 'loss_mask'"):
        RuntimeBalancer(COST, lay, loss_mask_field="loss_mask").step(
            Columns.from_sequences(toks), final=True)
    with pytest.raises(ValueError, match=r"labels column 'lab' has dtype float32"):
        RuntimeBalancer(COST, lay, labels_field="lab").step(
            Columns.from_sequences(toks, {"lab": [t.float() for t in toks]}), final=True)


def _two_ranks(rank, world, out):
    import json
    toks, masks, adv = samples(8, seed=10 + rank)  # each rank offers its own samples
    lay = Layout(dp=world, microbatches=2, capacity=400)
    bal = RuntimeBalancer(COST, lay, loss_mask_field="loss_mask")
    r = bal.step(Columns.from_sequences(toks, {"loss_mask": masks, "adv": adv}), final=True)
    mine = sum(b["num_loss_tokens"] for b in r.microbatches)
    claimed = sorted({b["step_loss_tokens"] for b in r.microbatches})
    ref = sum(ref_document(t.numpy(), m.numpy())[3] for t, m in zip(toks, masks))
    trained_ids = sorted(i for b in r.microbatches for i in b["sample_ids"].tolist())
    with open(f"{out}/rt_{rank}.json", "w") as f:
        json.dump({"mine": mine, "claimed": claimed, "ref": ref, "ids": trained_ids,
                   "carried": len(bal.held[0])}, f)


@pytest.mark.slow
def test_step_loss_tokens_over_two_gloo_ranks(tmp_path):
    import json
    from tests.common.gloo import run_ranks
    run_ranks(_two_ranks, 2, tmp_path)
    res = [json.loads((tmp_path / f"rt_{r}.json").read_text()) for r in range(2)]
    assert all(r["carried"] == 0 for r in res)
    assert sorted(res[0]["ids"] + res[1]["ids"]) == sorted(r + 2 * k for r in range(2)
                                                           for k in range(8))
    total = res[0]["mine"] + res[1]["mine"]
    assert total == res[0]["ref"] + res[1]["ref"]  # every rank's offered trained tokens
    assert all(r["claimed"] in ([total], []) for r in res) and res[0]["claimed"] == [total]


# ---- the streaming dataset ---------------------------------------------------------------

class MaskedRows(torch.utils.data.IterableDataset):
    """Rows with a completion mask and advantages, ids 0..n-1 (resumed by skipping)."""

    def __init__(self, n=60, seed=3):
        rng = np.random.default_rng(seed)
        self.rows = []
        for k in range(n):
            m = int(rng.integers(1, 60))
            mask = (rng.random(m) < 0.5).astype(np.int64) if k % 4 else np.zeros(m, np.int64)
            self.rows.append({"input_ids": rng.integers(0, 300, m), "completion_mask": mask,
                              "advantages": rng.standard_normal(m).astype(np.float32), "id": k})

    def __iter__(self):
        return iter(self.rows)


def _stream(src, stop=None, state=None):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from balancer.runtime import StreamingPackedDataset
    ds = StreamingPackedDataset(src, COST, Layout(dp=1, microbatches=2, capacity=128),
                                id_column="id", loss_mask_column="completion_mask",
                                token_columns=["advantages"])
    dl = StatefulDataLoader(ds, batch_size=None, num_workers=0)
    if state is not None:
        dl.load_state_dict(state)
    out, saved = [], None
    for i, b in enumerate(dl):
        out.append(b)
        if stop is not None and i + 1 == stop:
            saved = dl.state_dict()
            break
    return out, saved


@pytest.mark.slow
def test_stream_trains_the_masked_tokens_and_resumes():
    src = MaskedRows()
    full, _ = _stream(src)
    steps, seen = {}, []
    for b in full:
        cu = b["cu_seqlens"].tolist()
        for j, s in enumerate(b["sample_ids"].tolist()):
            row = src.rows[s]
            t, lab, shift, k = ref_document(row["input_ids"], row["completion_mask"])
            sl = slice(cu[j], cu[j + 1])
            assert b["labels"][sl].tolist() == lab and b["shift_labels"][sl].tolist() == shift
            assert np.array_equal(b["advantages"][sl].numpy(), row["advantages"])
            seen.append(s)
        steps.setdefault(b["step"], []).append(b)
    assert sorted(seen) == list(range(len(src.rows)))
    for bs in steps.values():
        assert {b["step_loss_tokens"] for b in bs} == {sum(b["num_loss_tokens"] for b in bs)}
    # resumed mid-stream (carried samples hold their mask and columns): the same batches
    k = len(full) // 2
    head, state = _stream(src, stop=k)
    tail, _ = _stream(src, state=state)
    for a, b in zip(head + tail, full):
        for key in ("sample_ids", "labels", "shift_labels", "advantages"):
            assert torch.equal(a[key], b[key]), key
    assert len(head) + len(tail) == len(full)
