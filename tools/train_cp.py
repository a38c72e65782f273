"""Hybrid DP x CP demo trainer: TinyLM on gloo CPU ranks, every document
trained whole on one rank or zigzag-sharded over an aligned CP group with a context-parallel
attention (a differentiable all-gather of K/V inside the group's gloo subgroup).

    ./dev python tools/train.py --cp-mode hybrid --world 4 --cp 2 --rank-capacity 512 --steps 6
    ./dev python tools/train_cp.py --cp-mode fixed ...     # fixed CP of degree --cp, same loader

The pool is ``--world`` ranks (``dp = world / cp``). ``--cp-mode hybrid`` plans with ``--strategy``
(default the library's, ``hybrid_stream``: :func:`balancer.planning.hybrid.plan_hybrid_stream`); ``--cp-mode fixed`` with the fixed-CP baseline
``fixed_cp<cp>`` (documents longer than ``cp x rank_capacity`` cut), both through
:class:`balancer.loader.hybrid.HybridBatchSampler`. Every rank creates every aligned group up
front (:func:`balancer.loader.hybrid.aligned_groups`, the same ``new_group`` calls everywhere)
and picks, per round, the one its batch names. The loss of a round is the summed token
cross-entropy over the step's loss tokens (from the plan), gradients are summed over the pool
once per step, so a step's gradient is the token mean over the global batch.

The log (``--log``) holds per step and rank the measured compute and step time, and the
step's estimate under the CP cost model (:func:`balancer.planning.hybrid.estimate`, one exchange per
group microbatch as this trainer runs it; the per-document figure too) built from the
calibrated CPU preset ``--cost-model`` (``tiny-lm-cpu``) and the gloo figures ``--gloo-bandwidth``
/ ``--gloo-latency``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from balancer.planning.hybrid import HYBRID_DEFAULT_STRATEGY
from tools.ranks import write_documents
from tools.tiny_lm import add_model_args, token_loss_sum


# ---- context-parallel attention -------------------------------------------------------------
class GroupAllGather(torch.autograd.Function):
    """``[size, *x.shape]``: ``x`` of every member of ``group`` (this one at ``me``). Backward:
    the gradient of every member's copy summed over the group (all-reduce; gloo has no
    reduce-scatter), this member's slice returned."""

    @staticmethod
    def forward(ctx, x, group, size: int, me: int):
        ctx.group, ctx.me = group, me
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.me], None, None, None


def shard_layout(shard: dict, size: int, me: int) -> dict:
    """What the CP attention needs of a group microbatch, once per batch: the permutation
    putting the gathered shards in padded order, and per document its two zigzag chunks in
    this shard (rows, first position, real query count)."""
    from balancer.loader.cp_shard import shard_index
    cu = shard["cu_seqlens"].numpy().astype(np.int64)
    cu_pad = shard["cu_seqlens_padded"].numpy().astype(np.int64)
    lens = np.diff(cu)
    kpos = np.concatenate([shard_index(lens, size, r) for r in range(size)])
    chunks = []   # (doc start in padded order, real length, row offset, chunk start, queries)
    row = 0
    for d, L in enumerate(lens.tolist()):
        c = int(cu_pad[d + 1] - cu_pad[d]) // (2 * size)
        for j in (me, 2 * size - 1 - me):  # shard order: chunk me, then chunk 2 size - 1 - me
            s = j * c
            if s < L:
                chunks.append((int(cu_pad[d]), L, row, s, min(c, L - s)))
            row += c
    return {"perm": torch.from_numpy(np.argsort(kpos, kind="stable")), "chunks": chunks}


def shard_attention(q, k, v, lay: dict, group, size: int, me: int):
    """Causal attention of this member's zigzag shard (q, k, v [Tr, H, D]) against the K/V of
    the whole group. Each chunk of queries at positions ``s .. s + n`` attends the document's
    keys ``0 .. s + n`` with the causal mask of that tile (as ``tools.tiny_lm``'s tiled
    attention: the work is the chunk's causal pairs, what the CP cost model counts); padding
    queries give 0."""
    import torch.nn.functional as F
    kv = GroupAllGather.apply(torch.stack([k, v]), group, size, me)  # [size, 2, Tr, H, D]
    kv = kv.transpose(0, 1).reshape(2, -1, *k.shape[1:])[:, lay["perm"]]
    out = torch.zeros_like(q)
    for lo, L, row, s, n in lay["chunks"]:
        e = s + n
        mask = torch.ones(n, e, dtype=torch.bool).tril(diagonal=s)
        o = F.scaled_dot_product_attention(
            q[row:row + n].transpose(0, 1), kv[0, lo:lo + e].transpose(0, 1),
            kv[1, lo:lo + e].transpose(0, 1), attn_mask=mask)
        out = out.index_put((torch.arange(row, row + n),), o.transpose(0, 1))
    return out


