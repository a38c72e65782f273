"""Spawning gloo process groups for the run-time balancing tests (the pattern of
tests/test_distributed.py): ``file://`` rendezvous in the test's tmp dir, a timeout that kills
the ranks, results written by the ranks as JSON and checked in the parent."""
import json
from pathlib import Path


from tests.common import gloo

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420  # generous: CI machines are shared; a hang still fails


def run_ranks(fn, world: int, tmp_path, *args):
    """Spawn ``world`` processes running ``fn(rank, world, out_dir, *args)`` in one gloo group
    (the suite's one harness, tests/common/gloo.py); fail (killing them) after TIMEOUT_S."""
    gloo.run_ranks(fn, world, tmp_path, *args, timeout_s=TIMEOUT_S)


def write(out, name, obj):
    with open(Path(out) / name, "w") as f:
        json.dump(obj, f)


def read(tmp_path, name):
    return json.loads((Path(tmp_path) / name).read_text())
