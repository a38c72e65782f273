"""Run-time balancing across real gloo process groups (2 and 4 spawned ranks, ``file://``
rendezvous in tmp_path, a timeout): RL rollouts (padded dicts, variable-length lists, an empty
rank, a rank whose only sample fills a whole microbatch, one sample per rank), payload tensors
intact and back in the original order, every plan equal to the offline planner's on every rank
(RL steps and every step of the streams), an over-capacity sample refused by name on every rank
(rollouts and streams), and streams of unequal lengths (an empty one included, a row as long as
the capacity, carried samples flushed at the end) trained exactly once under both policies,
from a plain ``IterableDataset`` and a Hugging Face ``IterableDataset`` split with
``split_dataset_by_node``, resumed exactly at several points through StatefulDataLoader."""
import io

import numpy as np
import pytest
import torch
import torch.distributed as dist

from runtime_ranks import read, run_ranks, write

CAP = 128


def _plan_matches_offline(plan, cost):
    from balancer import SampleTable, plan_epoch
    ref = plan_epoch(SampleTable(plan.offers.length[plan.stream]), cost, plan.layout, plan.config)
    n0 = plan.dp * int(ref.step_mbs[0])
    return bool(np.array_equal(plan.stream[ref.entry_sample[:ref.mb_offsets[n0]]], plan.entry)
                and np.array_equal(ref.mb_offsets[:n0 + 1], plan.mb_offsets))


# ---- RL rollouts -------------------------------------------------------------------------------

def _padded_rollout(rank, world):
    """verl-shaped: prompt left-padded to P, response right-padded to R."""
    sizes = {2: [7, 3], 4: [6, 0, 11, 2]}[world]
    b, P, R = sizes[rank], 24, 40
    g = torch.Generator().manual_seed(100 + rank)
    plen = torch.randint(1, P + 1, (b,), generator=g)
    rlen = torch.randint(1, R + 1, (b,), generator=g)
    if rank == 0 and b:
        plen[0], rlen[0] = P, R  # one of the longest, cost-heavy
    mask = torch.zeros(b, P + R, dtype=torch.int64)
    rmask = torch.zeros(b, R, dtype=torch.int64)
    for i in range(b):
        mask[i, P - plen[i]:P + rlen[i]] = 1
        rmask[i, :rlen[i]] = 1
    ids = torch.randint(3, 1000, (b, P + R), generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask,
            "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "old_log_probs": torch.randn(b, P + R, generator=g) * mask,
            "advantages": torch.randn(b, R, generator=g) * rmask,
            "response_mask": rmask, "rewards": torch.randn(b, generator=g)}


