"""What a killed ``torchrun ... precompute`` leaves is cleaned up by the next run like a killed
single-process one: its hidden directory also holds the ranks' spill folders
(``.spill-epoch<E>-rank<R>/<window>.npz``, planned windows waiting for every rank's sizes).
Before, the next run wrote its plan but left the directory behind with a warning ('it holds
files that are not part of a plan'), to be removed by hand."""
import socket
import subprocess
import sys

import numpy as np

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.store import plan_store as store


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(out, tag="0123abcd"):
    d = out.parent / f".{out.name}.partial-{socket.gethostname()}-{_dead_pid()}-{tag}"
    (d / "epoch-0000").mkdir(parents=True)
    np.save(d / "epoch-0000" / "entry_sample.npy", np.arange(5))
    (d / ".spill-epoch1-rank0").mkdir()
    np.savez(d / ".spill-epoch1-rank0" / "3.npz", a=np.arange(3))
    (d / ".spill-epoch1-rank1").mkdir()
    return d


def _plan():
    return plan_epoch(SampleTable(np.arange(1, 300)), CostModel.quadratic(4096),
                      Layout(dp=2, microbatches=2, capacity=4096), PlannerConfig())


def test_the_spill_of_a_killed_distributed_run_is_cleaned_up(tmp_path):
    out = tmp_path / "plan"
    d = _partial(out)
    assert store.cleanup_stale(out) == []
    assert not d.exists()
    # and through the next precompute's writer
    d = _partial(out, "4567cdef")
    store.save_plan(_plan(), out)
    assert not d.exists() and out.is_dir()


def test_other_files_in_a_spill_folder_are_still_left_alone(tmp_path):
    out = tmp_path / "plan"
    d = _partial(out)
    (d / ".spill-epoch1-rank0" / "notes.txt").write_text("mine")
    (left,) = store.cleanup_stale(out)
    assert "left in place" in left and d.exists()