def shard_forward(model, shard: dict, group, size: int, me: int) -> torch.Tensor:
    """TinyLM logits [Tr, vocab] of this member's shard of the group's documents."""
    lay = shard_layout(shard, size, me)
    pos = shard["position_ids"]
    x = model.embed(shard["input_ids"])
    for b in model.blocks:
        q, k, v = b.qkv_heads(x, pos)
        a = shard_attention(q, k, v, lay, group, size, me)
        x = x + b.proj(a.reshape(x.shape))
        x = x + b.mlp(b.norm2(x))
    return model.head(model.norm(x))


def make_groups(world: int) -> dict:
    """Every aligned group of the pool as a gloo subgroup, created in the same order on every
    rank (``new_group`` is collective over the world)."""
    from balancer.loader.hybrid import aligned_groups
    return {ranks: dist.new_group(list(ranks)) for ranks in aligned_groups(world)}


def loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy (:func:`tools.tiny_lm.token_loss_sum`), kept in float64
    for a float64 model (the equality test compares in float64)."""
    if logits.dtype == torch.float64:
        return torch.nn.functional.cross_entropy(logits, shift_labels, ignore_index=-100,
                                                 reduction="sum")
    return token_loss_sum(logits, shift_labels)


def round_forward(model, batch: dict, groups: dict):
    """``(loss_sum, whole logits or None, shard logits or None)`` of one rank's round."""
    loss = torch.zeros((), dtype=torch.float64)
    lw = ls = None
    w, s = batch["whole"], batch["shard"]
    if w is not None:
        lw = model(w["input_ids"], w["position_ids"], w["cu_seqlens"], w["max_seqlen"])
        loss = loss + loss_sum(lw, w["shift_labels"]).double()
    if s is not None:
        size = batch["group_size"]
        ls = shard_forward(model, s, groups[tuple(batch["group_ranks"])], size,
                           batch["group_rank"])
        loss = loss + loss_sum(ls, s["shift_labels"]).double()
    return loss, lw, ls


# ---- the cost model of this demo ------------------------------------------------------------
def demo_cost_model(args):
    """The CP cost model of the demo: the calibrated CPU preset for compute, TinyLM's shape for
    the K/V bytes, gloo's figures for the exchange (one 'node': every group is intra-node)."""
    from balancer.cost.model import ModelSpec, load_cost_model
    from balancer.cost.cp import CPCostModel, CPHardware
    spec = ModelSpec(hidden=args.dim, layers=args.layers, heads=args.heads, ffn=4 * args.dim,
                     vocab=args.vocab)
    bw, lat = args.gloo_bandwidth, args.gloo_latency
    if getattr(args, "cp_hardware", None):  # measured by tools/calibrate_cp.py
        cal = CPHardware.from_yaml(args.cp_hardware)
        bw, lat = cal.intra_node_bandwidth, cal.intra_node_latency
    hw = CPHardware(gpus_per_node=1 << (args.world - 1).bit_length(),
                    intra_node_bandwidth=bw, inter_node_bandwidth=bw,
                    intra_node_latency=lat, inter_node_latency=lat,
                    overlap=0.0, kv_bytes=4 if args.dtype == "float32" else 8,
                    backward_exchange=2.0)  # backward all-reduces the gathered [g, ...] grads
    return CPCostModel(cost=load_cost_model(args.cost_model), spec=spec, hardware=hw,
                       rank_capacity=args.rank_capacity)