def _rl(rank, world, out):
    from balancer import CostModel
    from balancer.runtime import balance_rollout
    cost = CostModel.quadratic(256)
    batch = _padded_rollout(rank, world)
    b = batch["input_ids"].shape[0]
    ids = torch.arange(b) + 1000 * rank
    r = balance_rollout(batch, cost, CAP, ids=ids.numpy())
    everyone = [None] * world
    dist.all_gather_object(everyone, batch)
    ok = {"offline": _plan_matches_offline(r.plan, cost), "intact": True}
    trained = []
    for mb in r.microbatches:
        assert int(mb["cu_seqlens"][-1]) <= CAP
        cu = mb["cu_seqlens"].long()
        for k, (s, i) in enumerate(zip(mb["source_rank"].tolist(), mb["source_index"].tolist())):
            src = everyone[s]
            m = src["attention_mask"][i].bool()
            seg = slice(int(cu[k]), int(cu[k + 1]))
            ok["intact"] &= torch.equal(mb["input_ids"][seg], src["input_ids"][i][m])
            ok["intact"] &= torch.equal(mb["old_log_probs"][seg], src["old_log_probs"][i][m])
            ok["intact"] &= torch.equal(mb["advantages"][k], src["advantages"][i])
            ok["intact"] &= torch.equal(mb["rewards"][k], src["rewards"][i])
            ok["intact"] &= torch.equal(mb["position_ids"][seg], torch.arange(int(m.sum())))
        trained += mb["sample_ids"].tolist()
    outs = [{"lp": mb["old_log_probs"] * 2 + mb["input_ids"], "v": mb["rewards"] + 1,
             "adv_sum": mb["advantages"].sum(1, keepdim=True)} for mb in r.microbatches]
    back = r.restore(outs)
    m = batch["attention_mask"].bool()
    ok["restored"] = bool(
        torch.equal(back["lp"], (batch["old_log_probs"] * 2 + batch["input_ids"]) * m) and
        torch.equal(back["v"], batch["rewards"] + 1) and
        torch.equal(back["adv_sum"], batch["advantages"].sum(1, keepdim=True)))
    # variable-length list input with per-token and per-sample extras
    g = torch.Generator().manual_seed(7 + rank)
    n = [4, 9, 0, 5][rank] if world == 4 else [1, 12][rank]
    seqs = [torch.randint(0, 50, (int(torch.randint(1, CAP, (1,), generator=g)),), generator=g)
            for _ in range(n)]
    lp = [torch.randn(len(s), generator=g) for s in seqs]
    ids2 = [5000 + 100 * rank + i for i in range(n)]
    r2 = balance_rollout(seqs, cost, CAP, extras={"lp": lp, "score": torch.arange(n) * 1.0},
                         step=1, ids=ids2)
    outs2 = [{"lp": mb["lp"] * 3, "score": mb["score"] - 1} for mb in r2.microbatches]
    back2 = r2.restore(outs2, kinds={"score": "sample"})
    ok["list_restored"] = all(torch.equal(back2["lp"][i], lp[i] * 3) for i in range(n)) and \
        bool(torch.equal(back2["score"], torch.arange(n) * 1.0 - 1))
    ok["list_offline"] = _plan_matches_offline(r2.plan, cost)
    # an empty rank, and a rank whose only sample fills a whole microbatch
    trained2 = [i for mb in r2.microbatches for i in mb["sample_ids"].tolist()]
    given = {"trained": trained + trained2, "given": ids.tolist() + ids2}
    for step, (counts, lens) in enumerate(_EDGE[world], start=3):
        name, res = f"edge{step}", _list_case(rank, counts[rank], lens.get(rank), cost, step)
        ok.update({f"{name}_{k}": v for k, v in res["ok"].items()})
        given["trained"] += res["trained"]
        given["given"] += res["given"]
    # bad input on one rank (no mask; too few outputs back): the same error on every rank, no
    # rank left waiting in a collective
    bad = {"input_ids": torch.ones(2, 3, dtype=torch.int64)} if rank == world - 1 else \
        [torch.ones(3, dtype=torch.int64)]
    refused = []
    try:
        balance_rollout(bad, cost, CAP, step=6)
    except ValueError as e:
        refused.append(str(e))
    r3 = balance_rollout([torch.ones(5, dtype=torch.int64)] * 3, cost, CAP, step=7)
    outs3 = [{"x": mb["input_ids"] * 1.0} for mb in r3.microbatches]
    try:
        r3.restore(outs3[1:] if rank == 0 else outs3)
    except ValueError as e:
        refused.append(str(e))
    # a sample over the capacity: the same clear error on every rank
    big = [torch.ones(CAP + 5 if rank == world - 1 else 3, dtype=torch.int64)]
    try:
        balance_rollout(big, cost, CAP, step=2, ids=[77 + rank])
        msg = None
    except ValueError as e:
        msg = str(e)
    write(out, f"rl_{rank}.json", {"ok": ok, "trained": given["trained"],
                                    "fingerprint": r.plan.fingerprint(),
                                    "n_mb": len(r.microbatches), "given": given["given"],
                                    "error": msg, "refused": refused,
                                    "n_mb3": len(r3.microbatches), "stats": dict(r.plan.stats)})


# per world: (samples per rank, {rank: its single sample's length}) of the edge cases
_EDGE = {2: [([0, 9], {}), ([1, 9], {0: CAP}), ([1, 1], {0: CAP, 1: 1})],
         4: [([5, 0, 7, 1], {}), ([1, 0, 6, 3], {0: CAP}), ([1, 1, 1, 1], {3: CAP})]}


