"""Calibrate the CP cost model's K/V exchange: time all-gathers of K/V-sized tensors on real ranks,
fit ``time = latency x (g - 1) + bytes received / bandwidth`` (a rank of a ``g``-rank group
receives ``(g - 1) / g`` of the gathered bytes: the form :class:`balancer.cost.cp.CPCostModel`
charges per layer), and write the :class:`~balancer.cost.cp.CPHardware` figures as YAML, which
``python -m balancer report|precompute`` and ``tools/bench.py`` take with ``--cp-hardware FILE``.

    ./dev python tools/calibrate_cp.py --world 2 --out out/gloo-cpu.yaml       # gloo, CPU ranks
    torchrun --nproc-per-node 8 tools/calibrate_cp.py --backend nccl --scope intra --out hw.yaml
    torchrun --nnodes 2 --nproc-per-node 8 ... tools/calibrate_cp.py --backend nccl \\
        --scope inter --merge hw.yaml --out hw.yaml                       # then across nodes

Under ``torchrun`` (``RANK`` set) the launched processes are measured (``--backend``: gloo on
CPU tensors, nccl on this rank's GPU); otherwise ``--world`` CPU processes are spawned in one
gloo group. Each size (``--sizes``, bytes one rank contributes) is gathered ``--warmup`` times,
then timed ``--repeats`` times between barriers; the slowest rank's time of each repeat counts
(the exchange ends when the last member has its K/V) and the median over repeats is fitted.
``--scope intra`` writes ``intra_node_bandwidth`` / ``intra_node_latency``, ``inter`` the
``inter_node_`` pair; ``--merge FILE`` starts from an earlier file (the other scope's figures,
``overlap``, ...). The fit's relative error per size is printed (and in ``--json``).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

DEFAULT_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 8 << 20)


def fit_exchange(bytes_per_rank, seconds, group: int) -> dict:
    """Relative least-squares ``seconds = latency (g - 1) + (g - 1) bytes_per_rank / bandwidth`` over the
    sizes: ``{"latency": s per step, "bandwidth": bytes/s received, "rel_error": [...]}``. A fit
    with no positive slope (the sizes do not show the bandwidth) is an error."""
    g = int(group)
    if g < 2:
        raise ValueError("the exchange needs a group of at least 2 ranks")
    b = np.asarray(bytes_per_rank, np.float64)
    t = np.asarray(seconds, np.float64)
    if b.shape != t.shape or b.size < 2 or np.unique(b).size < 2:
        raise ValueError("need timings of at least two different sizes")
    if (t <= 0).any():
        raise ValueError("timings must be positive")
    recv = (g - 1) * b
    A = np.stack([np.full_like(recv, g - 1.0), recv], axis=1)
    # relative least squares (each row over its time): the small sizes, where the latency
    # shows, weigh as much as the large ones, where the bandwidth does
    (lat, inv_bw), *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)
    if inv_bw <= 0:
        raise ValueError(f"the timings show no cost per byte (slope {inv_bw:.3g} s/B): use "
                         f"larger --sizes")
    lat = max(0.0, float(lat))
    pred = lat * (g - 1) + recv * inv_bw
    return {"latency": lat, "bandwidth": float(1.0 / inv_bw),
            "rel_error": ((pred - t) / t).tolist()}


def measure_rank(rank: int, world: int, args) -> list[dict]:
    """Median over repeats of the slowest rank's all-gather time, per size (every rank)."""
    dev = torch.device("cuda", torch.cuda.current_device()) if args.backend == "nccl" \
        else torch.device("cpu")
    out = []
    for size in args.sizes:
        x = torch.ones(max(1, size // 4), dtype=torch.float32, device=dev)
        parts = [torch.empty_like(x) for _ in range(world)]
        times = []
        for i in range(args.warmup + args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather(parts, x)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=dev)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if i >= args.warmup:
                times.append(float(dt.item()))
        out.append({"bytes_per_rank": int(x.numel() * 4), "seconds": statistics.median(times),
                    "seconds_min": min(times), "seconds_max": max(times)})
    return out


def hardware_yaml(fit: dict, scope: str, merge=None, gpus_per_node=None) -> dict:
    """The CPHardware mapping: ``merge``'s figures (if any) with this scope's pair replaced;
    validated by CPHardware before it is returned."""
    from balancer.config import load_yaml
    from balancer.cost.cp import CPHardware
    doc = load_yaml(merge, "CP hardware file") if merge else {}
    doc[f"{scope}_node_bandwidth"] = float(fit["bandwidth"])
    doc[f"{scope}_node_latency"] = float(fit["latency"])
    if gpus_per_node is not None:
        doc["gpus_per_node"] = int(gpus_per_node)
    CPHardware(**doc)
    return doc


def _spawned_rank(rank, world, args, init, out):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    try:
        res = measure_rank(rank, world, args)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
        dist.barrier()
    finally:
        gc.collect()  # finished work released before the group goes (gloo's teardown race)
        dist.destroy_process_group()


def measure(args) -> tuple[list[dict], int]:
    """The timings and the group size: of the launched processes, or of ``--world`` spawned
    gloo CPU ranks."""
    if "RANK" in os.environ:
        if args.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(args.backend,
                                timeout=datetime.timedelta(seconds=args.timeout))
        try:
            return measure_rank(dist.get_rank(), dist.get_world_size(), args), \
                dist.get_world_size()
        finally:
            dist.destroy_process_group()
    if args.backend != "gloo":
        raise SystemExit("--backend nccl needs torchrun (one process per GPU)")
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "timings.json")
        mp.start_processes(_spawned_rank, args=(args.world, args, f"file://{tmp}/rdzv", out),
                           nprocs=args.world, join=True, start_method="spawn")
        return json.loads(Path(out).read_text()), args.world


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="spawned gloo ranks (without torchrun)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--scope", choices=("intra", "inter"), default="intra",
                   help="which pair of CPHardware figures the fit sets")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   default=list(DEFAULT_SIZES), help="bytes per rank, comma-separated")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="also write gpus_per_node (a power of two)")
    p.add_argument("--merge", default=None, help="start from this CP hardware YAML")
    p.add_argument("--out", default=None, help="write the CP hardware YAML here")
    p.add_argument("--json", default=None, help="write the timings and the fit here")
    p.add_argument("--timeout", type=int, default=300)
    args = p.parse_args(argv)
    if not 2 <= args.world <= 64:
        p.error(f"--world {args.world}: must be 2..64")
    if len(set(args.sizes)) < 2 or min(args.sizes) < 4:
        p.error("--sizes: give at least two different sizes of at least 4 bytes")
    return args


def main(argv=None) -> dict:
    import yaml
    args = parse_args(argv)
    timings, g = measure(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return {}
    fit = fit_exchange([r["bytes_per_rank"] for r in timings], [r["seconds"] for r in timings],
                       g)
    hw = hardware_yaml(fit, args.scope, args.merge, args.gpus_per_node)
    for r, e in zip(timings, fit["rel_error"]):
        print(f"{r['bytes_per_rank']:>12,} B per rank: {1e3 * r['seconds']:9.3f} ms "
              f"(min {1e3 * r['seconds_min']:.3f}, max {1e3 * r['seconds_max']:.3f}); "
              f"fit {100 * e:+.1f}%")
    print(f"{g} ranks, {args.backend}: latency {1e6 * fit['latency']:.1f} us per step, "
          f"bandwidth {fit['bandwidth'] / 1e9:.3f} GB/s received per rank -> "
          f"{args.scope}_node_latency, {args.scope}_node_bandwidth")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(yaml.safe_dump(hw, sort_keys=True))
        print(f"wrote {args.out}")
    res = {"ranks": g, "backend": args.backend, "scope": args.scope, "timings": timings,
           "fit": fit, "hardware": hw}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
