"""The plan store: exact round trips, every kind of damage detected at load, atomic writes that
a SIGKILL cannot turn into a plan that looks complete."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs, store

ROOT = Path(__file__).resolve().parent.parent
PLAN_FIELDS = ("entry_sample", "entry_start", "entry_length", "entry_delay", "mb_offsets",
               "step_mbs", "mb_fwd", "mb_bwd")


def assert_same_plan(a, b):
    for f in PLAN_FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert np.asarray(x).dtype == np.asarray(y).dtype, f
        assert np.array_equal(x, y), f
    for f in ("sample", "start", "length"):
        assert np.array_equal(getattr(a.leftover, f), getattr(b.leftover, f)), f
    assert (a.layout, a.config, a.cost_model, a.epoch, a.n_samples, a.dataset_fingerprint) == \
        (b.layout, b.config, b.cost_model, b.epoch, b.n_samples, b.dataset_fingerprint)
    assert a.fingerprint() == b.fingerprint()


@pytest.fixture(scope="module")
def setup():
    rng = np.random.default_rng(7)
    lengths = np.where(rng.random(6000) < 0.01, rng.integers(9000, 40000, 6000),
                       rng.integers(1, 3000, 6000))
    samples = SampleTable(lengths)
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=4, pp=2, cp=2, microbatches=2, capacity=8192)
    config = PlannerConfig(over_length="chunk", tail="carry", max_delay=3)
    return samples, cost, layout, config, plan_epochs(samples, cost, layout, config, 3)


@pytest.fixture
def saved(setup, tmp_path):
    samples, cost, layout, config, plans = setup
    return store.save_plan(plans, tmp_path / "plan", cost=cost, extra={"note": "x"})


def test_round_trip_every_epoch(setup, saved):
    samples, cost, layout, config, plans = setup
    assert any(len(p.leftover) for p in plans[:-1]) or plans[1].stats["carried_in"] >= 0
    for p in plans:
        q, manifest = store.load_plan(saved, p.epoch)
        assert_same_plan(q, p)
        assert isinstance(q.entry_sample, np.memmap) and not q.entry_sample.flags.writeable
        assert {k: v for k, v in q.stats.items()} == p.stats
    assert manifest["extra"] == {"note": "x"}
    assert manifest["config_resolved"] == {"max_advance": 9}  # default: 3 x max_delay
    assert manifest["cost_model"]["spec"]["name"] == cost.name
    assert [e["epoch"] for e in manifest["epochs"]] == [0, 1, 2]
    e0 = manifest["epochs"][0]["summary"]
    assert e0["microbatches"] == plans[0].n_microbatches and e0["steps"] == plans[0].n_steps
    assert e0["tokens"] == int(plans[0].entry_length.sum())


def test_arrays_are_plain_npy_with_derived_step_and_rank(setup, saved):
    plan = setup[4][0]
    d = saved / "epoch-0000"
    # readable by numpy without the store (plain .npy, fixed header)
    assert np.array_equal(np.load(d / "entry_sample.npy"), plan.entry_sample)
    a = store.load_arrays(saved, 0)
    for step in range(plan.n_steps):
        for rank in range(plan.layout.dp):
            ids = plan.microbatch_ids(step, rank)
            assert (a["mb_step"][ids] == step).all() and (a["mb_rank"][ids] == rank).all()


def test_empty_arrays_round_trip(setup, tmp_path):
    plan = setup[4][0]
    assert len(plan.leftover) == 0 or True
    p = store.save_plan(plan, tmp_path / "one")
    q, _ = store.load_plan(p, 0)
    assert_same_plan(q, plan)
    assert q.leftover.sample.shape == plan.leftover.sample.shape


def test_missing_epoch_and_existing_target(setup, saved):
    with pytest.raises(ValueError, match=r"no epoch 7 \(epochs: \[0, 1, 2\]\)"):
        store.load_plan(saved, 7)
    with pytest.raises(FileExistsError):
        store.save_plan(setup[4][0], saved)
    store.save_plan(setup[4][:1], saved, overwrite=True)
    assert [e["epoch"] for e in store.load_manifest(saved)["epochs"]] == [0]


def test_truncated_array_is_detected(saved):
    f = saved / "epoch-0001" / "entry_length.npy"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 8)
    store.load_plan(saved, 0)  # other epochs are untouched
    for verify in (True, False):
        with pytest.raises(ValueError, match="entry_length.npy.*truncated or edited"):
            store.load_plan(saved, 1, verify=verify)


def test_edited_array_is_detected(saved):
    f = saved / "epoch-0000" / "mb_fwd.npy"
    a = np.load(f)
    a[3] *= 1.0000001
    with open(f, "r+b") as fh:
        fh.seek(store.HEADER_BYTES)
        fh.write(a.tobytes())
    with pytest.raises(ValueError, match=r"SHA-256 of 'mb_fwd' differs"):
        store.load_plan(saved, 0)


def test_edited_header_is_detected(saved):
    f = saved / "epoch-0000" / "entry_sample.npy"
    raw = bytearray(f.read_bytes())
    raw[:store.HEADER_BYTES] = store.npy_header("<i4", (len(raw) - store.HEADER_BYTES) // 4)
    f.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="entry_sample.npy"):
        store.load_plan(saved, 0, verify=False)


def test_missing_array_and_manifest_are_detected(saved):
    (saved / "epoch-0002" / "step_mbs.npy").unlink()
    with pytest.raises(ValueError, match="array 'step_mbs' is missing"):
        store.load_plan(saved, 2)
    (saved / "manifest.json").unlink()
    with pytest.raises(ValueError, match="incomplete plan"):
        store.load_plan(saved, 0)


def test_wrong_format_version_is_detected(saved):
    m = json.loads((saved / "manifest.json").read_text())
    m["format_version"] = store.FORMAT_VERSION + 1
    (saved / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"format_version: plan has 2, expected 1"):
        store.load_plan(saved, 0)
    (saved / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        store.load_manifest(saved)


def test_check_compatible_names_what_differs(setup, saved):
    samples, cost, layout, config, plans = setup
    m = store.load_manifest(saved)
    store.check_compatible(m, layout=layout, dataset_fingerprint=samples.fingerprint(),
                           n_samples=len(samples), format_version=store.FORMAT_VERSION)
    with pytest.raises(ValueError, match=r"layout cp: plan has cp=2, the job has cp=4"):
        store.check_compatible(m, layout=layout.model_copy(update={"cp": 4}))
    other = SampleTable(samples.lengths + 1)
    with pytest.raises(ValueError, match=r"dataset fingerprint: plan has '[0-9a-f]+', the job"):
        store.check_compatible(m, dataset_fingerprint=other.fingerprint())
    with pytest.raises(ValueError, match=r"n_samples: plan has 6000, the job's dataset has 5999"):
        store.check_compatible(m, n_samples=5999)
    with pytest.raises(ValueError, match=r"dp=4.*dp=8.*capacity=8192.*capacity=4096"):
        store.check_compatible(m, layout={**layout.model_dump(), "dp": 8, "capacity": 4096})
    src = store.plan_source(saved, layout=layout, dataset_fingerprint=samples.fingerprint(),
                            n_samples=len(samples))
    assert_same_plan(src(1), plans[1])
    with pytest.raises(ValueError, match="cp=2"):
        store.plan_source(saved, layout=layout.model_copy(update={"cp": 1}))


def test_save_refuses_mismatched_inputs(setup, tmp_path):
    samples, cost, layout, config, plans = setup
    with pytest.raises(ValueError, match="repeat"):
        store.save_plan([plans[0], plans[0]], tmp_path / "a")
    with pytest.raises(ValueError, match="lengths fingerprint"):
        store.save_plan(plans, tmp_path / "b", lengths_fingerprint="0" * 16)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert not list(tmp_path.glob(".*partial*"))


def _kill_while_writing(cmd, out: Path, timeout=120.0):
    """Start ``cmd``, SIGKILL it as soon as it has written array data into its partial
    directory; returns the partial directories left behind."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < timeout:
            parts = list(out.parent.glob(f".{out.name}.partial-*"))
            if any(f.stat().st_size > store.HEADER_BYTES
                   for p in parts for f in p.glob("epoch-*/entry_sample.npy")):
                proc.send_signal(signal.SIGKILL)
                break
            assert proc.poll() is None, "the writer finished before it could be killed"
            time.sleep(0.005)
        else:
            pytest.fail("the writer never started writing")
    finally:
        proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    return list(out.parent.glob(f".{out.name}.partial-*"))


