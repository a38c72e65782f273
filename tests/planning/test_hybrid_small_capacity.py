"""The hybrid mode at the smallest rank capacity (issue 30 item 7): with ``rank_capacity=1`` a
CP group of two or more ranks holds no document (a zigzag shard is two chunks per rank), but a
single rank holds a 1-token document, so the pool's limit is 1 token, not 0 (before: every
1-token document was refused as over "the pool's limit of 0 tokens", and with
``over_length="chunk"`` the cut into 0-token pieces failed as "sample 0: length 0"). A longer
document is refused naming it and the 1-token limit, or cut into 1-token pieces; a fixed CP
degree whose groups hold nothing is refused naming the degree and the capacity."""
import numpy as np
import pytest

from balancer import Layout, SampleTable
from balancer.cost.cp import CPCostModel, CPHardware
from balancer.cost.model import CostModel, ModelSpec
from balancer.planning.hybrid import HYBRID_STRATEGIES, plan_fixed_cp, plan_hybrid_epoch
from packing.hybrid_cp import check_plan

SPEC = ModelSpec(hidden=256, layers=4, heads=4, kv_heads=2, ffn=688, vocab=1000)


def model(cap):
    cost = CostModel.from_model(SPEC, name="tiny", flops_per_second=1e12)
    return CPCostModel(cost=cost, spec=SPEC, rank_capacity=cap, hardware=CPHardware())


def trained(plan, n):
    return np.bincount(plan.item_doc, weights=plan.item_length, minlength=n).astype(np.int64)


@pytest.mark.parametrize("strategy", HYBRID_STRATEGIES)
@pytest.mark.parametrize("over_length", ["error", "chunk"])
def test_one_token_documents_fit_a_rank_of_capacity_one(strategy, over_length):
    m = model(1)
    lengths = np.ones(9, np.int64)
    plan = plan_hybrid_epoch(lengths, m, 4, 8, strategy=strategy, over_length=over_length)
    check_plan(plan)
    assert np.array_equal(trained(plan, 9), lengths)
    assert plan.documents_cut == 0


@pytest.mark.parametrize("strategy", HYBRID_STRATEGIES)
def test_longer_documents_at_capacity_one_are_named_or_cut(strategy):
    m = model(1)
    lengths = np.array([1, 1, 3, 1], np.int64)
    with pytest.raises(ValueError) as e:
        plan_hybrid_epoch(lengths, m, 4, 4, strategy=strategy)
    msg = str(e.value)
    assert msg.startswith("sample 2: length 3 exceeds the pool's limit of 1 tokens") and \
        "length 0" not in msg and "\n" not in msg, msg
    plan = plan_hybrid_epoch(lengths, m, 4, 4, strategy=strategy, over_length="chunk")
    check_plan(plan)
    assert np.array_equal(trained(plan, 4), lengths)
    if strategy != "megatron_hybrid":  # Megatron's rule bounds only L / degree per rank
        assert plan.documents_cut == 1 and plan.item_length.max() == 1


def test_a_fixed_degree_holding_nothing_is_refused():
    m = model(1)
    with pytest.raises(ValueError, match=r"^cp 2 holds no document at rank_capacity 1"):
        plan_fixed_cp(np.ones(3, np.int64), m, 4, 2)
    plan = plan_fixed_cp(np.array([1, 2, 1], np.int64), m, 4, 1)  # degree 1 still cuts to 1
    check_plan(plan)
    assert plan.documents_cut == 1


def test_the_sampler_trains_one_token_documents_at_capacity_one():
    from balancer.loader.hybrid import HybridBatchSampler
    lay = Layout(dp=2, cp=2, microbatches=1, capacity=2, cp_mode="hybrid", rank_capacity=1)
    s = HybridBatchSampler(SampleTable(np.ones(6, np.int64)), model(1), lay, rank=0)
    assert len(s) >= 1


def test_cli_at_capacity_one(tmp_path, capsys):
    """``precompute`` and ``report --cp-mode hybrid`` at ``--rank-capacity 1``: the report
    leaves out the fixed degrees that hold nothing unless named (then refused by name)."""
    import json

    from balancer import cli
    f = tmp_path / "l.npy"
    np.save(f, np.ones(40, np.int64))
    base = ["--cp-mode", "hybrid", "--lengths", str(f), "--dp", "2", "--cp", "2",
            "--rank-capacity", "1", "--cost-model", "llama-7b"]
    assert cli.main(["precompute", *base, "--out", str(tmp_path / "p")]) == 0
    assert cli.main(["report", *base, "--no-plots", "--out", str(tmp_path / "r")]) == 0
    names = json.loads((tmp_path / "r" / "report.json").read_text())["strategies"]
    assert "fixed_cp1" in names and "fixed_cp2" not in names and "hybrid_stream" in names
    capsys.readouterr()
    assert cli.main(["report", *base, "--no-plots", "--strategies", "fixed_cp2",
                     "--out", str(tmp_path / "r2")]) == 2
    assert "cp 2 holds no document at rank_capacity 1" in capsys.readouterr().err