def build_sampler(args, lengths, rank):
    from balancer.config import Layout, PlannerConfig
    from balancer.loader.hybrid import HybridBatchSampler
    from balancer.samples import SampleTable
    dp = args.world // args.cp
    layout = Layout(dp=dp, cp=args.cp, microbatches=args.microbatches,
                    capacity=args.cp * args.rank_capacity, cp_mode="hybrid",
                    rank_capacity=args.rank_capacity)
    strategy = args.strategy if args.cp_mode == "hybrid" else f"fixed_cp{args.cp}"
    # the same PlannerConfig as a fixed-CP job's; fields left unset take the hybrid defaults
    return HybridBatchSampler(SampleTable(lengths), demo_cost_model(args), layout,
                              PlannerConfig(strategy=strategy, seed=args.seed), rank=rank)


# ---- the per-rank loop ----------------------------------------------------------------------
def train_rank(rank: int, world: int, args) -> list[dict]:
    from balancer.loader.collate import PackedDataset
    from balancer.loader.hybrid import HybridCollator
    from tools.ranks import load_dataset, sum_grads
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(args.threads)
    dtype = torch.float64 if args.dtype == "float64" else torch.float32
    ds = load_dataset(Path(args.data_path))
    lengths = np.asarray(ds["length"], np.int64)
    sampler = build_sampler(args, lengths, rank)
    loader = torch.utils.data.DataLoader(PackedDataset(ds), batch_sampler=sampler,
                                         collate_fn=HybridCollator(), num_workers=0)
    torch.manual_seed(args.seed)
    from tools.tiny_lm import model_from_args
    model = model_from_args(args).to(dtype)
    for p in model.parameters():   # the same initial weights everywhere (seeded), checked
        dist.broadcast(p.data, 0)
    groups = make_groups(world)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = list(model.parameters())
    records, rec = [], None
    dist.barrier()
    t_step = time.perf_counter()
    for b in loader:
        if rec is None:
            rec = {"step": b["step"], "compute_s": 0.0, "loss_sum": 0.0, "rounds": 0,
                   "step_loss_tokens": b["step_loss_tokens"]}
        t1 = time.perf_counter()
        loss, _, _ = round_forward(model, b, groups)
        (loss / b["step_loss_tokens"]).backward()
        rec["compute_s"] += time.perf_counter() - t1
        rec["loss_sum"] += float(loss.detach())
        rec["rounds"] += 1
        if not b["last_in_step"]:
            continue
        t3 = time.perf_counter()
        sum_grads(params)
        rec["sync_s"] = time.perf_counter() - t3
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["step_s"] = time.perf_counter() - t_step
        records.append(rec)
        rec = None
        t_step = time.perf_counter()
        if args.steps and len(records) >= args.steps:
            break
    return records


def estimate_steps(args, lengths) -> dict:
    """The CP cost model's estimate of every step of the plan the ranks train."""
    from balancer.planning.hybrid import estimate
    s = build_sampler(args, lengths, 0)
    # the demo runs one all-gather per layer per group round for all the group's sharded
    # documents: one exchange per group microbatch; the per-document figure is logged too
    e = estimate(s.plan, s.model, lengths, exchange="group")
    d = estimate(s.plan, s.model, lengths)
    return {"step_times": e.step_times.tolist(), "exposed_comm_fraction":
            e.exposed_comm_fraction, "documents_cut": e.documents_cut,
            "step_times_per_document_exchange": d.step_times.tolist(),
            "rounds_per_step": np.diff(s.plan.step_rounds).tolist()}


def long_tail_lengths(n: int, rank_capacity: int, world: int, seed: int = 0,
                      long_fraction: float = 0.04) -> np.ndarray:
    """Short SFT-like documents (lognormal, median rank_capacity / 8, clipped to 2 ..
    rank_capacity) plus ``long_fraction`` of documents longer than one rank holds, uniform up
    to what the pool holds (seeded): the demo's long-tail mixture."""
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(rank_capacity / 8), 0.8, n), 2, rank_capacity)
    limit = world * (rank_capacity - rank_capacity % 2)
    long = rng.integers(rank_capacity + 1, limit + 1, n)
    return np.where(rng.random(n) < long_fraction, long, short).astype(np.int64)


