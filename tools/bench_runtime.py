"""Benchmark of run-time balancing (balancer.runtime) against verl's balancing, side by side.

1. Planning, simulated in one process: ``--ranks`` (64) DP ranks x ``--samples`` (4,096)
   samples per step, RL-like lengths (prompt U[64, 1024] + response lognormal, median 1,200,
   clipped to 15,360) and a real workload (``--workload``, resampled per step); per step:
   planning time (median), per-rank imbalance (slowest rank's forward + backward cost over the
   mean, over a lower bound: max(mean, the dearest sample), and over a tighter one that also
   counts pigeonhole and capacity: ``tight_bound``), the largest microbatch in tokens
   against the capacity, microbatches per rank; and the same for a re-implementation of verl's
   ``_balance_batch`` + ``rearrange_micro_batches`` on the same batch. ``--local-search``:
   how far moving or swapping single samples of the slowest rank (capacity kept) lowers it
   (JSON ``after_local_search_over_tight_bound``, ``steps_improved_by_local_search``).
2. Real gloo collectives at ``--gloo-ranks`` (4) ranks with ``--samples`` samples per step in
   total, offered unequally (rank r holds a share proportional to r + 1): bytes and seconds per
   step of the offer all-gather, the all-to-all of the payload (token ids int64 + per-token
   log-probs float32 + a per-sample advantage), collation, and the way back (per-token
   results, checked equal to the originals in order).

Times are medians over ``--steps`` steps measured side by side in one run (each step: our plan,
then verl's balancing of the same lengths); the ratios are medians of per-step ratios.

  ./dev python tools/bench_runtime.py [--json out/bench_runtime.json]
"""
from __future__ import annotations

import argparse
import datetime
import heapq
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np



# ---- verl's balancing, re-implemented ---------------------------------------------------------
# A re-implementation, written from verl's published code (volcengine/verl, Apache-2.0, commit
# b178a3c of 29 January 2026): verl/utils/seqlen_balancing.py (calculate_workload,
# karmarkar_karp, get_seqlen_balanced_partitions, rearrange_micro_batches) and
# verl/trainer/ppo/ray_trainer.py (RayPPOTrainer._balance_batch). Credit to the verl authors;
# verl itself is not installed. The same algorithm and the same data types, so that its run time
# is what verl spends: a pure-Python Karmarkar-Karp (largest differencing over a heap of partial
# k-way partitions). _balance_batch gives it the workloads 24576 L + L^2 as a torch int64 tensor
# (the attention mask's row sums), so its sums and comparisons are 0-d tensor operations; the
# DP split has equal sample counts, and each rank's share is sorted by workload with the smaller
# ones at both ends. rearrange_micro_batches (on every rank, in parallel) cuts a rank's share
# into min(samples, ceil(tokens / max_token_len)) microbatches, the largest count over the DP
# group (all_reduce MAX), with the same Karmarkar-Karp on workloads as a Python list (.tolist())
# and no token limit per microbatch, then orders them smaller ones at both ends.

class _Set:  # verl: karmarkar_karp.Set
    __slots__ = ("sum", "items")

    def __init__(self):
        self.sum, self.items = 0, []

    def add(self, idx, val):
        self.items.append((idx, val))
        self.sum += val

    def merge(self, other):
        for idx, val in other.items:
            self.items.append((idx, val))
            self.sum += val

    def __lt__(self, other):
        if self.sum != other.sum:
            return self.sum < other.sum
        if len(self.items) != len(other.items):
            return len(self.items) < len(other.items)
        return self.items < other.items


class _State:  # verl: karmarkar_karp.State; sets kept in decreasing order
    __slots__ = ("k", "sets")

    def __init__(self, items, k):
        self.k = k
        self.sets = [_Set() for _ in range(k)]
        assert len(items) in (1, k)
        for i, (idx, seqlen) in enumerate(items):
            self.sets[i].add(idx=idx, val=seqlen)
        self.sets = sorted(self.sets, reverse=True)

    def get_partitions(self):
        return [[idx for idx, _ in s.items] for s in self.sets]

    def merge(self, other):
        for i in range(self.k):  # the largest with the other's smallest
            self.sets[i].merge(other.sets[self.k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    @property
    def spread(self):
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other):  # the heap pops the largest spread first
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0] > other.sets[0]


