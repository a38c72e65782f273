"""The plan store: exact round trips, every kind of damage detected at load, atomic writes that
a SIGKILL cannot turn into a plan that looks complete."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.store import plan_store as store

ROOT = Path(__file__).resolve().parents[2]
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
    with pytest.raises(ValueError, match=rf"format_version: plan has {store.FORMAT_VERSION + 1}, "
                       rf"expected {store.FORMAT_VERSION}"):
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


# ---- SIGKILL at named points of the writer (deterministic: the writer kills itself) ------
_WRITER = """
import sys
import numpy as np
from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch
from balancer.store import plan_store as store
n, seed, out, overwrite = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"
samples = SampleTable(np.random.default_rng(seed).integers(1, 3000, n))
plan = plan_epoch(samples, load_cost_model("quadratic-64k"), Layout(dp=2, microbatches=2,
                  capacity=8192), PlannerConfig(seed=seed))
store.save_plan(plan, out, overwrite=overwrite)
"""


def _small_plan(n, seed):
    from balancer import plan_epoch
    samples = SampleTable(np.random.default_rng(seed).integers(1, 3000, n))
    return plan_epoch(samples, load_cost_model("quadratic-64k"),
                      Layout(dp=2, microbatches=2, capacity=8192), PlannerConfig(seed=seed))


def _run_writer(cmd, kill_at=None, no_exchange=False):
    """Run a writer process; with ``kill_at`` it SIGKILLs itself at that point of the store's
    writer (``store.KILL_ENV``), so the test never races the machine's speed."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop(store.KILL_ENV, None)
    env.pop(store.NO_EXCHANGE_ENV, None)
    if kill_at:
        env[store.KILL_ENV] = kill_at
    if no_exchange:
        env[store.NO_EXCHANGE_ENV] = "1"
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if kill_at:
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    else:
        assert r.returncode == 0, r.stderr[-2000:]
    return r


def _writer_cmd(out, n=3000, seed=1, overwrite=False):
    return [sys.executable, "-c", _WRITER, str(n), str(seed), str(out), "1" if overwrite else "0"]


def _hidden(out: Path):
    return sorted(out.parent.glob(f".{out.name}.*"))


def test_sigkill_after_arrays_leaves_nothing_that_loads_and_is_cleaned_up(tmp_path):
    out = tmp_path / "plan"
    _run_writer(_writer_cmd(out), kill_at="after-arrays")
    assert not out.exists()
    partial = _hidden(out)
    assert len(partial) == 1 and ".partial-" in partial[0].name
    assert (partial[0] / "epoch-0000" / "entry_sample.npy").stat().st_size > store.HEADER_BYTES
    with pytest.raises(ValueError, match="incomplete plan"):
        store.load_plan(partial[0], 0)
    with pytest.raises(ValueError, match="no plan directory"):
        store.load_plan(out, 0)
    assert [h["path"] for h in store.hidden_dirs(out)] == partial
    # the next writer removes what the killed one (same host, dead process) left
    store.save_plan(_small_plan(500, 2), out)
    assert _hidden(out) == []
    assert_same_plan(store.load_plan(out, 0)[0], _small_plan(500, 2))


def test_sigkill_after_manifest_before_rename(tmp_path):
    out = tmp_path / "plan"
    old = _small_plan(500, 2)
    store.save_plan(old, out)
    _run_writer(_writer_cmd(out, overwrite=True), kill_at="after-manifest")
    assert_same_plan(store.load_plan(out, 0)[0], old)
    store.save_plan(old, out, overwrite=True)
    assert _hidden(out) == []


@pytest.mark.parametrize("no_exchange", [False, True])
def test_sigkill_between_the_renames_of_an_overwrite(tmp_path, no_exchange):
    """Killed at the commit of an overwrite: the old or the new plan loads at --out. With an
    atomic exchange (Linux renameat2) there is no gap; with two plain renames (no exchange) the
    old plan, moved aside, is read from its hidden name and the next writer puts it back."""
    out = tmp_path / "plan"
    old, new = _small_plan(500, 2), _small_plan(3000, 1)
    store.save_plan(old, out)
    point = "between-renames" if no_exchange else "after-rename"
    if not no_exchange and not store.exchange_supported(tmp_path):
        pytest.skip("no atomic directory exchange on this file system")
    _run_writer(_writer_cmd(out, overwrite=True), kill_at=point, no_exchange=no_exchange)
    got = store.load_plan(out, 0)[0]
    assert_same_plan(got, old if no_exchange else new)
    assert _hidden(out)  # what the killed writer left, reported ...
    assert all(h["owner_alive"] is False for h in store.hidden_dirs(out))
    # ... and cleaned up by the next writer (which first restores the old plan if it must)
    with pytest.raises(FileExistsError):
        store.save_plan(new, out)
    assert out.is_dir() and _hidden(out) == []
    assert_same_plan(store.load_plan(out, 0)[0], old if no_exchange else new)


