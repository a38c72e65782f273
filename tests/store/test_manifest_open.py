"""The manifest is opened once, the same way, by every entry point (issue #30 item 1): a symbolic
link or a FIFO named ``manifest.json`` is refused unopened by ``load_plan``, ``inspect`` and
``precompute --overwrite``, instead of reading /dev/zero until memory runs out or blocking
forever on a FIFO."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.cli import main
from balancer.store import plan_store as store

DEADLINE_S = 60   # a call that opened the FIFO blocks forever; this only bounds the test
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan():
    samples = SampleTable(np.arange(1, 200, dtype=np.int64))
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=2, pp=1, cp=1, microbatches=2, capacity=4096)
    return plan_epochs(samples, cost, layout, PlannerConfig(), 1)[0]


def _bounded(fn):
    """Run ``fn`` in a thread; its result or exception, or fail when it is still blocked."""
    box = {}

    def go():
        try:
            box["value"] = fn()
        except BaseException as e:   # noqa: BLE001 - handed to the test
            box["error"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    return t, box


def _unblock(fifo):
    try:   # a reader blocked in open() gets EOF once a writer comes and goes
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _entry_points(p, plan, capsys):
    def inspect():
        rc = main(["inspect", str(p)])
        return rc, capsys.readouterr().err

    def overwrite():
        try:
            store.save_plan(plan, p, overwrite=True)
        except ValueError as e:
            return 2, str(e)
        return 0, ""

    def load():
        try:
            store.load_plan(p, 0)
        except ValueError as e:
            return 2, str(e)
        return 0, ""
    return {"inspect": inspect, "overwrite": overwrite, "load_plan": load}


@pytest.mark.parametrize("kind", ["link-fifo", "fifo"])
def test_manifest_that_is_not_a_regular_file_is_refused_unopened(plan, tmp_path, capsys, kind):
    p = store.save_plan(plan, tmp_path / "plan")
    m = p / "manifest.json"
    m.unlink()
    fifo = tmp_path / "fifo"
    if kind == "link-fifo":
        os.mkfifo(fifo)
        m.symlink_to(fifo)
    else:
        os.mkfifo(m)
        fifo = m
    want = "symbolic link" if kind.startswith("link") else "not a regular file"
    for name, fn in _entry_points(p, plan, capsys).items():
        t, box = _bounded(fn)
        if t.is_alive():
            _unblock(fifo)
            t.join(10)
            pytest.fail(f"{name}: still blocked on the {kind} manifest after {DEADLINE_S} s")
        assert "error" not in box, f"{name}: {box.get('error')!r}"
        rc, msg = box["value"]
        assert rc == 2, name
        assert "manifest.json" in msg and want in msg, (name, msg)
        assert len(msg.strip().splitlines()) == 1, (name, msg)
    assert os.path.lexists(m)   # nothing was replaced


_DEV_ZERO = """
import sys
from balancer.cli import main
from balancer.store import plan_store as store
p = sys.argv[1]
for name, fn in (("load_plan", lambda: store.load_plan(p, 0)),
                 ("overwrite", lambda: store.save_plan(store.load_plan(p + "-copy", 0)[0], p,
                                                       overwrite=True))):
    try:
        fn()
        print(name, "accepted")
    except ValueError as e:
        print(name, "refused:", e)
print("inspect rc", main(["inspect", p]))
"""


def _limit_memory():   # reading /dev/zero must end in a refusal, not in the OOM killer
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def test_manifest_linked_to_dev_zero_is_refused_unread(plan, tmp_path):
    p = store.save_plan(plan, tmp_path / "plan")
    store.save_plan(plan, tmp_path / "plan-copy")
    (p / "manifest.json").unlink()
    (p / "manifest.json").symlink_to("/dev/zero")
    r = subprocess.run([sys.executable, "-c", _DEV_ZERO, str(p)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, preexec_fn=_limit_memory)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "load_plan refused:" in out and "overwrite refused:" in out, out
    assert "inspect rc 2" in out and "MemoryError" not in out, out
    assert out.count("symbolic link") == 3, out
    assert (p / "manifest.json").is_symlink()


def test_manifest_larger_than_any_plan_manifest_is_refused_unread(plan, tmp_path, capsys):
    p = store.save_plan(plan, tmp_path / "plan")
    m = p / "manifest.json"
    with open(m, "r+b") as f:
        f.truncate(store.MAX_MANIFEST_BYTES + 1)   # sparse: nothing is written
    with pytest.raises(ValueError, match=r"manifest.json.*bytes.*more than"):
        store.load_plan(p, 0)
    assert main(["inspect", str(p)]) == 2
    assert "more than" in capsys.readouterr().err