def verl_kk(seqlen_list, k_partitions, equal_size):
    """verl's get_seqlen_balanced_partitions: Karmarkar-Karp, then every part sorted."""
    assert len(seqlen_list) >= k_partitions
    sorted_seqlen_list = sorted([(seqlen, i) for i, seqlen in enumerate(seqlen_list)])
    states_pq = []
    if equal_size:
        assert len(seqlen_list) % k_partitions == 0
        for offset in range(0, len(sorted_seqlen_list), k_partitions):
            items = []
            for i in range(k_partitions):
                seqlen, idx = sorted_seqlen_list[offset + i]
                items.append((idx, seqlen))
            heapq.heappush(states_pq, _State(items=items, k=k_partitions))
    else:
        for seqlen, idx in sorted_seqlen_list:
            heapq.heappush(states_pq, _State(items=[(idx, seqlen)], k=k_partitions))
    while len(states_pq) > 1:
        state0 = heapq.heappop(states_pq)
        state1 = heapq.heappop(states_pq)
        state0.merge(state1)
        heapq.heappush(states_pq, state0)
    partitions = states_pq[0].get_partitions()
    assert all(len(p) > 0 for p in partitions)
    return [sorted(p) for p in partitions]


def verl_workload(seqlen):
    """verl's calculate_workload (a 7B model's 12 h^2 L + 2 h L^2 over 2 h, h = 4096)."""
    return 24576 * seqlen + seqlen ** 2