def run(args) -> dict:
    """Make the data, spawn the ranks, return (and write to ``--log``) the log."""
    if args.world % args.cp or args.cp & (args.cp - 1):
        raise ValueError(f"--cp {args.cp} must be a power of two dividing --world {args.world}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.data) if args.data else Path(tmp) / "data"
        if args.workload == "longtail":
            lengths = long_tail_lengths(args.samples, args.rank_capacity, args.world, args.seed)
        else:
            from balancer import workloads
            lengths = np.maximum(1, np.round(workloads.load(
                args.workload, n=args.samples, seed=args.seed) * args.scale)).astype(np.int64)
        args.data_path = str(write_documents(folder, lengths, args.vocab, args.seed))
        import pyarrow.parquet as pq
        lengths = pq.read_table(args.data_path, columns=["length"])["length"].to_numpy()
        est = estimate_steps(args, lengths)   # also compiles the kernels before the ranks
        from tools.ranks import spawn_ranks
        per_rank = spawn_ranks(train_rank, args, tmp)
    n = min(len(r) for r in per_rank)
    steps = []
    for s in range(n):
        rs = [r[s] for r in per_rank]
        steps.append({"step": s, "loss": sum(r["loss_sum"] for r in rs) / rs[0][
            "step_loss_tokens"], "compute_s": [r["compute_s"] for r in rs],
            "step_s": [r["step_s"] for r in rs], "sync_s": [r["sync_s"] for r in rs],
            "rounds": rs[0]["rounds"], "est_step_s": est["step_times"][s],
            "est_step_s_per_document_exchange": est["step_times_per_document_exchange"][s]})
    cfg = {k: v for k, v in vars(args).items() if k != "data_path"}
    log = {"config": cfg, "cp_mode": args.cp_mode, "steps": steps, "estimate": est}
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        Path(args.log).write_text(json.dumps(log, indent=1))
    return log


def add_cp_train_args(p) -> None:
    g = p.add_argument_group("hybrid DP x CP (tools/train_cp.py)")
    g.add_argument("--cp-mode", choices=("fixed", "hybrid"), default="fixed",
                   help="hybrid: per-document CP degree (tools/train_cp.py); fixed: the plain "
                        "DDP trainer of tools/train.py (tools/train_cp.py --cp-mode fixed: fixed "
                        "CP of degree --cp through the hybrid loader)")
    g.add_argument("--cp", type=int, default=2, help="CP ranks per DP replica (pool = world)")
    g.add_argument("--strategy", default=HYBRID_DEFAULT_STRATEGY,
                   choices=("hybrid", "hybrid_stream", "megatron_hybrid"),
                   help="the hybrid planner of --cp-mode hybrid (default: the library's, "
                        f"{HYBRID_DEFAULT_STRATEGY})")
    g.add_argument("--rank-capacity", type=int, default=512,
                   help="tokens one rank holds per microbatch round")
    g.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    g.add_argument("--gloo-bandwidth", type=float, default=5e8,
                   help="bytes/s a rank receives in a gloo all-gather (CP cost model of the "
                        "estimate; 2 ranks on the shared 2-core dev machine: 4 KiB 0.96 ms, "
                        "1 MiB 3.9 ms, 4 MiB 9.8 ms per all_gather, about 1 ms + bytes / 0.5 GB/s)")
    g.add_argument("--gloo-latency", type=float, default=1e-3,
                   help="seconds per all-gather step per layer (CP cost model of the estimate)")
    g.add_argument("--cp-hardware", default=None, metavar="FILE",
                   help="gloo figures measured by tools/calibrate_cp.py --world N: its "
                        "intra-node bandwidth and latency replace the two flags above")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("data")
    g.add_argument("--workload", default="longtail",
                   help="longtail (short documents plus 4%% longer than a rank holds, made "
                        "here) or a length workload name / .npy scaled by --scale")
    g.add_argument("--samples", type=int, default=600)
    g.add_argument("--scale", type=float, default=1.0)
    g.add_argument("--data", default=None)
    g = p.add_argument_group("layout and training")
    g.add_argument("--world", type=int, default=4)
    g.add_argument("--microbatches", type=int, default=2, help="rounds per step (budget)")
    g.add_argument("--cost-model", default="tiny-lm-cpu")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--steps", type=int, default=6)
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--timeout", type=int, default=300)
    g.add_argument("--log", default=None)
    add_model_args(g)
    add_cp_train_args(p)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    log = run(args)
    for e in log["steps"]:
        print(f"step {e['step']:3d} loss {e['loss']:.4f} rounds {e['rounds']} measured "
              f"{max(e['step_s']):.3f} s (compute max {max(e['compute_s']):.3f}) estimated "
              f"{e['est_step_s']:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
