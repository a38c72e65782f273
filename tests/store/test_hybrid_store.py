"""Hybrid DP x CP plans on disk: a stored plan gives exactly the batches the sampler plans
itself, every broken invariant or mismatched job is refused by name, and neither loader reads
the other mode's plans."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from balancer.config import Layout
from balancer.cost.cp import CPCostModel
from balancer.loader.hybrid import HybridBatchSampler
from balancer.planning.hybrid import HYBRID_DEFAULT_STRATEGY
from balancer.samples import SampleTable
from balancer.store import plan_store
from balancer.store.files import MANIFEST
from balancer.store.atomic import manifest_digest
from balancer.store.hybrid import load_hybrid_manifest, load_hybrid_plan, precompute_hybrid
from tests.common.strategies import each_hybrid_strategy

ROOT = Path(__file__).resolve().parents[2]
CAP = 64
LAYOUT = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                rank_capacity=CAP)
MODEL = CPCostModel.from_preset("llama-7b", CAP)
STRATEGIES = each_hybrid_strategy()   # the registry's, fixed_cp<c> at degree 2


def lengths_mixed(n=120, seed=0):
    rng = np.random.default_rng(seed)
    short = rng.integers(2, 40, n)
    long = rng.integers(CAP + 1, 4 * CAP, n)   # needs a group of 2 or 4
    return np.where(rng.random(n) < 0.12, long, short).astype(np.int64)


SAMPLES = SampleTable(lengths_mixed())


def refs(sampler):
    return [(list(r), r.starts.tolist(), r.lengths.tolist(), r.sharded.tolist(), r.group_offset,
             r.group_size, r.step, r.round, r.step_loss_tokens) for r in sampler]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stored_plan_gives_the_batches_the_sampler_plans(tmp_path, strategy):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", strategy=strategy,
                            seed=7, epochs=2)
    for epoch in (0, 1):
        for rank in range(4):
            own = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, strategy=strategy, seed=7,
                                     rank=rank, epoch=epoch)
            stored = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, strategy=strategy, seed=7,
                                        rank=rank, epoch=epoch, plan=out)
            assert len(stored) == len(own)
            assert refs(stored) == refs(own)
    # the arrays themselves are the planned ones, memory-mapped read-only
    plan, manifest = load_hybrid_plan(out, 1, lengths=SAMPLES.lengths)
    mine = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, strategy=strategy, seed=7, epoch=1).plan
    for name in ("step_rounds", "round_groups", "group_offset", "group_size", "group_entries",
                 "entry_item", "entry_owner", "item_doc", "item_start", "item_length"):
        assert np.array_equal(getattr(plan, name), getattr(mine, name)), name
        assert not getattr(plan, name).flags.writeable or getattr(plan, name).size == 0
    assert manifest["strategy"] == strategy and manifest["n_epochs"] == 2


def test_resume_from_a_stored_plan_is_exact(tmp_path):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)
    full = refs(HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=1, plan=out))
    s = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=1, plan=out)
    it = iter(s)
    for _ in range(3):
        next(it)
    state = s.state_dict()
    t = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=1, plan=out)
    t.load_state_dict(state)
    assert refs(t) == full[3:]


@pytest.mark.parametrize("change,msg", [
    (dict(seed=8), r"seed: plan has 7, the job has 8"),
    (dict(strategy="megatron_hybrid"), r"strategy: plan has 'hybrid'"),
    (dict(batch_tokens=4096), r"batch_tokens: plan has 512, the job has 4096"),
    (dict(max_delay=3), r"max_delay: plan has 2, the job has 3"),
    (dict(samples=SampleTable(lengths_mixed(seed=1))), r"dataset fingerprint"),
    (dict(samples=SampleTable(lengths_mixed(n=121))), r"n_samples: plan has 120"),
    (dict(layout=LAYOUT.model_copy(update={"microbatches": 3})),
     r"layout microbatches: plan has 2, the job has 3"),
    (dict(model=MODEL.with_hardware(overlap=0.5)), r"CP cost model differs in hardware"),
])
def test_a_plan_made_for_another_job_is_refused_by_name(tmp_path, change, msg):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", strategy="hybrid", seed=7)
    kw = dict(samples=SAMPLES, model=MODEL, layout=LAYOUT, strategy="hybrid", seed=7,
              rank=0, max_delay=2)
    kw.update(change)
    samples, model, layout = kw.pop("samples"), kw.pop("model"), kw.pop("layout")
    with pytest.raises(ValueError, match=msg):
        HybridBatchSampler(samples, model, layout, plan=out, **kw)


def test_the_same_cost_model_under_another_name_trains_from_the_plan(tmp_path):
    """A model's name is a label (a config.json's folder, a fitted preset's file name): the
    same coefficients under another name are the same job; other coefficients are not."""
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)
    dump = MODEL.model_dump(mode="json")
    renamed = CPCostModel.model_validate(
        {**dump, "cost": {**dump["cost"], "name": "qwen3 (/mnt/elsewhere/Qwen3-8B)"}})
    want = refs(HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=1))
    assert refs(HybridBatchSampler(SAMPLES, renamed, LAYOUT, seed=7, rank=1, plan=out)) == want
    other = CPCostModel.model_validate(
        {**dump, "cost": {**dump["cost"], "name": "x",
                          "forward": {**dump["cost"]["forward"], "c": 1.0}}})
    with pytest.raises(ValueError, match="CP cost model differs in cost"):
        HybridBatchSampler(SAMPLES, other, LAYOUT, seed=7, rank=1, plan=out)


def test_default_strategy_change_old_plans(tmp_path):
    """The default of cp_mode hybrid is hybrid_stream (sampler and store agree); a plan stored
    with the old default ``hybrid`` still trains when the job names it, and is refused, naming
    the strategy, when the job takes the default."""
    assert HYBRID_DEFAULT_STRATEGY == "hybrid_stream"
    new = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "new", seed=7)
    assert json.loads((new / MANIFEST).read_text())["strategy"] == "hybrid_stream"
    own = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=0)
    assert own.strategy == "hybrid_stream"
    assert refs(HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=0, plan=new)) == refs(own)
    old = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "old", strategy="hybrid", seed=7)
    named = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, strategy="hybrid", seed=7, rank=0,
                               plan=old)
    assert refs(named) == refs(HybridBatchSampler(SAMPLES, MODEL, LAYOUT, strategy="hybrid",
                                                  seed=7, rank=0))
    with pytest.raises(ValueError, match=r"strategy: plan has 'hybrid', the job has "
                                         r"'hybrid_stream'"):
        HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=0, plan=old)


def _rewrite(out, name, fn, epoch=0, reseal=True, summary=None):
    """Change one array in place (and its hash and ``summary`` figures in a resealed manifest,
    so that only the plan checks can catch it)."""
    f = out / f"epoch-{epoch:04d}" / f"{name}.npy"
    a = np.load(f).copy()
    fn(a)
    raw = f.read_bytes()
    f.write_bytes(raw[:128] + a.astype("<i8").tobytes())
    if reseal:
        m = json.loads((out / MANIFEST).read_text())
        from balancer.store.files import file_digest
        m["epochs"][epoch]["arrays"][name]["sha256"] = file_digest(f)
        m["epochs"][epoch]["summary"].update(summary or {})
        m.pop("manifest_sha256")
        m["manifest_sha256"] = manifest_digest(m)
        (out / MANIFEST).write_text(json.dumps(m))


def _first_sharded_entry(out):
    plan, _ = load_hybrid_plan(out)
    return int(np.flatnonzero(plan.entry_owner == -1)[0])


@pytest.mark.parametrize("name,fn,msg", [
    ("item_length", lambda a: a.__setitem__(0, a[0] + 1), r"tokens|pieces|holds"),
    ("item_doc", lambda a: a.__setitem__(0, a[1]), r"not in the plan|pieces do not tile|holds"),
    ("group_size", lambda a: a.__setitem__(0, 3), r"aligned power of two"),
    ("entry_item", lambda a: a.__setitem__(0, a[1]), r"every item exactly once"),
    ("entry_owner", lambda a: a.__setitem__(0, 9), r"owner 9 is outside its group"),
    ("group_offset", lambda a: a.__setitem__(1, a[1] + 1), r"aligned|tile the pool"),
])
def test_a_broken_stored_plan_is_refused_by_name(tmp_path, name, fn, msg):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)
    _rewrite(out, name, fn)
    with pytest.raises(ValueError, match=msg):
        load_hybrid_plan(out, lengths=SAMPLES.lengths)


def test_over_capacity_and_edited_arrays_are_refused(tmp_path):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)
    plan, _ = load_hybrid_plan(out)
    # one whole document made longer than a rank holds (its sample's length too: no coverage
    # error first) -> the token limit names rank, round and capacity
    k = int(np.flatnonzero(plan.entry_owner >= 0)[0])
    item = int(plan.entry_item[k])
    tokens = int(plan.item_length.sum()) + CAP + 1 - int(plan.item_length[item])
    _rewrite(out, "item_length", lambda a: a.__setitem__(item, CAP + 1),
             summary={"tokens": tokens})
    with pytest.raises(ValueError, match=rf"holds \d+ tokens in round \d+, over the rank "
                                         rf"capacity {CAP}"):
        load_hybrid_plan(out)
    out2 = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan2", seed=7)
    _rewrite(out2, "item_start", lambda a: a.__setitem__(0, 5), reseal=False)
    with pytest.raises(ValueError, match=r"SHA-256 of 'item_start' differs"):
        load_hybrid_plan(out2)
    m = json.loads((out2 / MANIFEST).read_text())
    m["seed"] = 8
    (out2 / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"edited or corrupted"):
        load_hybrid_manifest(out2)


def test_each_loader_names_the_other_modes_plan(tmp_path):
    out = precompute_hybrid(SAMPLES, MODEL, LAYOUT, tmp_path / "plan", seed=7)
    with pytest.raises(ValueError, match=r"a hybrid DP x CP plan .*HybridBatchSampler"):
        plan_store.load_plan(out)
    from balancer import CostModel, plan_epoch
    fixed = plan_epoch(SAMPLES, CostModel.quadratic(65536), Layout(dp=2, capacity=512))
    plan_store.save_plan(fixed, tmp_path / "fixed")
    with pytest.raises(ValueError, match=r"a fixed-CP plan .*PackedBatchSampler"):
        load_hybrid_plan(tmp_path / "fixed")
    # overwrite replaces a hybrid plan store (it is a plan store), atomically
    precompute_hybrid(SAMPLES, MODEL, LAYOUT, out, seed=8, overwrite=True)
    assert load_hybrid_manifest(out)["seed"] == 8
    with pytest.raises(FileExistsError):
        precompute_hybrid(SAMPLES, MODEL, LAYOUT, out, seed=8)
    with pytest.raises(ValueError, match=r"cp_mode='hybrid'"):
        precompute_hybrid(SAMPLES, MODEL, LAYOUT.model_copy(update={"cp_mode": "fixed"}),
                          tmp_path / "x")


def test_cli_precompute_and_inspect_a_hybrid_plan(tmp_path):
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, SAMPLES.lengths)
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "balancer", "precompute", "--cp-mode", "hybrid",
           "--rank-capacity", str(CAP), "--dp", "2", "--cp", "2", "--microbatches", "2",
           "--cost-model", "llama-7b", "--lengths", str(lengths), "--seed", "7", "--epochs", "2",
           "--out", str(out), "--no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and "rounds" in r.stdout
    for rank in range(4):
        own = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=rank, epoch=1)
        stored = HybridBatchSampler(SAMPLES, MODEL, LAYOUT, seed=7, rank=rank, epoch=1, plan=out)
        assert refs(stored) == refs(own)
    r = subprocess.run([sys.executable, "-m", "balancer", "inspect", str(out), "--json",
                        str(tmp_path / "i.json")], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "i.json").read_text())
    plan, _ = load_hybrid_plan(out, 1)
    e1 = rep["epochs"][1]
    assert e1["rounds"] == plan.n_rounds and e1["steps"] == plan.n_steps
    assert e1["tokens"] == int(SAMPLES.total_tokens) and e1["documents_cut"] == 0
    assert sum(e1["group_sizes"].values()) == plan.group_size.shape[0]
