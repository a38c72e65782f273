"""A plan replaced while it is being read (issue #30 item 4): ``precompute --overwrite`` swaps
the plan directory while a reader has read the manifest but not yet the arrays. The reader gets
one whole plan, the old or the new one, never the manifest of one with the arrays of the other
(a false "edited or corrupted" with verification on, arrays of two plans with it off)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.config import Layout as _Layout
from balancer.cost.cp import CPCostModel
from balancer.store import load as store_load
from balancer.store import plan_store as store
from balancer.store.hybrid import load_hybrid_plan, precompute_hybrid
from tests.store.test_store import assert_same_plan


@pytest.fixture(scope="module")
def two_plans():
    rng = np.random.default_rng(3)
    samples = SampleTable(rng.integers(1, 3000, 3000))
    cost = load_cost_model("quadratic-64k")
    layout = Layout(dp=2, pp=1, cp=1, microbatches=2, capacity=8192)
    a = plan_epochs(samples, cost, layout, PlannerConfig(seed=1), 1)[0]
    b = plan_epochs(samples, cost, layout, PlannerConfig(seed=2), 1)[0]
    assert not np.array_equal(a.entry_sample, b.entry_sample)
    return a, b


def _replace_once_after_the_manifest(monkeypatch, replace):
    """Run ``replace()`` (a complete overwrite of the plan) the first time a reader has read a
    manifest and looks up the epoch in it, before it opens any array."""
    real, done = store_load._epoch_entry, []

    def entry(manifest, epoch):
        if not done:
            done.append(1)
            replace()
        return real(manifest, epoch)
    monkeypatch.setattr(store_load, "_epoch_entry", entry)
    import balancer.store.hybrid.plan_dir as plan_dir
    if getattr(plan_dir, "_epoch_entry", None) is real:
        monkeypatch.setattr(plan_dir, "_epoch_entry", entry)
    return done


@pytest.mark.parametrize("verify", [True, False])
def test_reader_sees_one_whole_plan_when_an_overwrite_lands_mid_read(two_plans, tmp_path,
                                                                     monkeypatch, verify):
    a, b = two_plans
    p = store.save_plan(a, tmp_path / "plan")
    done = _replace_once_after_the_manifest(
        monkeypatch, lambda: store.save_plan(b, p, overwrite=True))
    got, manifest = store.load_plan(p, 0, verify=verify)
    assert done
    assert manifest["config"]["seed"] in (1, 2)
    assert_same_plan(got, a if manifest["config"]["seed"] == 1 else b)
    # the manifest returned is the one the arrays were checked against
    assert got.config.seed == manifest["config"]["seed"]


def test_plan_source_rechecks_the_job_when_the_plan_was_replaced(two_plans, tmp_path):
    a, b = two_plans
    p = store.save_plan(a, tmp_path / "plan")
    source = store.plan_source(p, layout=a.layout, n_samples=a.n_samples)
    other = plan_epochs(SampleTable(np.full(50, 7)), load_cost_model("quadratic-64k"),
                        a.layout, PlannerConfig(), 1)[0]
    store.save_plan(other, p, overwrite=True)   # another job's plan under the same name
    with pytest.raises(ValueError, match=r"does not match this job.*n_samples"):
        source(0)


def test_hybrid_reader_sees_one_whole_plan(tmp_path, monkeypatch):
    lay = _Layout(dp=2, cp=2, microbatches=2, capacity=128, cp_mode="hybrid", rank_capacity=64)
    model = CPCostModel.from_preset("llama-7b", 64)
    samples = SampleTable(np.random.default_rng(0).integers(2, 200, 150))
    p = precompute_hybrid(samples, model, lay, tmp_path / "plan", seed=1)
    want = {s: load_hybrid_plan(precompute_hybrid(samples, model, lay, tmp_path / f"ref{s}",
                                                  seed=s), 0)[0] for s in (1, 2)}
    done = _replace_once_after_the_manifest(
        monkeypatch, lambda: precompute_hybrid(samples, model, lay, p, seed=2, overwrite=True))
    got, manifest = load_hybrid_plan(p, 0, lengths=samples.lengths)
    assert done
    ref = want[manifest["seed"]]
    for k in ("step_rounds", "round_groups", "group_entries", "entry_item", "item_doc"):
        assert np.array_equal(getattr(got, k), getattr(ref, k)), k


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False])
def test_loads_racing_overwrites_return_whole_plans(two_plans, tmp_path, monkeypatch, exchange):
    """Real concurrency: a thread overwrites the plan back and forth while this one loads it,
    with the atomic exchange and with the two-rename fallback (file systems without
    RENAME_EXCHANGE), where a reader may be reading the old plan moved aside as it is deleted."""
    from balancer.store.files import NO_EXCHANGE_ENV
    if not exchange:
        monkeypatch.setenv(NO_EXCHANGE_ENV, "1")
    a, b = two_plans
    p = store.save_plan(a, tmp_path / "plan")
    stop, errors = threading.Event(), []

    def writer():
        k = 0
        while not stop.is_set():
            try:
                store.save_plan((b, a)[k % 2], p, overwrite=True)
            except Exception as e:   # noqa: BLE001 - reported by the test
                errors.append(e)
                return
            k += 1
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        for i in range(300):
            verify = i % 2 == 0
            try:
                got, manifest = store.load_plan(p, 0, verify=verify)
            except ValueError as e:
                assert "replaced while reading" in str(e), e
                continue
            assert_same_plan(got, a if manifest["config"]["seed"] == 1 else b)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors


def test_overwrite_skips_a_stamp_that_a_reader_renames_away_meanwhile(two_plans, tmp_path,
                                                                      monkeypatch):
    """A reader writes its stamp as ``verified.json.tmp-PID`` and renames it; an overwrite that
    lists the epoch directory in between must not fail on the name that has gone (the CI
    failure of stop 35: FileNotFoundError from the writer of the racing test above)."""
    import pathlib
    a, b = two_plans
    p = store.save_plan(a, tmp_path / "plan")
    real = pathlib.Path.iterdir

    def iterdir(self):
        yield from real(self)
        if self.name.startswith("epoch-"):   # listed, then gone before the writer looks at it
            yield self / "verified.json.tmp-99999"
    monkeypatch.setattr(pathlib.Path, "iterdir", iterdir)
    store.save_plan(b, p, overwrite=True)
    monkeypatch.undo()
    got, manifest = store.load_plan(p, 0)
    assert manifest["config"]["seed"] == 2
    assert_same_plan(got, b)


def test_a_plan_gone_between_the_two_renames_and_back_is_read_again(two_plans, tmp_path):
    """The two-rename overwrite (no RENAME_EXCHANGE) leaves the plan's name missing for a moment:
    a reader that resolved the name while it was there, opened it while it was gone, and looked
    again once the new plan was in place must read the new plan, not say 'no plan directory
    there' (the racing test's fallback case failed so under load, CI of 2026-12-06)."""
    from balancer.store.snapshot import read_whole
    a, b = two_plans
    p = store.save_plan(a, tmp_path / "plan")
    aside = tmp_path / "moved-aside"
    p.rename(aside)   # the writer's first rename: the name is gone
    calls = []

    def resolve(path):
        calls.append(1)
        if len(calls) == 2:   # the writer's second rename lands before the reader looks again
            aside.rename(p)
        return store_load.resolve_plan_dir(path) if len(calls) > 2 else type(p)(path)

    got = read_whole(p, lambda snap: snap.manifest_bytes(), resolve=resolve)
    assert got is not None and len(calls) >= 3
    with pytest.raises(ValueError, match="no plan directory there"):   # really missing: an error
        read_whole(tmp_path / "nothing", lambda snap: snap.manifest_bytes())