def _list_case(rank, n, single, cost, step):
    """``n`` variable-length samples on this rank (``single``: the length of a lone sample)
    with per-token and per-sample extras, balanced, checked intact and restored in order."""
    from balancer.runtime import balance_rollout
    g = torch.Generator().manual_seed(31 * step + rank)
    lens = [single] if single is not None else \
        [int(torch.randint(1, CAP // 2, (1,), generator=g)) for _ in range(n)]
    seqs = [torch.randint(0, 50, (ln,), generator=g) for ln in lens[:n]]
    lp = [torch.randn(len(x), generator=g) for x in seqs]
    ids = [10_000 * step + 100 * rank + i for i in range(n)]
    r = balance_rollout(seqs, cost, CAP, extras={"lp": lp, "w": torch.arange(n) * 1.0 + rank},
                        ids=ids, step=step)
    ok = {"offline": _plan_matches_offline(r.plan, cost), "intact": True,
          "capacity": all(int(mb["cu_seqlens"][-1]) <= CAP for mb in r.microbatches),
          "same_count": len(r.microbatches) == r.plan.microbatches}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (seqs, lp))
    for mb in r.microbatches:
        cu = mb["cu_seqlens"].long()
        for k, (s, i) in enumerate(zip(mb["source_rank"].tolist(), mb["source_index"].tolist())):
            seg = slice(int(cu[k]), int(cu[k + 1]))
            ok["intact"] &= torch.equal(mb["input_ids"][seg], everyone[s][0][i].to(torch.int64))
            ok["intact"] &= torch.equal(mb["lp"][seg], everyone[s][1][i])
            ok["intact"] &= float(mb["w"][k]) == i + s
    back = r.restore([{"lp2": mb["lp"] * 2, "w2": mb["w"] - 1} for mb in r.microbatches],
                     kinds={"w2": "sample"})
    ok["restored"] = len(back["lp2"]) == n and all(
        torch.equal(back["lp2"][i], lp[i] * 2) for i in range(n)) and \
        torch.equal(back["w2"].reshape(-1), torch.arange(n) * 1.0 + rank - 1)
    trained = [i for mb in r.microbatches for i in mb["sample_ids"].tolist()]
    return {"ok": ok, "trained": trained, "given": ids}


def _check_rl(tmp_path, world):
    res = [read(tmp_path, f"rl_{r}.json") for r in range(world)]
    assert len({x["fingerprint"] for x in res}) == 1
    assert len({x["n_mb"] for x in res}) == 1 and res[0]["n_mb"] >= 1
    for x in res:
        assert all(x["ok"].values()), x["ok"]
    trained = sorted(i for x in res for i in x["trained"])
    assert trained == sorted(i for x in res for i in x["given"])  # every sample exactly once
    assert res[0]["stats"]["carried"] == 0
    r = world - 1
    for x in res:
        assert x["error"] is not None and f"rank {r} sample {77 + r}: length {CAP + 5}" in x["error"] \
            and f"capacity {CAP}" in x["error"]
        assert len(x["refused"]) == 2, x["refused"]
        assert f"input refused on rank {r}: a padded rollout batch needs 'attention_mask'" \
            in x["refused"][0]
        n_mb = res[0]["n_mb3"]
        assert f"input refused on rank 0: {n_mb - 1} outputs for this rank's {n_mb} " \
            "microbatches" in x["refused"][1]


# ---- streams -----------------------------------------------------------------------------------

class Rows(torch.utils.data.IterableDataset):
    """``n`` rows of random lengths (no state_dict: resumed by skipping what was consumed);
    ids are globally unique, an empty row now and then."""

    def __init__(self, rank, n, seed=0, sizes=None):
        self.rank, self.n, self.seed = rank, n, seed
        self.sizes = sizes or {}  # (rank, k) -> length: huge rows

    def __iter__(self):
        g = np.random.default_rng([self.seed, self.rank])
        for k in range(self.n):
            ln = 0 if k % 17 == 16 else int(g.integers(1, 220))
            ln = self.sizes.get((self.rank, k), ln)
            yield {"input_ids": g.integers(0, 100, ln).tolist(), "id": self.rank * 100_000 + k}


def _hf_source(rank, world, n):
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node
    g = np.random.default_rng(5)
    rows = {"input_ids": [g.integers(0, 100, int(g.integers(1, 220))).tolist() for _ in range(n)],
            "id": list(range(n))}
    ds = Dataset.from_dict(rows).to_iterable_dataset(num_shards=3)  # 3 % world != 0: by example
    return split_dataset_by_node(ds, rank=rank, world_size=world)


def _make(kind, rank, world, uneven="drain"):
    from balancer import CostModel, Layout
    from balancer.runtime import StreamingPackedDataset
    if kind == "hf":
        src = _hf_source(rank, world, 157)
    elif kind == "tiny":
        src = Rows(rank, 1 if rank % 2 == 0 else 0)
    elif kind == "over":  # the last rank's 4th row is over the capacity
        src = Rows(rank, 12, sizes={(world - 1, 3): 300})
    elif kind == "badrow":  # the last rank's 3rd row has no tokens column
        src = [{"input_ids": [1, 2, 3], "id": 10 * rank + k} if (rank, k) != (world - 1, 2) else
               {"text": "x", "id": 10 * rank + k} for k in range(6)]
    else:  # rank 0's 6th row fills a whole microbatch (the heaviest sample there can be)
        src = Rows(rank, {2: [70, 23], 4: [45, 0, 31, 80]}[world][rank], sizes={(0, 5): 256})
    lay = Layout(dp=world, microbatches=2, capacity=256)
    return StreamingPackedDataset(src, CostModel.quadratic(1024), lay, id_column="id",
                                  uneven=uneven)


def _loader(ds):
    from torchdata.stateful_dataloader import StatefulDataLoader
    return StatefulDataLoader(ds, batch_size=None, num_workers=0)


def _run(kind, rank, world, uneven, state=None, stop_at=None):
    ds = _make(kind, rank, world, uneven)
    dl = _loader(ds)
    if state is not None:
        dl.load_state_dict(state)
    got, saved, plans = [], None, {}
    for i, b in enumerate(dl):
        assert int(b["cu_seqlens"][-1]) <= 256
        got.append([b["step"], b["slot"]] + b["sample_ids"].tolist())
        if state is None and b["step"] not in plans:  # the step's plan: fingerprint, offline?
            plans[b["step"]] = [ds.last_plan.fingerprint(),
                                _plan_matches_offline(ds.last_plan, ds.cost)]
        if stop_at is not None and i + 1 == stop_at:
            buf = io.BytesIO()
            torch.save(dl.state_dict(), buf)  # the state round-trips through torch.save
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
    return got, saved, ds.stats, plans


def _streams(rank, world, out):
    for kind, uneven in (("rows", "drain"), ("rows", "stop"), ("hf", "drain")):
        full, _, stats, plans = _run(kind, rank, world, uneven)
        resumed = {}
        n = len(full)
        for k in sorted({1, 3, max(1, n // 2), max(1, n - 1)}):
            if k >= n:
                continue
            a, st, _, _ = _run(kind, rank, world, uneven, stop_at=k)
            b, _, _, _ = _run(kind, rank, world, uneven, state=st)
            resumed[k] = (a == full, b == full[k:])
        write(out, f"stream_{kind}_{uneven}_{rank}.json",
              {"full": full, "stats": stats, "plans": plans,
               "resumed": {str(k): v for k, v in resumed.items()}})
    full, _, stats, _ = _run("tiny", rank, world, "drain")
    write(out, f"stream_tiny_{rank}.json", {"full": full, "stats": stats})
    try:  # a row over the capacity: the same error on every rank, at the same step
        _run("over", rank, world, "drain")
        msg = None
    except ValueError as e:
        msg = str(e)
    write(out, f"stream_over_{rank}.json", {"error": msg})
    try:  # a row without the tokens column on one rank: raised on every rank, naming it
        _run("badrow", rank, world, "drain")
        msg = None
    except ValueError as e:
        msg = str(e)
    write(out, f"stream_badrow_{rank}.json", {"error": msg})


def _check_streams(tmp_path, world):
    sizes = {2: [70, 23], 4: [45, 0, 31, 80]}[world]
    for kind, uneven in (("rows", "drain"), ("rows", "stop"), ("hf", "drain")):
        res = [read(tmp_path, f"stream_{kind}_{uneven}_{r}.json") for r in range(world)]
        # every rank runs the same steps with the same number of microbatches
        shapes = [[tuple(x[:2]) for x in r["full"]] for r in res]
        assert all(s == shapes[0] for s in shapes)
        for r in res:
            assert r["resumed"] and all(all(v) for v in r["resumed"].values()), r["resumed"]
        # every step's plan is the same on every rank and is the offline planner's plan
        assert all(r["plans"] == res[0]["plans"] for r in res)
        assert res[0]["plans"] and all(ok for _, ok in res[0]["plans"].values())
        assert len(res[0]["plans"]) == len({x[0] for x in res[0]["full"]})
        trained = [i for r in res for x in r["full"] for i in x[2:]]
        assert len(trained) == len(set(trained))  # nothing twice
        st = res[0]["stats"]
        assert st["trained"] == len(trained)
        assert sum(r["stats"]["trained_here"] for r in res) == len(trained)
        read_rows = sum(r["stats"]["read"] for r in res)
        empty = sum(r["stats"]["empty"] for r in res)
        # every row read is trained, or counted: empty, unplanned (named), skipped
        assert read_rows - empty == len(trained) + st["unplanned"] + st["skipped"]
        assert not set(st["unplanned_ids"]) & set(trained)
        if kind == "hf":
            assert read_rows == 157 and set(trained) | set(st["unplanned_ids"]) == set(range(157))
        elif uneven == "drain":
            assert read_rows == sum(sizes)
            want = {r * 100_000 + k for r, n in enumerate(sizes) for k in range(n) if k % 17 != 16}
            assert set(trained) | set(st["unplanned_ids"]) == want
        else:  # stop: the step where the shortest stream ends is the last one read
            assert st["unread_ranks"] and read_rows <= sum(sizes)
            assert all(r["stats"]["read"] == sizes[i] or i in st["unread_ranks"]
                       for i, r in enumerate(res))
        assert st["max_age"] <= 4 or st["carry_bound_exceeded"] > 0
    # fewer rows in all streams together than ranks: no step can be made; reported by id
    res = [read(tmp_path, f"stream_tiny_{r}.json") for r in range(world)]
    assert all(r["full"] == [] for r in res)
    want = sorted(r * 100_000 for r in range(0, world, 2))
    assert all(sorted(r["stats"]["unplanned_ids"]) == want for r in res)
    assert res[0]["stats"]["unplanned"] == len(want) and res[0]["stats"]["trained"] == 0
    r = world - 1
    for x in [read(tmp_path, f"stream_badrow_{q}.json") for q in range(world)]:
        assert x["error"] is not None and f"input refused on rank {r}: row 2 of this rank's " \
            "stream has no 'input_ids' (columns: ['id', 'text'])" in x["error"], x["error"]
    for x in [read(tmp_path, f"stream_over_{q}.json") for q in range(world)]:
        assert x["error"] is not None and f"rank {r} sample {r * 100_000 + 3}: length 300 " \
            "exceeds the microbatch capacity 256" in x["error"], x["error"]


# ---- one spawned group per world size ----------------------------------------------------------

def _all(rank, world, out):
    _rl(rank, world, out)
    _streams(rank, world, out)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_runtime_ranks(tmp_path, world):
    """RL rollouts and streams over ``world`` gloo ranks (see the module docstring)."""
    run_ranks(_all, world, tmp_path)
    _check_rl(tmp_path, world)
    _check_streams(tmp_path, world)
