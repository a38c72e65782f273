"""``python -m balancer precompute`` on several ranks when one rank alone meets a user error (its
lengths file missing or different on its machine, a window only it plans refused, its disk
full): every rank exits with the same one-line error naming the failed rank, none is left
waiting in (or crashing out of) a gloo collective, and the group stays usable afterwards."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

from balancer.cli import main
from balancer.store import plan_store, precompute as pre

from tests.common.gloo import run_ranks


def _lengths(n=1500, seed=5):
    return np.random.default_rng(seed).integers(1, 3000, n)


def _argv(npy, out):
    return ["precompute", "--lengths", str(npy), "--dp", "2", "--microbatches", "2",
            "--capacity", "8192", "--window-samples", "500", "--out", str(out), "--no-progress"]


def _run(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, [ln for ln in err.getvalue().splitlines() if ln.startswith("error:")]


def _cases(rank, world, out_dir, good, other):
    out = Path(out_dir)
    results = {}
    # 1. rank 1's lengths file is missing (another machine without the file)
    results["missing"] = _run(_argv(good if rank == 0 else out / "absent.npy", out / "p1"))
    # 2. rank 1 reads different lengths: a plan from two corpora would be wrong silently
    results["differ"] = _run(_argv(good if rank == 0 else other, out / "p2"))
    # 3. a window only rank 1 plans is refused (the planner raising on it)
    real = pre.plan_part

    def refuse(ew, cost, i):
        if rank == 1:
            raise ValueError(f"sample 1234: length 99 refused in window {i}")
        return real(ew, cost, i)
    pre.plan_part = refuse
    try:
        results["plan"] = _run(_argv(good, out / "p3"))
    finally:
        pre.plan_part = real
    # 4. rank 1's disk is full while it writes its slices
    real_write = plan_store.write_slice

    def full(*a, **k):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real_write(*a, **k)
    plan_store.write_slice = full
    try:
        results["write"] = _run(_argv(good, out / "p4"))
    finally:
        plan_store.write_slice = real_write
    # the group is still in step: a collective after the errors works
    t = [None] * world
    dist.all_gather_object(t, rank)
    results["after"] = t
    # 5. and a good run still writes the plan
    results["good"] = _run(_argv(good, out / "p5"))
    (out / f"rank{rank}.json").write_text(json.dumps(results))


def test_one_rank_failing_fails_every_rank_with_the_same_error(tmp_path):
    good, other = tmp_path / "good.npy", tmp_path / "other.npy"
    np.save(good, _lengths())
    np.save(other, _lengths(seed=6))
    run_ranks(_cases, 2, tmp_path, str(good), str(other), timeout_s=180, torchrun_env=True)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    for case in ("missing", "differ", "plan", "write"):
        assert r0[case] == r1[case], case          # the same exit code and error on each rank
        rc, errors = r0[case]
        assert rc == 2 and len(errors) == 1, (case, r0[case])
        assert "rank 1" in errors[0], (case, errors)
    assert "absent.npy" in r0["missing"][1][0]
    assert "different lengths" in r0["differ"][1][0]
    assert "sample 1234" in r0["plan"][1][0]
    assert "No space left" in r0["write"][1][0]
    assert r0["after"] == r1["after"] == [0, 1]
    assert r0["good"] == r1["good"] == [0, []]
    for p in ("p1", "p2", "p3", "p4"):   # nothing half-written left behind
        assert not (tmp_path / p).exists()
        assert not list(tmp_path.glob(f".{p}*")), list(tmp_path.iterdir())
    plan_store.load_plan(tmp_path / "p5", 0)