def verl_balance(lengths, dp, max_token_len):
    """verl's _balance_batch (DP split) then rearrange_micro_batches on every rank ->
    (rank of every sample, microbatch of every sample (global id), microbatches per rank,
    seconds: (DP split, microbatching on the slowest rank, microbatching summed over ranks,
    the DP split on a list of ints))."""
    import torch
    seqlen = torch.from_numpy(lengths.astype(np.int64))  # attention_mask.sum(-1)
    t0 = time.perf_counter()
    workload_lst = verl_workload(seqlen)  # a tensor, as in _balance_batch
    parts = verl_kk(workload_lst, dp, equal_size=True)
    for idx, partition in enumerate(parts):  # smaller ones at both ends
        partition.sort(key=lambda x: (workload_lst[x], x))
        parts[idx] = partition[::2] + partition[1::2][::-1]
    t_split = time.perf_counter() - t0
    # the same split on a Python list of ints (not what _balance_batch passes): the cost of the
    # pure-Python Karmarkar-Karp alone, without the 0-d tensor arithmetic
    t0 = time.perf_counter()
    as_list = verl_workload(seqlen).tolist()
    alt = verl_kk(as_list, dp, equal_size=True)
    for partition in alt:
        partition.sort(key=lambda x: (as_list[x], x))
    t_split_list = time.perf_counter() - t0
    # rearrange_micro_batches: the count every rank agrees on (all_reduce MAX)
    n_mb = max(min(len(p), -(-int(lengths[p].sum()) // max_token_len)) for p in parts)
    rank = np.empty(lengths.shape[0], np.int64)
    mb = np.empty(lengths.shape[0], np.int64)
    times = []
    for r, p in enumerate(parts):
        seq = torch.from_numpy(lengths[p].astype(np.int64))
        t1 = time.perf_counter()
        workloads = verl_workload(seq).tolist()
        micro_bsz_idx = verl_kk(workloads, n_mb, equal_size=False)
        micro_bsz_idx.sort(key=lambda q: (sum(workloads[i] for i in q), q[0] if q else 0),
                           reverse=True)
        micro_bsz_idx = micro_bsz_idx[::2][::-1] + micro_bsz_idx[1::2]
        times.append(time.perf_counter() - t1)
        for j, q in enumerate(micro_bsz_idx):
            for i in q:
                rank[p[i]], mb[p[i]] = r, r * n_mb + j
    return rank, mb, n_mb, (t_split, max(times), sum(times), t_split_list)


# ---- workloads and metrics --------------------------------------------------------------------

def rl_lengths(rng, n):
    prompt = rng.integers(64, 1025, n)
    resp = np.clip(rng.lognormal(np.log(1200), 0.9, n), 16, 15360).astype(np.int64)
    return prompt + resp


def tight_bound(cost, lengths, dp, n_mb, capacity):
    """A lower bound of the slowest rank's cost with ``n_mb`` microbatches per rank of
    ``capacity`` tokens, the largest of: the mean rank cost; the dearest sample; pigeonhole
    (of the ``j * dp + 1`` dearest samples one rank holds ``j + 1``, each at least the
    ``(j * dp + 1)``-th dearest); capacity (the other ``dp - 1`` ranks hold at most
    ``(dp - 1) * n_mb * capacity`` tokens, so the rank with the dearest sample holds the rest,
    at no less than the cheapest cost per token). Each plus ``n_mb`` microbatch constants."""
    doc = cost.doc_total(lengths)
    cf, cb = cost.microbatch_constant
    c = np.sort(doc)[::-1]
    j = np.arange((c.shape[0] - 1) // dp + 1)
    top = int(np.argmax(doc))
    rest = max(0, int(lengths.sum()) - (dp - 1) * n_mb * capacity - int(lengths[top]))
    return max(doc.sum() / dp, float(((j + 1) * c[j * dp]).max()),
               float(doc[top]) + rest * float((doc / lengths).min())) + n_mb * (cf + cb)


def local_search(cost, lengths, mb, dp, n_mb, capacity, max_moves=10_000):
    """How far simple local moves lower a plan's slowest rank (a check of the plan, not a
    planner): repeatedly the best of (a) moving one sample of the slowest rank into a
    microbatch of another rank with room for it, (b) swapping one of its samples with a cheaper
    one of another rank, both microbatches staying within ``capacity``, taken while it lowers
    the maximum of the two ranks involved below the slowest rank's cost. Returns (slowest rank
    cost after, moves made); ``mb`` int64[n] microbatch of each sample, rank = mb // n_mb."""
    doc = cost.doc_total(lengths)
    mb = mb.copy()
    mb_tok = np.bincount(mb, weights=lengths, minlength=dp * n_mb)
    rank_cost = np.bincount(mb // n_mb, weights=doc, minlength=dp)
    moves = 0
    while moves < max_moves:
        a = int(np.argmax(rank_cost))
        top = rank_cost[a]
        mine = np.flatnonzero(mb // n_mb == a)
        best = (0.0, None)
        for s in mine:
            for b in range(dp):
                if b == a or rank_cost[b] + doc[s] >= top:
                    continue
                room = np.flatnonzero(capacity - mb_tok[b * n_mb:(b + 1) * n_mb] >= lengths[s])
                gain = top - max(rank_cost[b] + doc[s], top - doc[s])
                if room.size and gain > best[0]:
                    best = (gain, ("move", s, b * n_mb + int(room[0])))
            others = np.flatnonzero((mb // n_mb != a) & (doc < doc[s]))
            d = doc[s] - doc[others]
            ok = rank_cost[mb[others] // n_mb] + d < top
            ok &= mb_tok[mb[others]] - lengths[others] + lengths[s] <= capacity
            ok &= mb_tok[mb[s]] - lengths[s] + lengths[others] <= capacity
            if ok.any():
                gains = top - np.maximum(rank_cost[mb[others] // n_mb] + d, top - d)
                gains[~ok] = 0
                k = int(np.argmax(gains))
                if gains[k] > best[0]:
                    best = (float(gains[k]), ("swap", s, int(others[k])))
        if best[1] is None:
            break
        kind, s, x = best[1]
        if kind == "swap":
            t = x
            x = mb[t]
            mb_tok[x] += lengths[s] - lengths[t]
            mb_tok[mb[s]] += lengths[t] - lengths[s]
            rank_cost[x // n_mb] += doc[s] - doc[t]
            rank_cost[mb[s] // n_mb] += doc[t] - doc[s]
            mb[t] = mb[s]
        else:
            mb_tok[x] += lengths[s]
            mb_tok[mb[s]] -= lengths[s]
            rank_cost[x // n_mb] += doc[s]
            rank_cost[mb[s] // n_mb] -= doc[s]
        mb[s] = x
        moves += 1
    return float(rank_cost.max()), moves


def metrics(cost, lengths, rank, mb, dp, n_mb, capacity):
    doc = cost.doc_total(lengths)
    cf, cb = cost.microbatch_constant
    rank_cost = np.bincount(rank, weights=doc, minlength=dp) + n_mb * (cf + cb)
    rank_tok = np.bincount(rank, weights=lengths, minlength=dp)
    mb_tok = np.bincount(mb, weights=lengths, minlength=dp * n_mb)
    bound = max(rank_cost.mean(), doc.max() + n_mb * (cf + cb))
    counts = np.bincount(rank, minlength=dp)
    return {"max_over_mean": rank_cost.max() / rank_cost.mean(),
            "max_over_bound": rank_cost.max() / bound,
            "max_over_tight_bound": rank_cost.max() / tight_bound(cost, lengths, dp, n_mb,
                                                                  capacity),
            "tokens_max_over_mean": rank_tok.max() / rank_tok.mean(),
            "max_mb_over_capacity": mb_tok.max() / capacity, "microbatches": n_mb,
            "samples_per_rank": (int(counts.min()), int(counts.max()))}


def plan_bench(args, cost, lengths_of_step, capacity):
    from balancer import Layout
    from balancer.runtime import Offers, StepPlanner
    dp = args.ranks
    planner = StepPlanner(cost, Layout(dp=dp, capacity=capacity), microbatches="auto")
    rows = {"ours": [], "verl": []}
    t_ours, t_verl = [], []
    for s in range(args.steps + 1):
        L = lengths_of_step(s)
        per = [(np.arange(r, L.shape[0], dp), L[r::dp]) for r in range(dp)]
        offers = Offers.from_ranks(per)
        t0 = time.perf_counter()
        plan = planner.plan(offers)
        dt = time.perf_counter() - t0
        if s == 0:
            continue  # the first call loads the compiled kernels
        t_ours.append(dt)
        dest = plan.dest()
        mb_of = np.empty(len(offers), np.int64)
        mb_of[plan.entry] = np.repeat(np.arange(plan.mb_offsets.shape[0] - 1),
                                      np.diff(plan.mb_offsets))
        m = metrics(cost, offers.length, dest, mb_of, dp, plan.microbatches, capacity)
        m["steps"] = 1 if plan.carried.size == 0 else 2
        if args.local_search:
            cf, cb = cost.microbatch_constant
            top, moves = local_search(cost, offers.length, mb_of, dp, plan.microbatches,
                                      capacity)
            tb = tight_bound(cost, offers.length, dp, plan.microbatches, capacity)
            m["after_local_search_over_tight_bound"] = (top + plan.microbatches * (cf + cb)) / tb
            m["local_search_moves"] = moves
        rows["ours"].append(m)
        vr, vm, vn, vt = verl_balance(L, dp, capacity)
        t_verl.append(vt)
        rows["verl"].append(metrics(cost, L, vr, vm, dp, vn, capacity))
    out = {}
    for name, rs in rows.items():
        agg = {k: float(np.median([r[k] for r in rs])) for k in
               ("max_over_mean", "max_over_bound", "tokens_max_over_mean",
             "max_over_tight_bound")}
        agg["max_mb_over_capacity"] = float(max(r["max_mb_over_capacity"] for r in rs))
        agg["worst_max_over_bound"] = float(max(r["max_over_bound"] for r in rs))
        agg["worst_max_over_tight_bound"] = float(max(r["max_over_tight_bound"] for r in rs))
        agg["microbatches_per_rank"] = [int(min(r["microbatches"] for r in rs)),
                                        int(max(r["microbatches"] for r in rs))]
        agg["samples_per_rank"] = [int(min(r["samples_per_rank"][0] for r in rs)),
                                   int(max(r["samples_per_rank"][1] for r in rs))]
        out[name] = agg
    if args.local_search:
        o = out["ours"]
        o["after_local_search_over_tight_bound"] = float(np.median(
            [r["after_local_search_over_tight_bound"] for r in rows["ours"]]))
        o["worst_after_local_search_over_tight_bound"] = float(max(
            r["after_local_search_over_tight_bound"] for r in rows["ours"]))
        o["steps_improved_by_local_search"] = int(sum(
            r["after_local_search_over_tight_bound"] < r["max_over_tight_bound"] * (1 - 1e-9)
            for r in rows["ours"]))
    out["ours"]["plan_ms_median"] = 1e3 * float(np.median(t_ours))
    out["ours"]["plan_ms_max"] = 1e3 * float(np.max(t_ours))
    out["ours"]["all_in_one_step"] = all(r["steps"] == 1 for r in rows["ours"])
    tv = np.array(t_verl)
    out["verl"]["balance_batch_ms_median"] = 1e3 * float(np.median(tv[:, 0]))
    out["verl"]["rearrange_slowest_rank_ms_median"] = 1e3 * float(np.median(tv[:, 1]))
    out["verl"]["rearrange_all_ranks_ms_median"] = 1e3 * float(np.median(tv[:, 2]))
    crit = tv[:, 0] + tv[:, 1]
    out["verl"]["critical_path_ms_median"] = 1e3 * float(np.median(crit))
    # per step, side by side: verl's DP split + the slowest rank's microbatching (its critical
    # path: ranks cut their shares in parallel) over our whole plan of the same batch
    out["speed_ratio_verl_over_ours"] = float(np.median(crit / np.array(t_ours)))
    out["speed_ratio_verl_split_only_over_ours"] = float(np.median(tv[:, 0] / np.array(t_ours)))
    out["verl"]["balance_batch_on_int_list_ms_median"] = 1e3 * float(np.median(tv[:, 3]))
    out["speed_ratio_verl_on_int_list_over_ours"] = float(
        np.median((tv[:, 3] + tv[:, 1]) / np.array(t_ours)))
    return out


# ---- real gloo collectives --------------------------------------------------------------------

def _gloo_rank(rank, world, init, out, args_d):
    import torch
    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    try:
        from balancer import load_cost_model
        from balancer.runtime import balance_rollout
        cost = load_cost_model(args_d["cost_model"])
        # unequal sample counts per rank (weights 1..world): the exchange carries uneven splits
        w = np.arange(1, world + 1)
        counts = np.diff(np.round(np.concatenate([[0], np.cumsum(w)]) / w.sum() *
                                  args_d["samples"]).astype(np.int64))
        per_rank = int(counts[rank])
        rows = []
        for s in range(args_d["gloo_steps"] + 1):
            rng = np.random.default_rng([s, rank])
            L = rl_lengths(rng, per_rank)
            seqs = [torch.from_numpy(rng.integers(0, 32000, int(n))) for n in L]
            lp = [torch.randn(int(n)) for n in L]
            adv = torch.randn(per_rank)
            dist.barrier()
            t0 = time.perf_counter()
            r = balance_rollout(seqs, cost, args_d["capacity"], step=s,
                                extras={"old_log_probs": lp, "advantages": adv})
            t1 = time.perf_counter()
            outs = [{"log_probs": b["old_log_probs"] * 0.5} for b in r.microbatches]
            t2 = time.perf_counter()
            back = r.restore(outs)
            t3 = time.perf_counter()
            ok = all(torch.equal(back["log_probs"][i], lp[i] * 0.5) for i in range(per_rank))
            st = r.stats
            # the offer all-gather alone, every rank arriving together
            from balancer.runtime.gather import gather_offers
            dist.barrier()
            t4 = time.perf_counter()
            gather_offers(np.arange(per_rank), L, np.zeros(per_rank, np.int64),
                          {"step": s, "schema": None}, None)
            t_gather = time.perf_counter() - t4
            rows.append({"gather_bytes_sent": st["gather"]["bytes_sent"],
                         "gather_bytes_received": st["gather"]["bytes_received"],
                         "gather_s": t_gather, "gather_in_step_s": st["gather"]["seconds"],
                         "plan_s": st["plan_seconds"], "collate_s": st["collate_seconds"],
                         "a2a_bytes_sent": st["exchange"]["bytes_sent"],
                         "a2a_bytes_received": st["exchange"]["bytes_received"],
                         "a2a_s": st["exchange"]["seconds"], "step_s": t1 - t0,
                         "restore_s": t3 - t2, "restored_ok": ok,
                         "offered_here": per_rank,
                         "trained_here": sum(len(b["sample_ids"]) for b in r.microbatches),
                         "tokens_here": sum(int(b["cu_seqlens"][-1]) for b in r.microbatches),
                         "microbatches": len(r.microbatches)})
        with open(Path(out) / f"rank{rank}.json", "w") as f:
            json.dump(rows[1:], f)  # the first step loads the compiled kernels
    finally:
        dist.destroy_process_group()


def gloo_bench(args):
    import torch.multiprocessing as mp
    from balancer import Layout
    from balancer.runtime import Offers, StepPlanner
    StepPlanner(load_cost(args), Layout(dp=2, capacity=64), microbatches="auto").plan(
        Offers.from_ranks([(np.arange(3), np.array([5, 9, 30]))] * 2))  # kernels into the cache
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.start_processes(_gloo_rank, args=(args.gloo_ranks, init, tmp, vars(args)),
                           nprocs=args.gloo_ranks, join=True, start_method="spawn")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text())
                 for r in range(args.gloo_ranks)]
    med = lambda key, r: float(np.median([row[key] for row in ranks[r]]))  # noqa: E731
    w = args.gloo_ranks
    return {"ranks": w, "samples_per_step": args.samples, "steps": args.gloo_steps,
            "gather_bytes_sent_per_rank": max(med("gather_bytes_sent", r) for r in range(w)),
            "gather_bytes_received_per_rank": max(med("gather_bytes_received", r) for r in range(w)),
            "gather_ms": 1e3 * max(med("gather_s", r) for r in range(w)),
            "gather_in_step_ms": 1e3 * max(med("gather_in_step_s", r) for r in range(w)),
            "plan_ms": 1e3 * max(med("plan_s", r) for r in range(w)),
            "collate_ms": 1e3 * max(med("collate_s", r) for r in range(w)),
            "a2a_bytes_sent_per_rank_max": max(med("a2a_bytes_sent", r) for r in range(w)),
            "a2a_bytes_total": sum(med("a2a_bytes_sent", r) for r in range(w)),
            "a2a_ms": 1e3 * max(med("a2a_s", r) for r in range(w)),
            "balance_call_ms": 1e3 * max(med("step_s", r) for r in range(w)),
            "restore_ms": 1e3 * max(med("restore_s", r) for r in range(w)),
            "restored_ok": all(row["restored_ok"] for rs in ranks for row in rs),
            "offered_per_rank": [rs[0]["offered_here"] for rs in ranks],
            "samples_per_rank": [min(row["trained_here"] for rs in ranks for row in rs),
                                 max(row["trained_here"] for rs in ranks for row in rs)],
            "microbatches_per_rank": sorted({row["microbatches"] for rs in ranks for row in rs})}


def load_cost(args):
    from balancer import load_cost_model
    return load_cost_model(args.cost_model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4096, help="samples per step, all ranks")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--capacity", type=int, default=24576, help="tokens per microbatch "
                    "(verl: ppo_max_token_len_per_gpu)")
    ap.add_argument("--cost-model", default="llama-7b")
    ap.add_argument("--workload", default="wlbllm", help="a real workload, resampled per step")
    ap.add_argument("--workload-capacity", type=int, default=131072)
    ap.add_argument("--gloo-ranks", type=int, default=4)
    ap.add_argument("--gloo-steps", type=int, default=3)
    ap.add_argument("--local-search", action="store_true",
                    help="also run a moves + swaps local search on each of our plans (slowest "
                         "rank, capacity kept) and report how far it lowers the slowest rank")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from balancer import load_cost_model, workloads
    cost = load_cost_model(args.cost_model)
    res = {"config": vars(args)}
    res["rl"] = plan_bench(args, cost, lambda s: rl_lengths(np.random.default_rng(s),
                                                             args.samples), args.capacity)
    real = workloads.load(args.workload)
    res[args.workload] = plan_bench(
        args, cost, lambda s: np.random.default_rng(1000 + s).choice(real, args.samples),
        args.workload_capacity)
    if args.gloo_ranks > 1:
        res["gloo"] = gloo_bench(args)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
