"""Multimodal collation: placeholders match media token counts, every token and item appears
once, and scattering post-balanced encoder outputs (exchanged between DP ranks) into the packed
sequences equals encoding every sample on its own, in the logits and in one training step's
gradients, with a tiny real vision/audio encoder and the tiny LM."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from balancer import Layout, PlannerConfig
from balancer.loader.collate import IGNORE
from balancer.multimodal.collate import (MediaTokens, MMExample, collate_microbatch, encoder_batch,
    exchange_local, expand_sample, step_route)
from balancer.multimodal.cost import EncoderSpec, MMCostModel, ModalityCost, ProjectorSpec
from balancer.multimodal.plan import MMConfig, check_media_coverage, plan_multimodal
from balancer.multimodal.table import AUDIO, AudioRule, MediaRules, MultimodalTable, VisionRule
from balancer.cost.model import CostModel

from tools.tiny_lm import TinyLM  # noqa: E402

VOCAB, IN_DIM, DIM = 64, 6, 16
MARK = MediaTokens(image=61, video=62, audio=63)
RULES = MediaRules(vision=VisionRule(patch_size=1, spatial_merge=2, temporal_patch=2,
                                     min_tokens=1, max_tokens=12),
                   audio=AudioRule(frames_per_position=1, positions_per_token=2))


def tiny_cost():
    enc = EncoderSpec(hidden=8, layers=1, heads=1, ffn=16, in_dim=IN_DIM)
    proj = ProjectorSpec(in_dim=32, hidden=8, out_dim=DIM)
    return MMCostModel(name="tiny", llm=CostModel.quadratic(256), rules=RULES,
                       vision=ModalityCost(encoder=enc, projector=proj),
                       audio=ModalityCost(encoder=enc, projector=proj))


def make_data(n, seed):
    rng = np.random.default_rng(seed)
    text = rng.integers(1, 12, n)
    n_img = rng.integers(0, 3, n)
    n_vid = (rng.random(n) < 0.25).astype(np.int64)
    n_aud = (rng.random(n) < 0.25).astype(np.int64)

    def off(c):
        return np.concatenate([[0], np.cumsum(c)])
    ki, kv, ka = int(n_img.sum()), int(n_vid.sum()), int(n_aud.sum())
    table = MultimodalTable.build(
        text, RULES,
        images=(off(n_img), RULES.vision.image_grids(rng.integers(1, 7, ki), rng.integers(1, 7, ki))),
        videos=(off(n_vid), RULES.vision.video_grids(rng.integers(1, 5, kv), rng.integers(1, 5, kv),
                                                     rng.integers(1, 5, kv))),
        audios=(off(n_aud), RULES.audio.grids(rng.integers(1, 9, ka))))
    examples = []
    for s in range(n):
        sl = table.media_of(s)
        kinds = table.media_kind[sl]
        ids = list(rng.integers(0, 60, int(text[s])))
        for kd in rng.permutation(np.array(kinds)):  # markers interleaved at random places
            ids.insert(int(rng.integers(0, len(ids) + 1)), MARK.of(int(kd)))
        media = [rng.standard_normal((int(p), IN_DIM)).astype(np.float32)
                 for p in table.media_positions[sl]]
        examples.append(MMExample(np.array(ids, np.int64), media))
    return table, examples


class TinyEncoder(nn.Module):
    """Patch embedding, one attention layer inside each item, merge of consecutive positions
    (4 for vision, 2 for audio, zero-padded), projector to the LM width."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(IN_DIM, 8)
        self.qkv = nn.Linear(8, 24)
        self.o = nn.Linear(8, 8)
        self.proj = nn.Linear(32, DIM)

    def forward(self, x, cu, kinds):
        h = self.inp(x)
        outs = []
        for j, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            q, k, v = self.qkv(h[lo:hi]).chunk(3, dim=-1)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
            y = h[lo:hi] + self.o(a)
            g = 2 if kinds[j] == AUDIO else 4
            pad = (-y.shape[0]) % g
            y = torch.cat([y, y.new_zeros(pad, 8)]).reshape(-1, g * 8)
            if g == 2:
                y = torch.cat([y, y.new_zeros(y.shape[0], 16)], dim=1)
            outs.append(self.proj(y))
        return torch.cat(outs) if outs else x.new_zeros(0, DIM)


