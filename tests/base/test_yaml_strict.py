"""YAML configs are read strictly (issue #30 item 9): anchors and aliases are refused before
anything is expanded (an alias bomb in a --config value took 35 s and 2.6 GB before its
refusal), duplicate keys and a flat key that a section also gives are errors instead of the
last value silently winning, booleans are not numbers (``dp: true`` was 1), and a cost model
whose every coefficient is 0 is refused (its imbalance is NaN)."""
import time

import pytest

from balancer import CostModel, Layout, PassCost, PlannerConfig
from balancer.cli import main
from balancer.config import load_yaml


def _cli(capsys, *argv):
    rc = main(list(argv))
    return rc, capsys.readouterr().err


def _precompute(tmp_path, capsys, text):
    cfg = tmp_path / "job.yaml"
    cfg.write_text(text)
    return _cli(capsys, "precompute", "--config", str(cfg), "--lengths", "bimodal-sft",
                "--samples", "50", "--capacity", "8192", "--out", str(tmp_path / "plan"))


def bomb(levels: int) -> str:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_aliases_are_refused_before_expansion(tmp_path, capsys):
    t0 = time.process_time()
    rc, err = _precompute(tmp_path, capsys, bomb(9))   # 9**9 strings once expanded
    assert time.process_time() - t0 < 30   # refused unexpanded (was 35 s, 2.6 GB)
    assert rc == 2 and "job.yaml" in err and "alias" in err and "line 1" in err, err
    assert len(err.strip().splitlines()) == 1
    f = tmp_path / "anchor.yaml"
    f.write_text("base: &b {dp: 2}\nlayout: *b\n")
    with pytest.raises(ValueError, match=r"anchor.yaml.*(anchor|alias).*line 1"):
        load_yaml(f)


def test_duplicate_keys_are_refused(tmp_path, capsys):
    rc, err = _precompute(tmp_path, capsys, "dp: 2\nseed: 1\ndp: 4\n")
    assert rc == 2 and "job.yaml" in err and "duplicate key 'dp'" in err and "line 3" in err, err
    rc, err = _precompute(tmp_path, capsys, "layout:\n  dp: 2\n  dp: 4\n")
    assert rc == 2 and "duplicate key 'dp'" in err, err


def test_a_flat_key_and_a_section_key_conflict(tmp_path, capsys):
    rc, err = _precompute(tmp_path, capsys, "dp: 2\nlayout:\n  dp: 4\n")
    assert rc == 2 and "job.yaml" in err and "'dp'" in err and "layout" in err, err
    rc, err = _precompute(tmp_path, capsys, "layout:\n  seed: 1\nplanner:\n  seed: 2\n")
    assert rc == 2 and "'seed'" in err and "planner" in err, err


@pytest.mark.parametrize("text, key", [("dp: true\n", "dp"), ("seed: false\n", "seed"),
                                       ("layout:\n  microbatches: true\n", "microbatches"),
                                       ("epochs: true\n", "epochs")])
def test_booleans_are_not_numbers(tmp_path, capsys, text, key):
    rc, err = _precompute(tmp_path, capsys, text)
    assert rc == 2 and key in err and "boolean" in err, err


def test_booleans_are_not_numbers_in_the_api():
    with pytest.raises(ValueError, match="dp.*boolean"):
        Layout(dp=True, capacity=8192)
    with pytest.raises(ValueError, match="seed.*boolean"):
        PlannerConfig(seed=False)
    with pytest.raises(ValueError, match="b.*boolean"):
        PassCost(b=True)
    assert Layout(dp=2, capacity=8192).dp == 2 and PlannerConfig(seed=0).seed == 0


def test_an_all_zero_cost_model_is_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="every coefficient.*0"):
        CostModel(forward=PassCost(), backward=PassCost())
    CostModel(forward=PassCost(b=1.0), backward=PassCost())   # one positive term is enough
    f = tmp_path / "zero.yaml"
    f.write_text("name: zero\nforward: {a: 0, b: 0, c: 0}\nbackward: {a: 0.0}\n")
    rc, err = _cli(capsys, "compare", "--lengths", "bimodal-sft", "--samples", "50",
                   "--capacity", "8192", "--strategies", "sequential", "--cost-model", str(f))
    assert rc == 2 and "zero.yaml" in err and "every coefficient" in err, err
