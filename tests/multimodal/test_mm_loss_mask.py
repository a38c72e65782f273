"""A multimodal example's labels or loss mask (issue 24 item 1, the multimodal collator): the
packed microbatch trains exactly the text tokens the example trains, never a placeholder nor a
placeholder's prediction, on every CP shard; counts equal the per-sample reference."""
import numpy as np
import pytest

from balancer import Layout, PlannerConfig
from balancer.loader.collate import IGNORE
from balancer.multimodal.collate import MMExample, collate_microbatch, expand_sample, step_route
from balancer.multimodal.plan import MMConfig, plan_multimodal

from tests.multimodal.test_mm_collate import MARK, make_data, tiny_cost


def with_masks(examples, seed, as_labels):
    rng = np.random.default_rng(seed)
    out = []
    for k, ex in enumerate(examples):
        n = ex.input_ids.shape[0]
        m = (rng.random(n) < 0.6).astype(np.int64) if k % 5 else np.zeros(n, np.int64)
        if as_labels:
            out.append(MMExample(ex.input_ids, ex.media, labels=np.where(m == 1, ex.input_ids,
                                                                         IGNORE)))
        else:
            out.append(MMExample(ex.input_ids, ex.media, loss_mask=m))
    return out


def reference_targets(table, ex, s):
    """shift targets of sample s alone: the next token where it is trained text and neither it
    nor the current token is a placeholder."""
    sl = table.media_of(s)
    ids, first = expand_sample(ex, s, table.media_kind[sl], table.media_tokens[sl], MARK)
    n = ids.shape[0]
    ph = np.zeros(n, bool)
    for j, m in enumerate(range(sl.start, sl.stop)):
        ph[first[j]:first[j] + table.media_tokens[m]] = True
    text_trained = (ex.loss_mask == 1) if ex.loss_mask is not None else ex.labels != IGNORE
    trained = np.zeros(n, bool)
    trained[~ph] = text_trained[~np.isin(ex.input_ids, [MARK.image, MARK.video, MARK.audio])]
    tgt = np.full(n, IGNORE)
    for t in range(n - 1):
        if not ph[t] and not ph[t + 1] and trained[t + 1]:
            tgt[t] = ids[t + 1]
    return tgt


@pytest.mark.parametrize("cp,as_labels", [(1, False), (2, True), (2, False)])
def test_masked_multimodal_microbatches_equal_per_sample_reference(cp, as_labels):
    table, examples = make_data(30, seed=5)
    examples = with_masks(examples, 1, as_labels)
    layout = Layout(dp=2, cp=cp, microbatches=2, capacity=128)
    mp = plan_multimodal(table, tiny_cost(), layout, PlannerConfig(seed=3),
                         MMConfig(encoder_capacity=10_000))
    fetch = examples.__getitem__
    seen = 0
    for step in range(mp.plan.n_steps):
        for r in range(2):
            route = step_route(mp, step, r)
            for mb in mp.plan.microbatch_ids(step, r):
                parts = [collate_microbatch(mp, int(mb), fetch, route, MARK, cp_rank=c)
                         for c in range(cp)]
                p0 = parts[0]
                total = int(p0["cu_seqlens_padded"][-1])
                shift = np.full(total, IGNORE, np.int64)
                if cp == 1:
                    shift[:] = p0["shift_labels"]
                else:
                    for p in parts:
                        shift[p["cp_index"]] = p["shift_labels"]
                cu, cup = p0["cu_seqlens"], p0["cu_seqlens_padded"]
                want_total = 0
                for j, s in enumerate(p0["sample_ids"].tolist()):
                    tgt = reference_targets(table, examples[s], s)
                    n = int(cu[j + 1] - cu[j])
                    assert n == tgt.shape[0]  # samples with media are never cut
                    assert shift[int(cup[j]):int(cup[j]) + n].tolist() == tgt.tolist()
                    want_total += int((tgt != IGNORE).sum())
                    seen += 1
                assert sum(p["num_loss_tokens"] for p in parts) == want_total
                assert all(p["microbatch_loss_tokens"] == want_total for p in parts)
    assert seen == len(table)


def test_mask_of_another_length_names_the_sample():
    table, examples = make_data(8, seed=2)
    ex = examples[3]
    examples[3] = MMExample(ex.input_ids, ex.media, loss_mask=np.ones(ex.input_ids.shape[0] + 1))
    layout = Layout(dp=1, microbatches=2, capacity=128)
    mp = plan_multimodal(table, tiny_cost(), layout, PlannerConfig(seed=3),
                         MMConfig(encoder_capacity=10_000))
    with pytest.raises(ValueError, match=r"sample 3: column 'loss_mask' has \d+ values"):
        for step in range(mp.plan.n_steps):
            route = step_route(mp, step, 0)
            for mb in mp.plan.microbatch_ids(step, 0):
                collate_microbatch(mp, int(mb), examples.__getitem__, route, MARK)