@pytest.mark.slow
def test_precompute_sigkill_during_overwrite_keeps_a_plan(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "balancer", "precompute", "--lengths", "wikipedia",
           "--samples", "20000", "--capacity", "32768", "--dp", "2", "--microbatches", "2",
           "--strategies", "sequential", "--over-length", "chunk", "--window-samples", "5000",
           "--no-progress", "--out", str(out)]
    _run_writer(cmd)
    before = store.load_plan(out, 0)[0]
    for point in ("after-arrays", "after-manifest", "between-renames"):
        _run_writer(cmd + ["--overwrite", "--seed", "5"], kill_at=point, no_exchange=True)
        assert_same_plan(store.load_plan(out, 0)[0], before)
    r = _run_writer([sys.executable, "-m", "balancer", "inspect", str(out), "--no-verify"])
    assert "left by interrupted writes" in r.stderr
    _run_writer(cmd + ["--overwrite", "--seed", "5"])
    assert _hidden(out) == []
    assert store.load_manifest(out)["config"]["seed"] == 5


# ---- --overwrite replaces only a plan store -------------------------------------------------
def test_overwrite_refuses_what_is_not_a_plan(setup, tmp_path):
    plan = setup[4][0]
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "todo.txt").write_text("keep me")
    (notes / "sub" / "x.txt").write_text("me too")
    with pytest.raises(ValueError, match=r"notes.*not a plan directory.*refus"):
        store.save_plan(plan, notes, overwrite=True)
    assert (notes / "todo.txt").read_text() == "keep me" and (notes / "sub" / "x.txt").exists()
    f = tmp_path / "file.txt"
    f.write_text("data")
    with pytest.raises(ValueError, match=r"file.txt.*not a directory"):
        store.save_plan(plan, f, overwrite=True)
    assert f.read_text() == "data"
    # a plan directory a user added files to is not replaced either: the file is named
    p = store.save_plan(plan, tmp_path / "plan")
    (p / "my-notes.md").write_text("results")
    with pytest.raises(ValueError, match=r"my-notes.md.*not part of a plan"):
        store.save_plan(plan, p, overwrite=True)
    (p / "my-notes.md").unlink()
    (p / "epoch-0000" / "extra.npy").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"extra.npy.*not part of a plan"):
        store.save_plan(plan, p, overwrite=True)
    (p / "epoch-0000" / "extra.npy").unlink()
    link = tmp_path / "link"
    link.symlink_to(p)
    with pytest.raises(ValueError, match=r"link.*symbolic link"):
        store.save_plan(plan, link, overwrite=True)
    assert not _hidden(notes) and not _hidden(p) and not _hidden(f)
    empty = tmp_path / "empty"
    empty.mkdir()
    store.save_plan(plan, empty, overwrite=True)  # an empty directory holds nothing to lose
    store.save_plan(plan, p, overwrite=True)
    assert_same_plan(store.load_plan(p, 0)[0], plan)
    assert not _hidden(p)


# ---- the manifest: confined paths, sealed content, invariants, schema ----------------------
def _edit(saved, fn, reseal=True):
    m = json.loads((saved / "manifest.json").read_text())
    fn(m)
    if reseal:
        m[store.MANIFEST_DIGEST_KEY] = store.manifest_digest(m)
    (saved / "manifest.json").write_text(json.dumps(m))


def test_manifest_paths_are_confined_to_the_plan(saved, tmp_path):
    secret = tmp_path / "secret.npy"
    secret.write_bytes(b"\x93NUMPY outside the plan " * 41)
    size = str(secret.stat().st_size)
    rel = os.path.relpath(secret, saved / "epoch-0000")
    for bad in (rel, str(secret), "../../secret.npy", "sub/../mb_fwd.npy"):
        _edit(saved, lambda m: m["epochs"][0]["arrays"]["mb_fwd"].update(file=bad))
        for verify in (True, False):
            with pytest.raises(ValueError, match=r"'mb_fwd'.*not a file name inside the plan"
                               ) as e:
                store.load_plan(saved, 0, verify=verify)
            assert size not in str(e.value) and "bytes" not in str(e.value)
    _edit(saved, lambda m: m["epochs"][0]["arrays"]["mb_fwd"].update(file="mb_fwd.npy"))
    store.load_plan(saved, 0)
    for bad in ("..", "/tmp", "../plan/epoch-0000", ""):
        _edit(saved, lambda m: m["epochs"][1].update(dir=bad))
        with pytest.raises(ValueError, match=r"epoch 1.*not a directory name inside the plan"):
            store.load_plan(saved, 1)
    _edit(saved, lambda m: m["epochs"][1].update(dir="epoch-0001"))
    f = saved / "epoch-0000" / "mb_bwd.npy"
    f.unlink()
    f.symlink_to(secret)
    with pytest.raises(ValueError, match=r"mb_bwd.npy.*symbolic link.*refused") as e:
        store.load_plan(saved, 0, verify=False)
    assert size not in str(e.value)
    d = saved / "epoch-0002"
    d.rename(tmp_path / "away")
    d.symlink_to(tmp_path / "away")
    with pytest.raises(ValueError, match=r"epoch-0002.*symbolic link.*refused"):
        store.load_plan(saved, 2)