def lm_forward(lm, embeds, pos, cu, maxlen):
    x = embeds
    for b in lm.blocks:
        x = b(x, pos, cu)
    return lm.head(lm.norm(x))


def reference_sample(enc, lm, table, ex, s):
    """Sample s encoded and run entirely on its own, with labels from first principles."""
    sl = table.media_of(s)
    ids, first = expand_sample(ex, s, table.media_kind[sl], table.media_tokens[sl], MARK)
    emb = lm.embed(torch.from_numpy(ids)).clone()
    for j, m in enumerate(range(sl.start, sl.stop)):
        x = torch.from_numpy(ex.media[j])
        y = enc(x, torch.tensor([0, x.shape[0]]), [int(table.media_kind[m])])
        emb[first[j]:first[j] + y.shape[0]] = y
    n = ids.shape[0]
    logits = lm_forward(lm, emb, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
    ph = np.isin(ids, [MARK.image, MARK.video, MARK.audio])
    placeholder = np.zeros(n, bool)
    for j, m in enumerate(range(sl.start, sl.stop)):
        placeholder[first[j]:first[j] + table.media_tokens[m]] = True
    assert np.array_equal(ph, placeholder)
    tgt = np.full(n, IGNORE)
    for t in range(n - 1):
        if not placeholder[t] and not placeholder[t + 1]:
            tgt[t] = ids[t + 1]
    return logits, torch.from_numpy(tgt)


@pytest.mark.parametrize("dp,mode", [(2, "post"), (3, "post"), (2, "joint")])
def test_packed_exchange_equals_per_sample(dp, mode):
    torch.manual_seed(0)
    table, examples = make_data(28, seed=dp)
    cost = tiny_cost()
    layout = Layout(dp=dp, microbatches=2, capacity=96)
    mp = plan_multimodal(table, cost, layout, PlannerConfig(strategy="balanced", seed=1),
                         MMConfig(mode=mode, encoder_capacity=10_000))
    assert check_media_coverage(mp) == {"media_lost": 0, "media_duplicated": 0}
    fetch = examples.__getitem__
    enc, lm = TinyEncoder(), TinyLM(VOCAB, DIM, 1, 2)
    plan = mp.plan
    seen_tokens = np.zeros(len(table), np.int64)
    seen_media = np.zeros(table.n_media, np.int64)
    loss = 0.0
    logits_of = {}
    moved = 0
    for step in range(plan.n_steps):
        routes = [step_route(mp, step, r) for r in range(dp)]
        outs = []
        for r in range(dp):
            eb = encoder_batch(mp, step, r, fetch)
            seen_media[eb["media_ids"]] += 1
            y = enc(torch.from_numpy(eb["pixel_values"]), torch.from_numpy(eb["cu_positions"]),
                    eb["media_kinds"].tolist())
            assert y.shape[0] == int(eb["media_tokens"].sum())
            outs.append(y)
        recv = exchange_local(outs, routes)
        for r in range(dp):
            assert recv[r].shape[0] == int(routes[r].recv_splits.sum())
            for mb in plan.microbatch_ids(step, r):
                b = collate_microbatch(mp, int(mb), fetch, routes[r], MARK)
                ids = b["input_ids"]
                # placeholders exactly where the embeddings go, as many as the items' tokens
                ph = np.flatnonzero(np.isin(ids, [MARK.image, MARK.video, MARK.audio]))
                assert np.array_equal(np.sort(b["embed_positions"]), ph)
                assert ph.shape[0] == int(table.media_tokens[b["media_ids"]].sum())
                for kd in range(3):
                    sel = b["media_ids"][table.media_kind[b["media_ids"]] == kd]
                    assert int((ids == MARK.of(kd)).sum()) == int(table.media_tokens[sel].sum())
                emb = lm.embed(torch.from_numpy(ids)).clone()
                emb[torch.from_numpy(b["embed_positions"])] = recv[r][torch.from_numpy(b["embed_rows"])]
                cu = torch.from_numpy(b["cu_seqlens"])
                lg = lm_forward(lm, emb, torch.from_numpy(b["position_ids"]), cu, b["max_seqlen"])
                loss = loss + F.cross_entropy(lg, torch.from_numpy(b["shift_labels"]),
                                              ignore_index=IGNORE, reduction="sum")
                for j, s in enumerate(b["sample_ids"].tolist()):
                    seen_tokens[s] += int(cu[j + 1] - cu[j])
                    logits_of[s] = lg[int(cu[j]):int(cu[j + 1])]
        moved += int((mp.media_rank[mp.step_media(step)] != mp.media_home[mp.step_media(step)]).sum())
    assert np.array_equal(seen_tokens, table.lengths)  # every text + media token exactly once
    assert (seen_media == 1).all()                      # every item encoded exactly once
    if mode == "post":
        assert moved > 0  # the test exercises the exchange, not only local items
    loss.backward()
    grads = [p.grad.clone() for p in list(enc.parameters()) + list(lm.parameters())]
    enc.zero_grad(), lm.zero_grad()
    ref_loss = 0.0
    for s in range(len(table)):
        lg, tgt = reference_sample(enc, lm, table, examples[s], s)
        torch.testing.assert_close(logits_of[s], lg, rtol=1e-5, atol=1e-5)
        ref_loss = ref_loss + F.cross_entropy(lg, tgt, ignore_index=IGNORE, reduction="sum")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    ref_loss.backward()
    for g, p in zip(grads, list(enc.parameters()) + list(lm.parameters())):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)


