import numpy as np
import pytest
import torch

from balancer.cost.model import (CostModel, ModelSpec, analytic_training_flops, available_presets,
    load_cost_model)


def _llama_params_on_meta(spec: ModelSpec) -> int:
    """Count matmul parameters of an equivalent torch model built on the meta device."""
    h, hd = spec.hidden, spec.hd
    kv = spec.kv_heads or spec.heads
    with torch.device("meta"):
        layer = torch.nn.ModuleDict({
            "q": torch.nn.Linear(h, spec.heads * hd, bias=False),
            "k": torch.nn.Linear(h, kv * hd, bias=False),
            "v": torch.nn.Linear(h, kv * hd, bias=False),
            "o": torch.nn.Linear(spec.heads * hd, h, bias=False),
            "gate": torch.nn.Linear(h, spec.ffn, bias=False),
            "up": torch.nn.Linear(h, spec.ffn, bias=False),
            "down": torch.nn.Linear(spec.ffn, h, bias=False),
        })
        head = torch.nn.Linear(h, spec.vocab, bias=False)
    return spec.layers * sum(p.numel() for p in layer.parameters()) + head.weight.numel()


@pytest.mark.parametrize("preset", ["llama-7b", "llama-70b", "llama3-8b-gqa"])
def test_analytic_flops_match_6NT_plus_attention(preset):
    cost = load_cost_model(preset)
    import yaml
    from balancer.cost.model import config_dir
    spec = ModelSpec(**yaml.safe_load(open(config_dir() / "models" / f"{preset}.yaml"))["model"])
    n_params = _llama_params_on_meta(spec)
    lengths = np.array([512, 4096, 32768, 100])
    # standard count: 6 N T for the matmuls + causal attention forward (4 L^2 heads hd / 2 per
    # layer) with backward 2.5x forward
    att_fwd = sum(spec.layers * 4 * spec.heads * spec.hd * L * L / 2 for L in lengths)
    standard = 6 * n_params * lengths.sum() + 3.5 * att_fwd
    f, b = cost.doc_costs(lengths)
    ours = (f + b).sum() - (f.sum() if cost.recompute else 0.0)
    assert abs(ours - standard) / standard < 0.01
    assert abs(analytic_training_flops(spec, lengths) - standard) / standard < 0.01


def test_backward_ratios_differ_between_linear_and_attention():
    c = load_cost_model("llama-7b")
    assert c.backward.b / c.forward.b == pytest.approx(2.0)
    assert c.backward.a / c.forward.a == pytest.approx(2.5)


def test_quadratic_builtin():
    c = load_cost_model("quadratic-64k")
    f, b = c.doc_costs(np.array([65536, 1]))
    assert f[0] == pytest.approx(65536 * 2)
    assert np.allclose(b, 2 * f)


def test_recompute_adds_a_forward():
    spec = ModelSpec(hidden=256, layers=2, heads=4, ffn=1024, vocab=1000)
    a = CostModel.from_model(spec)
    r = CostModel.from_model(spec, recompute=True)
    L = np.array([100, 2000])
    assert np.allclose(r.doc_costs(L)[1], a.doc_costs(L)[1] + a.doc_costs(L)[0])
    assert r.capacity() > a.capacity()


def test_capacity_scales_with_cp_and_pp():
    c = load_cost_model("llama-7b")
    assert c.capacity(cp=2) == 2 * c.capacity()
    assert c.capacity(pp=4) > 3 * c.capacity()


def test_presets_and_unknown_keys(tmp_path):
    assert {"quadratic-64k", "llama-7b", "llama-70b", "llama3-8b-gqa"} <= set(available_presets())
    bad = tmp_path / "x.yaml"
    bad.write_text("forward: {a: 1, b: 2}\nbackward: {a: 1, b: 2, e: 3}\n")
    with pytest.raises(ValueError, match="e"):
        load_cost_model(str(bad))
    with pytest.raises(ValueError, match="unknown cost model"):
        load_cost_model("nope")
    with pytest.raises(ValueError, match="kv_heads"):
        ModelSpec(hidden=64, layers=1, heads=6, kv_heads=4, ffn=128, vocab=10)


@pytest.mark.parametrize("scale, ratio, shown", [(0, 2.0, "scale 0"), (float("inf"), 2.0,
                                                 "scale inf"), (float("nan"), 2.0, "scale nan"),
                                                (-4, 2.0, "scale -4"), (True, 2.0, "scale True"),
                                                (4096, float("nan"), "backward_ratio nan"),
                                                (4096, -1.0, "backward_ratio -1.0")])
def test_quadratic_refuses_what_is_not_a_scale(scale, ratio, shown):
    """CostModel.quadratic(0) was a ZeroDivisionError, (inf) an all-linear model named
    'quadratic-nank', (nan) a pydantic error about a coefficient: one line naming the input."""
    with pytest.raises(ValueError, match=rf"^CostModel.quadratic: {shown} ") as e:
        CostModel.quadratic(scale, ratio)
    assert "\n" not in str(e.value)
    assert CostModel.quadratic(4096.0).name == CostModel.quadratic(4096).name == "quadratic-4k"
