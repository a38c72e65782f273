"""Sizes are bounded up front (issue #30 item 8): a refusal naming the size instead of a memory
error (``--samples 2**40``, ``--dp 100000 --microbatches 10**6``, a .npy header claiming 10**12
entries), or a run that never ends (``--epochs 2**63``), or more planning processes than the
machine has cores (``--workers 64`` on 2 cores)."""
import os

import numpy as np
import pytest

from balancer import Layout
from balancer.cli import main
from balancer.workloads import read_npy


def _cli(capsys, *argv):
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def _precompute(tmp_path, capsys, *extra):
    return _cli(capsys, "precompute", "--lengths", "bimodal-sft", "--samples", "50",
                "--capacity", "8192", "--out", str(tmp_path / "plan"), *extra)


def test_epochs_are_bounded(tmp_path, capsys):
    rc, err = _precompute(tmp_path, capsys, "--epochs", str(2 ** 63))
    assert rc == 2 and "epochs" in err and str(2 ** 63) in err, err
    assert not (tmp_path / "plan").exists()


def test_workers_are_bounded_by_the_cores(tmp_path, capsys):
    cores = len(os.sched_getaffinity(0))
    rc, err = _precompute(tmp_path, capsys, "--workers", str(cores + 1), "--window-samples",
                          "10")
    assert rc == 2 and f"--workers {cores + 1}" in err and f"{cores} CPU" in err, err
    assert not (tmp_path / "plan").exists()


def test_samples_beyond_memory_are_refused_up_front(tmp_path, capsys):
    rc, err = _cli(capsys, "precompute", "--lengths", "bimodal-sft", "--samples", str(2 ** 40),
                   "--capacity", "8192", "--out", str(tmp_path / "plan"))
    assert rc == 2 and str(2 ** 40) in err and "memory" in err and "MemoryError" not in err, err
    rc, err = _cli(capsys, "compare", "--lengths", "wlbllm", "--samples", str(2 ** 40),
                   "--capacity", "8192", "--strategies", "sequential")
    assert rc == 2 and str(2 ** 40) in err and "memory" in err, err


def test_microbatches_per_step_are_bounded():
    with pytest.raises(ValueError, match=r"dp x microbatches.*100000 x 1000000"):
        Layout(dp=100000, microbatches=10 ** 6, capacity=1)
    assert Layout(dp=1024, microbatches=64, capacity=8192).dp == 1024


def test_npy_header_claiming_more_than_the_file_holds(tmp_path, capsys):
    p = tmp_path / "lengths.npy"
    with open(p, "wb") as f:   # a valid header claiming 10**12 int64, then 10 of them
        np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False,
                                                 "shape": (10 ** 12,)})
        f.write(np.arange(1, 11, dtype=np.int64).tobytes())
    with pytest.raises(ValueError, match=r"lengths.npy.*1000000000000.*80 bytes"):
        read_npy(p)
    rc, err = _cli(capsys, "compare", "--lengths", str(p), "--capacity", "8192",
                   "--strategies", "sequential")
    assert rc == 2 and "1000000000000" in err and "MemoryError" not in err, err
