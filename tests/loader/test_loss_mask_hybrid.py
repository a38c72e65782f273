"""SFT semantics in the hybrid DP x CP loader (issue 24 item 1, hybrid mode; item 2's token
columns): on every rank of a pool of 4, whole documents and zigzag shards carry the labels of
the dataset's loss mask and its token columns, and ``step_loss_tokens`` is the trained tokens of
the step, against the unpacked per-document reference."""
import numpy as np
import pytest

from balancer.config import Layout
from balancer.cost.cp import CPCostModel
from balancer.loader.collate import IGNORE, PackedDataset
from balancer.loader.hybrid import HybridBatchSampler, HybridCollator
from balancer.samples import SampleTable

from tests.loader.test_hybrid_loader import CAP, WORLD, lengths_mixed
from tests.loader.test_loss_mask import Rows, ref_document, sft_rows

import torch


def _samplers(L, loss_tokens, strategy="hybrid", over_length=None):
    model = CPCostModel.from_preset("llama-7b", CAP)
    layout = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                    rank_capacity=CAP)
    return [HybridBatchSampler(SampleTable(L), model, layout, strategy=strategy, seed=7,
                               rank=r, loss_tokens=loss_tokens, over_length=over_length)
            for r in range(WORLD)]


@pytest.mark.parametrize("strategy,over", [("hybrid", None), ("hybrid_stream", "chunk")])
def test_hybrid_rounds_train_the_masked_tokens_and_count_them(strategy, over):
    L = lengths_mixed(n=120, seed=3)
    if over:
        L[[4, 9]] = 5 * CAP + 3  # over the pool's limit: cut into pieces
    rows = sft_rows(L, seed=2)
    packed = PackedDataset(Rows(rows), loss_mask_column="completion_mask",
                           token_columns=["advantages"])
    samplers = _samplers(L, packed.loss_tokens(), strategy, over)
    coll = HybridCollator(return_tensors="np")
    n_rounds = len(samplers[0])
    per_step, claimed, pieces = {}, {}, []
    for rnd in range(n_rounds):
        batches = [coll(packed.__getitems__(s.ref(rnd))) for s in samplers]
        groups = {}
        for r, b in enumerate(batches):
            per_step[b["step"]] = per_step.get(b["step"], 0) + b["num_loss_tokens"]
            claimed.setdefault(b["step"], set()).add(b["step_loss_tokens"])
            w = b["whole"]
            if w is not None:
                cu = w["cu_seqlens"].tolist()
                for j, (s, a) in enumerate(zip(b["whole_sample_ids"].tolist(),
                                               b["whole_sample_starts"].tolist())):
                    n = cu[j + 1] - cu[j]
                    t, lab, shift, _ = ref_document(rows[s]["input_ids"],
                                                    rows[s]["completion_mask"], a, n)
                    sl = slice(cu[j], cu[j + 1])
                    assert w["input_ids"][sl].tolist() == t and w["labels"][sl].tolist() == lab
                    assert w["shift_labels"][sl].tolist() == shift
                    assert np.array_equal(w["advantages"][sl], rows[s]["advantages"][a:a + n])
                    pieces.append((s, a, n))
            if b["shard"] is not None:
                groups.setdefault(b["group_ranks"], []).append(b)
        for members in groups.values():
            sh = [m["shard"] for m in members]
            total = int(sh[0]["cu_seqlens_padded"][-1])
            full = {}
            for key in ("input_ids", "labels", "shift_labels", "advantages"):
                full[key] = np.full(total, 99, sh[0][key].dtype)
                for x in sh:
                    full[key][x["cp_index"]] = x[key]
            cu, cup = sh[0]["cu_seqlens"], sh[0]["cu_seqlens_padded"]
            for j, (s, a) in enumerate(zip(members[0]["shard_sample_ids"].tolist(),
                                           members[0]["shard_sample_starts"].tolist())):
                n = int(cu[j + 1] - cu[j])
                t, lab, shift, _ = ref_document(rows[s]["input_ids"], rows[s]["completion_mask"],
                                                a, n)
                sl = slice(int(cup[j]), int(cup[j]) + n)
                assert full["input_ids"][sl].tolist() == t and full["labels"][sl].tolist() == lab
                assert full["shift_labels"][sl].tolist() == shift
                assert np.array_equal(full["advantages"][sl], rows[s]["advantages"][a:a + n])
                pieces.append((s, a, n))
    # every token once; each step's count is the trained tokens its ranks hold
    assert sum(n for _, _, n in pieces) == int(L.sum())
    assert not over or any(a > 0 for _, a, _ in pieces)
    ref_steps = {}
    for st_, total in per_step.items():
        assert claimed[st_] == {total}
        ref_steps[st_] = total
    want = sum(ref_document(rows[s]["input_ids"], rows[s]["completion_mask"], a, n)[3]
               for s, a, n in pieces)
    assert sum(ref_steps.values()) == want < int(L.sum()) - len(L)


def test_hybrid_sampler_without_the_counts_is_refused():
    L = lengths_mixed(n=60, seed=1)
    packed = PackedDataset(Rows(sft_rows(L)), loss_mask_column="completion_mask")
    s = _samplers(L, None)[0]
    coll = HybridCollator()
    with pytest.raises(ValueError, match=r"round \d+ has \d+ trained tokens but the sampler"):
        for rnd in range(len(s)):
            coll(packed.__getitems__(s.ref(rnd)))
