"""RL rollout balancing on CPU: 2 gloo processes (torch.multiprocessing spawn), each with its
own rollout batch in verl's padded layout (left-padded prompt + right-padded response, an
attention mask, per-token old log-probs, per-response-token advantages, a reward per sample).

Every step, each rank calls ``balance_rollout`` once: the ranks all-gather their lengths, plan
the same step, swap samples with one all-to-all and get packed microbatches of at most
``--capacity`` tokens, balanced by forward + backward cost. A stand-in "model" computes new
per-token log-probs on the packed microbatches; ``restore`` brings them back to the rank and
the padded position each sample came from, where they are checked against the same function
applied to the original batch. The last line is ``RESULT {json}`` (every sample once, restored in
order, the largest microbatch, the per-step imbalance).

  ./dev python examples/rl_rollout_balance.py [--world 2] [--steps 2] [--capacity 4096]
  ./dev python examples/rl_rollout_balance.py --resume --steps 3   # checkpoint, fresh ranks

With ``--resume``: the run-time balancer's state between rollout steps is its step counter (each
step is balanced whole, nothing is carried), so that is what a checkpoint holds. The run saves
``{"step": k}`` after step ``k = steps // 2`` and goes on to the end; a fresh set of processes
(a new process group) then resumes from the checkpoint, calling ``balance_rollout(...,
step=k)`` on: every resumed step's plan (its fingerprint), every rank's packed microbatches and
its restored log-probs equal the uninterrupted run's. Ranks resumed from different checkpoints
are refused on every rank before anything moves (shown first in the resumed run).

Tested with torch 2.13.0+cpu, numba 0.68.1, numpy 2.4.6 (Python 3.11, 2 CPU cores): about 10 s,
most of it process start-up. verl is not needed (nor installed): the batch only has its layout.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import balancer
from _common import at_least


def rollout(rank: int, step: int, batch: int, prompt: int, response: int) -> dict:
    """A fake rollout batch, verl-shaped; rank 0 generates longer responses."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    plen = torch.randint(16, prompt + 1, (batch,), generator=g)
    cap = response if rank == 0 else response // 4
    rlen = torch.randint(8, cap + 1, (batch,), generator=g)
    mask = torch.zeros(batch, prompt + response, dtype=torch.int64)
    rmask = torch.zeros(batch, response, dtype=torch.int64)
    for i in range(batch):
        mask[i, prompt - plen[i]:prompt + rlen[i]] = 1
        rmask[i, :rlen[i]] = 1
    ids = torch.randint(3, 32000, mask.shape, generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask,
            "old_log_probs": -torch.rand(mask.shape, generator=g) * mask,
            "advantages": torch.randn(batch, response, generator=g) * rmask,
            "response_mask": rmask, "rewards": torch.randn(batch, generator=g)}