@pytest.mark.parametrize("edit", [
    lambda m: m["layout"].update(capacity=m["layout"]["capacity"] // 2),
    lambda m: m["layout"].update(microbatches=1),
    lambda m: m["config"].update(seed=12345),
    lambda m: m["dataset"].update(n_samples=10),
])
def test_manifest_edits_are_detected(saved, edit):
    _edit(saved, edit, reseal=False)
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"manifest.json.*edited.*manifest_sha256"):
            store.load_manifest(saved) if verify else store.load_plan(saved, 0, verify=False)


def test_resealed_manifest_is_checked_against_the_arrays(saved):
    cap = store.load_manifest(saved)["layout"]["capacity"]
    _edit(saved, lambda m: m["layout"].update(capacity=cap // 2))
    with pytest.raises(ValueError, match=rf"microbatches exceed the capacity {cap // 2}"):
        store.load_plan(saved, 0)
    _edit(saved, lambda m: m["layout"].update(capacity=cap, microbatches=1))
    with pytest.raises(ValueError, match=r"step_mbs.*2 microbatches per rank.*microbatches=1"):
        store.load_plan(saved, 0, verify=False)
    _edit(saved, lambda m: m["layout"].update(microbatches=2, dp=2))
    with pytest.raises(ValueError, match=r"epoch 0 is inconsistent"):
        store.load_plan(saved, 0, verify=False)
    _edit(saved, lambda m: m["layout"].update(dp=4))
    store.load_plan(saved, 0)
    _edit(saved, lambda m: m["dataset"].update(n_samples=5000))
    with pytest.raises(ValueError,
                       match=r"out of range \(first: sample 5\d\d\d.*samples are 0..4999"):
        store.load_plan(saved, 0)
    _edit(saved, lambda m: m["dataset"].update(n_samples=6001))
    with pytest.raises(ValueError, match=r"1 samples .* not in the plan \(first: sample 6000\)"):
        store.load_plan(saved, 0)
    _edit(saved, lambda m: m["dataset"].update(n_samples=6000))
    tok = store.load_manifest(saved)["dataset"]["total_tokens"]
    _edit(saved, lambda m: m["epochs"][0]["summary"].update(tokens=123))
    with pytest.raises(ValueError, match=r"summary.tokens 123.*arrays hold"):
        store.load_plan(saved, 0)
    _edit(saved, lambda m: m["epochs"][0]["summary"].update(steps=1))
    with pytest.raises(ValueError, match=r"summary.steps 1"):
        store.load_plan(saved, 0, verify=False)
    assert tok is None or tok > 0


def test_missing_keys_and_wrong_types_are_clear_errors(saved):
    cases = [
        (lambda m: m.pop("layout"), r"manifest key 'layout' is missing"),
        (lambda m: m["dataset"].pop("n_samples"), r"'dataset.n_samples' is missing"),
        (lambda m: m["dataset"].update(n_samples="6000"), r"'dataset.n_samples' is str"),
        (lambda m: m.update(epochs={}), r"'epochs' is dict.*expected list"),
        (lambda m: m["epochs"][1]["arrays"]["mb_fwd"].pop("sha256"),
         r"'epochs\[1\].arrays.mb_fwd.sha256' is missing"),
        (lambda m: m["epochs"][0]["arrays"]["mb_step"].update(shape=[None]),
         r"'epochs\[0\].arrays.mb_step.shape'"),
        (lambda m: m["epochs"][0].update(epoch="0"), r"'epochs\[0\].epoch' is str"),
        (lambda m: m["layout"].update(dp="four"), r"'layout' is invalid.*dp"),
        (lambda m: m["epochs"][2]["arrays"].pop("step_mbs"),
         r"'epochs\[2\].arrays.step_mbs' is missing"),
    ]
    for fn, msg in cases:
        m0 = (saved / "manifest.json").read_text()
        _edit(saved, fn)
        with pytest.raises(ValueError, match=msg):
            store.load_plan(saved, 0)
        (saved / "manifest.json").write_text(m0)
    store.load_plan(saved, 2)


def test_sampler_reads_a_plan_directory(tmp_path):
    """The drop-in sampler takes a precomputed plan directory, yields exactly the in-memory
    plan's microbatches, and refuses a directory made for another layout."""
    import numpy as np
    import pytest

    from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch
    from balancer.loader.sampler import PackedBatchSampler
    from balancer.store.plan_store import save_plan
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


def test_check_compatible_names_a_layout_field_the_job_leaves_at_its_default(setup, saved):
    # a plan made with sync="microbatch" must not load into a job at the default sync="step"
    # (the default is left out of the job's dump, so a one-way comparison missed it)
    layout = setup[2]
    m = dict(store.load_manifest(saved))
    m["layout"] = dict(m["layout"], sync="microbatch")
    with pytest.raises(ValueError, match=r"layout sync: plan has sync='microbatch', the job has "
                                         r"sync='step'"):
        store.check_compatible(m, layout=layout)
    m["layout"]["sync"] = "step"  # written out at its default: the same job
    store.check_compatible(m, layout=layout)
