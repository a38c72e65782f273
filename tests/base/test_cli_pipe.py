"""A command whose output is piped into a reader that stops early (``python -m balancer inspect
PLAN | head -3``) ends quietly: the reader asked for no more, that is not an error."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_closed_pipe_is_not_an_error(tmp_path):
    out = tmp_path / "plan"
    subprocess.run([sys.executable, "-m", "balancer", "precompute", "--lengths", "wikipedia",
                    "--samples", "300", "--dp", "1", "--microbatches", "1", "--capacity", "65536",
                    "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes its first line
    p = subprocess.run([sys.executable, "-m", "balancer", "inspect", str(out)], cwd=ROOT,
                       stdout=w, stderr=subprocess.PIPE, text=True, timeout=600)
    os.close(w)
    assert "Broken pipe" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.returncode != 2, p.stderr  # 2 is the CLI's bad-input status