def fake_log_probs(input_ids: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Stands in for the policy's forward pass: any per-token function of the tokens."""
    return old * 0.9 - (input_ids % 7).to(old.dtype) * 0.01


def worker(rank: int, world: int, init: str, args) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        from balancer import load_cost_model
        from balancer.runtime import balance_rollout
        cost = load_cost_model(args.cost_model)
        first = 0
        if args.resume_from is not None:  # a fresh process of the resumed run
            first = json.loads(Path(args.resume_from).read_text())["step"]
            try:  # ranks resumed from different checkpoints: refused on every rank
                balance_rollout(rollout(rank, first, args.batch, args.prompt, args.response),
                                cost, args.capacity, step=first - rank)
                mismatch = None
            except ValueError as e:
                mismatch = str(e)
            if rank == 0:
                print(f"ranks resumed at steps {[first - r for r in range(world)]}: "
                      f"{'refused: ' + mismatch.splitlines()[0] if mismatch else 'ACCEPTED'}")
            if mismatch is None:
                raise SystemExit("ranks at different steps were not refused")
        digests = {}
        result = {"processes": world, "steps": args.steps, "restored_in_order": True,
                  "every_sample_once": True, "largest_microbatch": 0,
                  "capacity": args.capacity, "imbalance": []}
        for step in range(first, args.steps):
            batch = rollout(rank, step, args.batch, args.prompt, args.response)
            tokens_before = int(batch["attention_mask"].sum())
            cost_before = float(cost.doc_total(batch["attention_mask"].sum(1).numpy()).sum())
            r = balance_rollout(batch, cost, args.capacity, step=step)
            outs = [{"log_probs": fake_log_probs(mb["input_ids"], mb["old_log_probs"])}
                    for mb in r.microbatches]
            back = r.restore(outs)
            want = fake_log_probs(batch["input_ids"], batch["old_log_probs"]) * \
                batch["attention_mask"]
            ok = torch.equal(back["log_probs"], want)
            h = hashlib.sha256(r.plan.fingerprint().encode())
            for mb in r.microbatches:
                for k in ("input_ids", "position_ids", "cu_seqlens", "source_rank",
                          "source_index", "old_log_probs", "advantages"):
                    h.update(torch.as_tensor(mb[k]).numpy().tobytes())
            h.update(back["log_probs"].numpy().tobytes())
            digests[step] = h.hexdigest()
            mine = r.plan.rank_costs()[rank]
            tok_after = sum(int(mb["cu_seqlens"][-1]) for mb in r.microbatches)
            largest = max(int(mb["cu_seqlens"][-1]) for mb in r.microbatches)
            line = (f"step {step} rank {rank}: before {args.batch} samples / {tokens_before} tokens "
                    f"/ cost {cost_before:.3g}; after {sum(len(mb['sample_ids']) for mb in r.microbatches)}"
                    f" samples / {tok_after} tokens / cost {mine:.3g} in {len(r.microbatches)} "
                    f"microbatches (largest {largest} <= {args.capacity}); "
                    f"sent {r.stats['exchange']['bytes_sent']} B; restored in order: {ok}")
            lines, facts = [None] * world, [None] * world
            dist.all_gather_object(lines, line)
            trained = [i for mb in r.microbatches for i in mb["sample_ids"].tolist()]
            dist.all_gather_object(facts, (ok, trained, largest))
            if rank == 0:
                rc = r.plan.rank_costs()
                ids = sorted(i for _, t, _ in facts for i in t)  # default ids: rank + dp * i
                result["every_sample_once"] &= ids == list(range(world * args.batch))
                result["restored_in_order"] &= all(f[0] for f in facts)
                result["largest_microbatch"] = max(result["largest_microbatch"],
                                                   *(f[2] for f in facts))
                result["imbalance"].append(round(float(rc.max() / rc.mean()), 4))
                print("\n".join(lines))
                print(f"step {step}: slowest rank / mean cost after balancing "
                      f"{rc.max() / rc.mean():.4f}; gather {r.stats['gather']['bytes_sent']} B per "
                      f"rank, plan {1e3 * r.stats['plan_seconds']:.2f} ms")
            if not ok:
                raise SystemExit(f"rank {rank}: restored log-probs differ")
            if args.checkpoint is not None and step + 1 == args.checkpoint_at and rank == 0:
                Path(args.checkpoint).write_text(json.dumps({"step": step + 1}))
        every = [None] * world
        dist.all_gather_object(every, digests)
        result["digests"] = every
        if rank == 0 and args.out is not None:  # --resume: the parent compares the runs
            Path(args.out).write_text(json.dumps(result))
        elif rank == 0:
            result.pop("digests")
            print("RESULT " + json.dumps(result))
            if not (result["every_sample_once"] and result["restored_in_order"]):
                raise SystemExit("a sample was lost, duplicated or restored out of order")
    finally:
        gc.collect()  # finished collective work released before the group goes (gloo)
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=at_least(1), default=2)
    ap.add_argument("--steps", type=at_least(1), default=2)
    ap.add_argument("--batch", type=at_least(1), default=16, help="rollouts per rank")
    ap.add_argument("--prompt", type=at_least(1), default=256)
    ap.add_argument("--response", type=at_least(1), default=2048)
    ap.add_argument("--capacity", type=at_least(1), default=4096)
    ap.add_argument("--cost-model", default="llama-7b")
    ap.add_argument("--resume", action="store_true",
                    help="checkpoint after step steps // 2, resume it in fresh processes")
    args = ap.parse_args(argv)
    args.out = args.checkpoint = args.resume_from = None
    balancer.warmup(["fixed"])  # compiled once here: the spawned ranks load the kernels
    if args.resume:
        return resume(args)
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{Path(tmp) / 'rendezvous'}"
        mp.start_processes(worker, args=(args.world, init, args), nprocs=args.world, join=True,
                           start_method="spawn")


def resume(args):
    if args.steps < 2:
        raise SystemExit("--resume needs --steps 2 or more (a checkpoint between steps)")
    args.checkpoint_at = args.steps // 2
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("straight", "resumed"):  # each a fresh set of processes and group
            a = argparse.Namespace(**vars(args))
            a.out = str(Path(tmp) / f"{name}.json")
            if name == "straight":
                a.checkpoint = str(Path(tmp) / "checkpoint.json")
            else:
                a.resume_from = str(Path(tmp) / "checkpoint.json")
            init = f"file://{Path(tmp) / f'rendezvous-{name}'}"
            mp.start_processes(worker, args=(args.world, init, a), nprocs=args.world,
                               join=True, start_method="spawn")
            runs.append(json.loads(Path(a.out).read_text()))
    straight, resumed = runs
    k = str(args.checkpoint_at)
    tail = [{s: d for s, d in rank.items() if int(s) >= int(k)} for rank in straight["digests"]]
    same = tail == resumed["digests"] and all(len(d) == args.steps - int(k) for d in tail)
    print(f"resumed at step {k} in fresh processes: steps {k}..{args.steps - 1} identical to "
          f"the uninterrupted run (plans, microbatches, restored log-probs): {same}")
    res = {key: straight[key] for key in ("processes", "steps", "capacity")}
    res.update(resumed=True, checkpoint_at_step=int(k), resumed_identical=same,
               every_sample_once=straight["every_sample_once"] and resumed["every_sample_once"],
               restored_in_order=straight["restored_in_order"] and resumed["restored_in_order"],
               largest_microbatch=straight["largest_microbatch"],
               imbalance=straight["imbalance"], imbalance_resumed=resumed["imbalance"])
    print("RESULT " + json.dumps(res))
    if not (same and res["every_sample_once"] and res["restored_in_order"]):
        raise SystemExit("the resumed run differs from the uninterrupted one")


if __name__ == "__main__":
    main()