def _precompute_cmd(out, extra=()):
    return [sys.executable, "-m", "balancer", "precompute", "--lengths", "wikipedia",
            "--samples", "3000000", "--capacity", "32768", "--dp", "8", "--microbatches", "4",
            "--strategies", "sequential", "--over-length", "chunk", "--window-samples",
            "100000", "--no-progress", "--out", str(out), *extra]


def test_sigkill_mid_write_leaves_nothing_that_loads(tmp_path):
    out = tmp_path / "plan"
    partial = _kill_while_writing(_precompute_cmd(out), out)
    assert not out.exists()
    assert partial, "the kill should have left the partial directory behind"
    for p in partial:
        with pytest.raises(ValueError, match="incomplete plan"):
            store.load_plan(p, 0)


def test_sigkill_during_overwrite_keeps_the_old_plan(setup, tmp_path):
    out = tmp_path / "plan"
    store.save_plan(setup[4][0], out)
    _kill_while_writing(_precompute_cmd(out, ["--overwrite"]), out)
    q, _ = store.load_plan(out, 0)  # the old plan, intact and verified
    assert_same_plan(q, setup[4][0])


def test_sampler_reads_a_plan_directory(tmp_path):
    """The drop-in sampler takes a precomputed plan directory, yields exactly the in-memory
    plan's microbatches, and refuses a directory made for another layout."""
    import numpy as np
    import pytest

    from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch
    from balancer.sampler import PackedBatchSampler
    from balancer.store import save_plan
    rng = np.random.default_rng(0)
    samples = SampleTable(rng.integers(1, 3000, 4000))
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=2, microbatches=2, capacity=8192)
    plan = plan_epoch(samples, cost, layout, PlannerConfig(seed=3))
    save_plan(plan, tmp_path / "plan", cost=cost)
    for rank in range(2):
        a = PackedBatchSampler(samples, cost, layout, PlannerConfig(seed=3), dp_rank=rank)
        b = PackedBatchSampler(samples, layout=layout, plan_dir=tmp_path / "plan", dp_rank=rank)
        assert len(a) == len(b)
        assert [list(x) for x in a] == [list(x) for x in b]
    with pytest.raises(ValueError, match="dp"):
        PackedBatchSampler(samples, layout=Layout(dp=4, microbatches=2, capacity=8192),
                           plan_dir=tmp_path / "plan", dp_rank=0)
