"""Train the tiny transformer with DDP on gloo across CPU processes from the packed drop-in
loader, and log per-rank compute time per step.

    ./dev python tools/train.py --world 2 --steps 20 --strategy balanced --log out/train.json

The data is made locally: a parquet file of token ids (column ``input_ids``) whose lengths are a
shared workload scaled down (``--workload``, ``--samples``, ``--scale``), read back with Hugging
Face ``datasets``. Every rank builds the same plan in its own main process
(``PackedBatchSampler``); DataLoader workers only fetch and collate. The loss of a microbatch is
its summed token cross-entropy divided by the step's loss-token count over all ranks and
microbatches (from the plan), and gradients are summed over ranks, so a step's gradient is the
token mean over the whole global batch however the documents were packed.

Synchronisation (``--sync``): ``explicit`` (default) runs every microbatch under DDP's
``no_sync`` and then all-reduces the gradients in one timed call, so ``compute_s`` is pure
forward + backward and ``sync_s`` holds the all-reduce including the wait for the slowest rank;
``ddp`` lets DDP reduce during the last backward (the loss is scaled by the world size because
DDP averages), and that backward's time then includes the reduction.

The log (``--log``, JSON; the proof tool reads it, keep the keys): ``{"config": {...},
"strategy": str, "world": int, "steps": [{"step", "loss", "step_loss_tokens", "compute_s":
[per rank], "wait_s": [...], "sync_s": [...], "step_s": [...], "tokens": [...],
"microbatches": [...], "predicted_cost": [...], "eval_loss": float (with ``--eval-every``, on
evaluated steps)}], "summary": {...}}``. :func:`train_rank` is the
per-rank main loop and :func:`run` spawns the ranks; both are importable.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from balancer.planning.warmup import warmup
from tools.ranks import (load_dataset, spawn_ranks, sum_grads,  # noqa: F401 (train.load_dataset)
                         write_documents)
from tools.tiny_lm import (add_model_args, at_least, check_model_args, model_from_args,
                           positive_float, token_loss_sum)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("data")
    g.add_argument("--workload", default="wlbllm", help="shared or synthetic length workload")
    g.add_argument("--samples", type=at_least(1), default=4000, help="documents in the local dataset")
    g.add_argument("--scale", type=positive_float, default=0.05,
                   help="multiply the workload's lengths by this (CPU-sized documents)")
    g.add_argument("--data", default=None, help="folder for the parquet file (default: a temp dir)")
    g = p.add_argument_group("layout and plan")
    g.add_argument("--world", type=at_least(1), default=2, help="processes (= DP ranks), 1-4 on CPU")
    g.add_argument("--microbatches", type=at_least(1), default=2, help="microbatches per rank per step")
    g.add_argument("--capacity", type=at_least(1), default=2048, help="tokens per microbatch")
    g.add_argument("--strategy", default="balanced", help="planner strategy name")
    g.add_argument("--cost-model", default="quadratic-64k", help="cost model name or YAML")
    g.add_argument("--max-delay", type=at_least(0), default=4, help="most steps a sample may wait")
    g.add_argument("--seed", type=at_least(0), default=0, help="data, init and shuffle seed")
    g.add_argument("--window-samples", type=at_least(1), default=None,
                   help="plan the epoch in independent windows of this many samples (default: "
                        "one window; with --calibrate-online 200, about 5 steps)")
    g.add_argument("--shuffle-seed", type=at_least(0), default=None,
                   help="seed of the plan's shuffle only (default: --seed); another value "
                        "trains the same model on the same data in another order")
    g = p.add_argument_group("model and training")
    add_model_args(g)
    g.add_argument("--lr", type=positive_float, default=3e-3)
    g.add_argument("--steps", type=at_least(0), default=20, help="stop after this many steps (0: all)")
    g.add_argument("--epochs", type=at_least(1), default=1)
    g.add_argument("--num-workers", type=at_least(0), default=0,
                   help="DataLoader workers per rank (0 collates inline: on 2 shared cores a "
                        "worker process costs more in contention than it saves)")
    g.add_argument("--threads", type=at_least(1), default=1, help="torch threads per rank")
    g.add_argument("--sync", choices=("explicit", "ddp"), default="explicit")
    g.add_argument("--log", default=None, help="write the JSON log here")
    g.add_argument("--eval-every", type=at_least(0), default=0,
                   help="rank 0 evaluates the loss on a fixed held-out set every this many "
                        "steps and after the last (0: never); logged as eval_loss")
    g.add_argument("--eval-docs", type=at_least(1), default=64, help="documents in the held-out set")
    g.add_argument("--dump-grads", default=None,
                   help="save the reduced gradients of the first step here (tests)")
    g.add_argument("--timeout", type=at_least(1), default=300, help="collective timeout, seconds")
    g = p.add_argument_group("closed loop (balancer.loader.online)")
    g.add_argument("--calibrate-online", action="store_true",
                   help="time every microbatch's forward and backward, refit the cost model "
                        "every --refit-every steps on every rank's times and re-plan the "
                        "windows not yet handed out; the log gets an online_calibration block")
    g.add_argument("--refit-every", type=at_least(1), default=5, help="steps between refits")
    g.add_argument("--refit-skip", type=at_least(0), default=2,
                   help="first steps left out of the fits and the error figures (warm-up)")
    g.add_argument("--online-clock", choices=("wall", "cpu"), default="wall",
                   help="what the closed loop measures on CPU: wall-clock seconds, or the "
                        "rank's CPU seconds (blind to other processes on a shared machine)")
    g.add_argument("--online-measure-only", action="store_true",
                   help="with --calibrate-online: measure and log predicted vs measured, never "
                        "refit (a baseline that runs the same windows and clock)")
    g.add_argument("--measured", default=None,
                   help="JSON lines of per-step predicted vs measured times and the refits "
                        "(python -m balancer report --measured FILE draws them)")
    g.add_argument("--cp-mode", choices=("fixed", "hybrid"), default="fixed",
                   help="hybrid: per-document CP degree over gloo subgroups, run by "
                        "tools/train_cp.py (its flags: --cp, --rank-capacity, ...); fixed: this "
                        "DDP trainer")
    args = p.parse_args(argv)
    check_model_args(p, args)
    return args


# ---- data -----------------------------------------------------------------------------------

def make_dataset(folder, workload: str, samples: int, scale: float, vocab: int,
                 seed: int = 0) -> Path:
    """Write ``folder/tokens.parquet`` (``input_ids`` list<int32>, ``length`` int64) with the
    lengths of ``workload`` times ``scale``. Documents are learnable: each is an arithmetic
    progression modulo ``vocab`` with its own start and stride
    (:func:`tools.ranks.write_documents`)."""
    return write_documents(folder, dataset_lengths(workload, samples, scale, seed), vocab, seed)


def dataset_lengths(workload: str, samples: int, scale: float, seed: int = 0) -> np.ndarray:
    """int64[samples]: the document lengths :func:`make_dataset` writes."""
    from balancer import workloads
    lengths = np.maximum(1, np.round(workloads.load(workload, n=samples, seed=seed) * scale))
    return lengths.astype(np.int64)


def eval_batches(args) -> list[tuple]:
    """The held-out set: ``--eval-docs`` documents made like the training ones (another seed,
    cut to the capacity), packed in order into microbatches of at most ``--capacity`` tokens;
    each ``(input_ids, position_ids, cu_seqlens, max_seqlen, shift_labels)``."""
    from balancer import workloads
    seed = args.seed + 10_000
    lengths = workloads.load(args.workload, n=args.eval_docs, seed=seed) * args.scale
    lengths = np.clip(np.round(lengths), 2, args.capacity).astype(np.int64)
    rng = np.random.default_rng(seed)
    docs = [(int(rng.integers(0, args.vocab)) + int(rng.integers(1, 8)) * np.arange(n)) % args.vocab
            for n in lengths]
    packs, cur = [], []
    for d in docs:
        if cur and sum(map(len, cur)) + len(d) > args.capacity:
            packs.append(cur)
            cur = []
        cur.append(d)
    packs.append(cur)
    out = []
    for p in packs:
        lens = [len(d) for d in p]
        out.append((torch.from_numpy(np.concatenate(p)).long(),
                    torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).long(),
                    torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32),
                    max(lens),
                    torch.from_numpy(np.concatenate([np.append(d[1:], -100) for d in p])).long()))
    return out


@torch.no_grad()
def eval_loss(model, batches) -> float:
    """Token-mean next-token loss of ``model`` on the held-out batches."""
    model.eval()
    total, n = 0.0, 0
    for ids, pos, cu, mx, lab in batches:
        total += float(token_loss_sum(model(ids, pos, cu, mx), lab))
        n += int((lab != -100).sum())
    model.train()
    return total / n


# ---- the per-rank loop ----------------------------------------------------------------------

def plan_setup(args, world: int):
    """The ``(Layout, PlannerConfig)`` every rank plans with (the proof tool re-plans with
    them)."""
    from balancer import Layout, PlannerConfig
    layout = Layout(dp=world, microbatches=args.microbatches, capacity=args.capacity)
    seed = args.seed if args.shuffle_seed is None else args.shuffle_seed
    window = args.window_samples
    if window is None and args.calibrate_online:
        window = 200  # a window of about 5 steps: a refit re-plans from the next window on
    config = PlannerConfig(strategy=args.strategy, seed=seed, max_delay=args.max_delay,
                           over_length="chunk", window_samples=window)
    return layout, config


def build_loader(args, ds, rank: int, world: int):
    from balancer import SampleTable, load_cost_model
    from balancer.loader.collate import PackedCollator, PackedDataset
    from balancer.loader.sampler import PackedBatchSampler
    cost = load_cost_model(args.cost_model)
    layout, config = plan_setup(args, world)
    samples = SampleTable.from_dataset(ds, "length")
    sampler = PackedBatchSampler(samples, cost, layout, config)
    loader = torch.utils.data.DataLoader(
        PackedDataset(ds), batch_sampler=sampler, collate_fn=PackedCollator(),
        num_workers=args.num_workers, persistent_workers=args.num_workers > 0,
        prefetch_factor=4 if args.num_workers else None)
    return sampler, loader


def train_rank(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    """The training loop of one rank (process group already initialised). Returns this rank's
    per-step records."""
    torch.set_num_threads(args.threads)
    ds = load_dataset(Path(args.data_path))
    sampler, loader = build_loader(args, ds, rank, world)
    torch.manual_seed(args.seed)
    model = model_from_args(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    params = [p for p in model.parameters() if p.requires_grad]
    scale = world if args.sync == "ddp" else 1  # DDP averages; we want the sum over ranks
    records, done = [], 0
    held_out = eval_batches(args) if args.eval_every and rank == 0 else None
    online = timer = None
    if args.calibrate_online:
        from balancer.loader.online import OnlineCalibrator, OnlineConfig
        from balancer.loader.timing import MicrobatchTimer
        timer = MicrobatchTimer("cpu", clock=args.online_clock)
        online = OnlineCalibrator(sampler, timer, OnlineConfig(
            every=args.refit_every, skip_steps=args.refit_skip,
            refit=not args.online_measure_only),
                                  jsonl=args.measured)
    elif args.measured:
        raise ValueError("--measured needs --calibrate-online")
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        plan = sampler.plan
        it = iter(loader)
        while True:
            rec = {"step": None, "compute_s": 0.0, "wait_s": 0.0, "sync_s": 0.0,
                   "loss_sum": 0.0, "tokens": 0, "microbatches": 0, "predicted_cost": 0.0}
            t_step = time.perf_counter()
            last = False
            while not last:
                t0 = time.perf_counter()
                try:
                    b = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                last = bool(b["last_in_step"])
                ctx = ddp.no_sync() if (args.sync == "explicit" or not last) else _null()
                if timer is not None:
                    timer.begin(b, step=done)
                with ctx:
                    logits = ddp(b["input_ids"], b["position_ids"], b["cu_seqlens"],
                                 b["max_seqlen"])
                    loss_sum = token_loss_sum(logits, b["shift_labels"])
                    if timer is not None:
                        timer.split()
                    (loss_sum * (scale / b["step_loss_tokens"])).backward()
                if timer is not None:
                    timer.end()
                t2 = time.perf_counter()
                rec["wait_s"] += t1 - t0
                rec["compute_s"] += t2 - t1
                rec["loss_sum"] += float(loss_sum.detach())
                rec["tokens"] += int(b["input_ids"].shape[0])
                rec["microbatches"] += 1
                # the plan as it stands (a refit re-plans the windows not yet handed out)
                plan = sampler.plan
                rec["predicted_cost"] += float(plan.mb_fwd[b["mb"]] + plan.mb_bwd[b["mb"]])
                rec["step"], rec["step_loss_tokens"] = done, int(b["step_loss_tokens"])
            if rec["microbatches"] == 0:
                break
            if not last:
                raise RuntimeError(f"rank {rank}: epoch ended inside step {done}")
            t3 = time.perf_counter()
            if args.sync == "explicit":
                sum_grads(params)
            rec["sync_s"] = time.perf_counter() - t3
            if args.dump_grads and done == 0 and rank == 0:
                torch.save({n: p.grad.clone() for n, p in model.named_parameters()},
                           args.dump_grads)
            opt.step()
            opt.zero_grad(set_to_none=False)
            rec["step_s"] = time.perf_counter() - t_step
            rec["epoch"] = epoch
            records.append(rec)
            done += 1
            if online is not None:
                online.step_done()  # every --refit-every steps: exchange, refit, re-plan
            if held_out is not None and done % args.eval_every == 0:
                # after the step's timing: the other ranks' compute is not held up by it
                rec["eval_loss"] = eval_loss(model, held_out)
            if args.steps and done >= args.steps:
                break
        if args.steps and done >= args.steps:
            break
    if held_out is not None and records and "eval_loss" not in records[-1]:
        records[-1]["eval_loss"] = eval_loss(model, held_out)
    if online is not None and records:
        if done % args.refit_every:
            online.exchange()  # the last steps' times (a collective: every rank is here)
        records[-1]["online_calibration"] = {**online.summary(),
                                             "observations": online.observations()}
    return records


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def merge_log(args: argparse.Namespace, per_rank: list[list[dict]]) -> dict:
    """Per-rank records -> the JSON log (one entry per step, per-rank lists)."""
    n = min(len(r) for r in per_rank)
    steps, online = [], None
    for s in range(n):
        rs = [r[s] for r in per_rank]
        entry = {"step": s, "epoch": rs[0]["epoch"], "step_loss_tokens": rs[0]["step_loss_tokens"],
                 "loss": sum(r["loss_sum"] for r in rs) / rs[0]["step_loss_tokens"]}
        if "eval_loss" in rs[0]:
            entry["eval_loss"] = rs[0]["eval_loss"]
        if "online_calibration" in rs[0]:
            online = dict(rs[0]["online_calibration"])
            # every rank fitted the same coefficients and plans (checked at every refit)
            online["ranks_agree"] = all(r["online_calibration"]["ranks_agree"] for r in rs)
        for k in ("compute_s", "wait_s", "sync_s", "step_s", "tokens", "microbatches",
                  "predicted_cost"):
            entry[k] = [r[k] for r in rs]
        steps.append(entry)
    wait = sum(sum(e["wait_s"]) for e in steps)
    wall = sum(sum(e["step_s"]) for e in steps)
    comp = np.array([e["compute_s"] for e in steps]) if steps else np.zeros((0, 1))
    cfg = {k: v for k, v in vars(args).items() if k not in ("data_path",)}
    out = {"config": cfg, "strategy": args.strategy, "world": args.world, "steps": steps,
            "summary": {"steps": n, "wait_fraction": wait / wall if wall else 0.0,
                        # the first step waits for workers to start; steady state excludes it
                        "wait_fraction_steady": _fraction(steps[1:]),
                        "compute_imbalance_mean": float(np.mean(comp.max(1) / comp.mean(1)))
                        if n else float("nan"),
                        # the steady state a balancer reaches (the closed loop's proof compares it)
                        "compute_imbalance_last10": float(np.mean(
                            comp[-10:].max(1) / comp[-10:].mean(1))) if n else float("nan"),
                        "first_loss": steps[0]["loss"] if steps else None,
                        "last_loss": steps[-1]["loss"] if steps else None}}
    if online is not None:
        online["compute_imbalance_last10"] = out["summary"]["compute_imbalance_last10"]
        out["online_calibration"] = online
    return out


def _fraction(steps) -> float:
    wall = sum(sum(e["step_s"]) for e in steps)
    return sum(sum(e["wait_s"]) for e in steps) / wall if wall else 0.0


def run(args: argparse.Namespace) -> dict:
    """Make the data, spawn ``args.world`` ranks, return (and write to ``args.log``) the log."""
    if not 1 <= args.world <= 8:
        raise ValueError(f"--world {args.world} is outside 1..8")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.data) if args.data else Path(tmp) / "data"
        args.data_path = str(make_dataset(folder, args.workload, args.samples, args.scale,
                                          args.vocab, args.seed))
        warmup(["fixed"])  # once here: the spawned ranks load the kernels from the cache
        per_rank = spawn_ranks(train_rank, args, tmp)
    log = merge_log(args, per_rank)
    if args.log:
        Path(args.log).parent.mkdir(parents=True, exist_ok=True)
        with open(args.log, "w") as f:
            json.dump(log, f, indent=1)
    return log


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--cp-mode", choices=("fixed", "hybrid"), default="fixed")
    if pre.parse_known_args(argv)[0].cp_mode == "hybrid":
        from tools.train_cp import main as train_cp_main
        return train_cp_main(argv)
    args = parse_args(argv)
    log = run(args)
    s = log["summary"]
    for e in log["steps"]:
        print(f"step {e['step']:3d} loss {e['loss']:.4f} compute "
              + " ".join(f"{c:.3f}" for c in e["compute_s"]) + " s  wait "
              + " ".join(f"{w * 1e3:.1f}" for w in e["wait_s"]) + " ms")
    print(f"{s['steps']} steps, loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
          f"data wait {100 * s['wait_fraction']:.2f}% of step time "
          f"({100 * s['wait_fraction_steady']:.2f}% after the first step), "
          f"compute imbalance (max/mean) {s['compute_imbalance_mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
