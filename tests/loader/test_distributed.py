"""The drop-in loader across real gloo process groups (spawned processes, ``file://``
rendezvous in tmp_path, timeouts): exactly-once coverage over DP ranks, equal microbatch counts
per step, one plan fingerprint; CP-sharded attention against all-gathered keys/values equals the
unsharded microbatch."""
import pytest
import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.common.gloo import TIMEOUT_S, run_ranks  # noqa: F401 (the one gloo harness)


# ---- coverage -------------------------------------------------------------------------------

def _coverage(rank, world, out, cp):
    from balancer import CostModel, Layout, PlannerConfig, SampleTable
    from balancer.loader.collate import FlatTokens, PackedCollator, PackedDataset
    from balancer.loader.sampler import PackedBatchSampler

    L = np.random.default_rng(7).integers(1, 900, 500)
    layout = Layout(dp=world // cp, cp=cp, microbatches=2, capacity=768)
    sampler = PackedBatchSampler(SampleTable(L), CostModel.quadratic(65536), layout,
                                 PlannerConfig(over_length="chunk"))  # ranks from the group
    ds = FlatTokens.from_lengths(L, vocab=97, seed=3)
    dl = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                     collate_fn=PackedCollator(), num_workers=0)
    pieces, per_step, tokens = [], {}, 0
    for b in dl:
        per_step[b["step"]] = per_step.get(b["step"], 0) + 1
        pieces += list(zip(b["sample_ids"].tolist(), b["sample_starts"].tolist(),
                           np.diff(b["cu_seqlens"].numpy()).tolist()))
        tokens += int((b["document_ids"] >= 0).sum())
    mine = {"rank": rank, "dp_rank": sampler.dp_rank, "cp_rank": sampler.cp_rank,
            "len": len(sampler), "fingerprint": sampler.plan_fingerprint,
            "per_step": per_step, "pieces": pieces, "tokens": tokens}
    allr = [None] * world
    dist.all_gather_object(allr, mine)
    if rank == 0:
        with open(Path(out) / f"coverage_cp{cp}.json", "w") as f:
            json.dump({"ranks": allr, "lengths": L.tolist()}, f)


def _all_checks(rank, world, out):
    """Every multi-rank check of this file in one process group (spawning costs seconds)."""
    for cp in (1, 2) if world == 4 else (1,):
        _coverage(rank, world, out, cp)
    for balance in ("zigzag", "auto") if world == 2 else ("zigzag",):
        _cp_attention(rank, world, out, balance)


def check_coverage(tmp_path, world, cp):
    res = json.loads((tmp_path / f"coverage_cp{cp}.json").read_text())
    ranks, L = res["ranks"], np.array(res["lengths"])
    assert len({r["fingerprint"] for r in ranks}) == 1
    assert len({r["len"] for r in ranks}) == 1
    assert len({json.dumps(r["per_step"], sort_keys=True) for r in ranks}) == 1
    assert sorted((r["dp_rank"], r["cp_rank"]) for r in ranks) == \
        sorted((d, c) for d in range(world // cp) for c in range(cp))
    # CP ranks of one DP replica see the same documents; DP replicas partition every token
    cover = np.zeros(int(L.sum()), np.int64)
    off = np.concatenate([[0], np.cumsum(L)])
    by_dp = {}
    for r in ranks:
        by_dp.setdefault(r["dp_rank"], []).append(r["pieces"])
    for dp_rank, lists in by_dp.items():
        assert all(x == lists[0] for x in lists)
        for s, a, n in lists[0]:
            cover[off[s] + a: off[s] + a + n] += 1
    assert (cover == 1).all()


# One spawned group per world size runs every check (spawning costs seconds per process).

@pytest.mark.slow
def test_two_ranks(tmp_path):
    """dp=2: exactly-once coverage, equal counts, one fingerprint; cp=2: zigzag and
    cost-chosen whole-document attention against gathered K/V equals the unsharded batch."""
    run_ranks(_all_checks, 2, tmp_path)
    check_coverage(tmp_path, 2, 1)
    for balance in ("zigzag", "auto"):
        assert all((tmp_path / f"attention_{balance}_ok{r}").exists() for r in range(2))


@pytest.mark.slow
def test_four_ranks(tmp_path):
    """dp=4 and dp=2 x cp=2 coverage; cp=4 zigzag attention against gathered K/V."""
    run_ranks(_all_checks, 4, tmp_path)
    for cp in (1, 2):
        check_coverage(tmp_path, 4, cp)
    assert all((tmp_path / f"attention_zigzag_ok{r}").exists() for r in range(4))


# ---- CP attention against all-gathered K/V (runs inside the groups above) -------------------

def _cp_attention(rank, world, out, balance):
    from balancer import CostModel
    from balancer.loader.adapters import dense_document_mask
    from balancer.loader.collate import FetchedMicrobatch, PackedCollator, pack_documents
    from balancer.loader.sampler import MicrobatchRef
    from tools.tiny_lm import Block, masked_attention, varlen_attention

    rng = np.random.default_rng(11)
    lengths = [300, 7, 45, 1, 90, 18, 5, 64]
    docs = [rng.integers(0, 50, n) for n in lengths]
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 32).double()
    block = Block(32, 4, "loop").double()
    ref = MicrobatchRef(list(range(len(docs))), cp=world, cp_rank=rank)
    shard = PackedCollator(cp_balance=balance, cost=CostModel.quadratic(256))(
        FetchedMicrobatch(ref, docs))
    if balance == "auto":  # both kinds of placement are exercised
        assert (shard["cp_owner"] >= 0).any() and (shard["cp_owner"] < 0).any()
    with torch.no_grad():
        q, k, v = block.qkv_heads(embed(shard["input_ids"]), shard["position_ids"])
        gathered = [None] * world
        dist.all_gather_object(gathered, (k, v, shard["document_ids"], shard["position_ids"],
                                          shard["cp_index"]))
        total = int(shard["cu_seqlens_padded"][-1])
        K = torch.zeros(total, *k.shape[1:], dtype=k.dtype)
        V = torch.zeros_like(K)
        doc = torch.full((total,), -1, dtype=torch.int32)
        pos = torch.zeros(total, dtype=torch.int64)
        for kk, vv, dd, pp, ii in gathered:
            K[ii], V[ii], doc[ii], pos[ii] = kk, vv, dd, pp
        mask = dense_document_mask(shard["document_ids"], shard["position_ids"], doc, pos)
        mine = masked_attention(q, K, V, mask)
        # the unsharded microbatch, document by document
        flat = pack_documents(docs)
        fq, fk, fv = block.qkv_heads(embed(torch.from_numpy(flat["input_ids"])),
                                     torch.from_numpy(flat["position_ids"]))
        want = varlen_attention(fq, fk, fv, torch.from_numpy(flat["cu_seqlens"]))
    real = shard["document_ids"] >= 0
    cu = torch.from_numpy(flat["cu_seqlens"]).long()
    at = cu[shard["document_ids"][real].long()] + shard["position_ids"][real]
    torch.testing.assert_close(mine[real], want[at], rtol=1e-10, atol=1e-10)
    counts = [None] * world
    dist.all_gather_object(counts, int(real.sum()))
    assert sum(counts) == sum(lengths)
    (Path(out) / f"attention_{balance}_ok{rank}").write_text("ok")