def test_marker_count_mismatch_is_an_error():
    table, examples = make_data(6, seed=0)
    s = int(np.flatnonzero(np.diff(table.media_offsets) > 0)[0])
    ex = examples[s]
    bad = MMExample(ex.input_ids[~np.isin(ex.input_ids, [61, 62, 63])], ex.media)
    sl = table.media_of(s)
    with pytest.raises(ValueError, match=f"sample {s}: 0 .* markers"):
        expand_sample(bad, s, table.media_kind[sl], table.media_tokens[sl], MARK)


def test_cp_shards_keep_every_placeholder_once():
    table, examples = make_data(30, seed=5)
    layout = Layout(dp=2, cp=2, microbatches=2, capacity=128)
    mp = plan_multimodal(table, tiny_cost(), layout, PlannerConfig(seed=3),
                         MMConfig(encoder_capacity=10_000))
    fetch = examples.__getitem__
    for step in range(mp.plan.n_steps):
        for r in range(2):
            route = step_route(mp, step, r)
            for mb in mp.plan.microbatch_ids(step, r):
                parts = [collate_microbatch(mp, int(mb), fetch, route, MARK, cp_rank=c)
                         for c in range(2)]
                rows = np.concatenate([p["embed_rows"] for p in parts])
                need = parts[0]["media_ids"]
                want = sum(int(table.media_tokens[m]) for m in need)
                assert np.unique(rows).shape[0] == rows.shape[0] == want
                for p in parts:
                    ph = np.flatnonzero(np.isin(p["input_ids"], [61, 62, 63]))
                    assert np.array_equal(np.sort(p["embed_positions"]), ph)


# ---- a sample whose text differs from the plan (issue #13 item 4) ----------------------------

@pytest.mark.parametrize("delta", [+5, -1])
def test_sample_with_more_or_fewer_text_tokens_than_planned_is_an_error_naming_it(delta):
    table, examples = make_data(28, seed=3)
    layout = Layout(dp=1, microbatches=2, capacity=96)
    mp = plan_multimodal(table, tiny_cost(), layout, PlannerConfig(seed=1),
                         MMConfig(encoder_capacity=10_000))
    plan = mp.plan
    mb = 0
    s = int(plan.entry_sample[plan.entries(mb)][0])
    ex = examples[s]
    ids = ex.input_ids
    text = ids[~np.isin(ids, [MARK.image, MARK.video, MARK.audio])]
    if delta < 0 and text.shape[0] == 0:
        pytest.skip("no text token to remove")
    if delta > 0:
        ids = np.concatenate([ids, np.full(delta, 7, np.int64)])
    else:
        drop = int(np.flatnonzero(~np.isin(ids, [MARK.image, MARK.video, MARK.audio]))[0])
        ids = np.delete(ids, drop)
    changed = list(examples)
    changed[s] = MMExample(ids, ex.media)
    route = step_route(mp, 0, 0)
    planned = int(table.lengths[s])
    with pytest.raises(ValueError, match=rf"sample {s} has {planned + delta} tokens .*but the "
                                         rf"plan .*{planned}.*re-plan"):
        collate_microbatch(mp, mb, changed.__getitem__, route, MARK)
    collate_microbatch(mp, mb, examples.__getitem__, route, MARK)  # the planned data still works
