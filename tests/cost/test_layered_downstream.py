"""Issue #25 item 3: everything downstream of the cost model uses its per-layer attention:
the hybrid-CP cost table (busiest zigzag rank, K/V exchange under a window), the report's CP
imbalance, calibration per layer type and the multimodal LLM phase."""
import json

import numpy as np
import pytest
import yaml

from balancer import Layout, PlannerConfig, SampleTable
from balancer.cost import calibration
from balancer.cost.attention import AttentionTerm, busiest_share, doc_pairs, zigzag_pairs
from balancer.cost.cp import CPCostModel
from balancer.cost.model import CostModel, PassCost, load_cost_model
from balancer.planning.planner import plan_epoch
from balancer.report.metrics import cp_imbalance
from balancer.zigzag import zigzag_attention

MISTRAL = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}


def test_busiest_share_is_the_max_over_ranks_of_the_weighted_pairs():
    lengths = np.array([1, 5, 64, 100, 1000, 4097], dtype=np.int64)
    sizes = np.array([1, 2, 4, 8], dtype=np.int64)
    weighted = [("full", None, 3.0), ("sliding", 50, 7.0), ("chunked", 33, 1.0)]
    got = busiest_share(lengths, sizes, weighted)
    total = sum(w * doc_pairs(lengths, k, win) for k, win, w in weighted)
    for j, g in enumerate(sizes.tolist()):
        per_rank = sum(w * zigzag_pairs(lengths, g, k, win) for k, win, w in weighted)
        np.testing.assert_allclose(got[:, j], per_rank.max(axis=1) / total, rtol=1e-12)


def test_cp_table_of_a_sliding_window_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MISTRAL))
    m = CPCostModel.from_preset(str(tmp_path / "config.json"), 65536)
    assert [(k.kind, k.window, k.layers, k.values) for k in m.kv_layers] == \
        [("sliding", 4096, 32, 2 * 8 * 128)]
    assert m.model_dump(mode="json")["kv_layers"]
    assert CPCostModel.model_validate(m.model_dump(mode="json")) == m
    L = np.array([100_000], dtype=np.int64)
    t = m.table(L, 8)
    # every chunk of 100K / 16 tokens sees at most 4096 keys per query: the busiest rank does
    # about 1/8 of the work, against the full-attention zigzag's balanced 1/8 + the ramp
    e = m.exchange_parts(L, 8)
    hw = m.hardware
    for j, g in enumerate(t.sizes.tolist()[1:], start=1):
        bw = hw.intra_node_bandwidth
        cap = 2 * 4095 * 2 * 8 * 128 * 32 * hw.kv_bytes / bw  # two chunks' window of keys
        assert e.bytes_s[0, j] == pytest.approx(cap, rel=1e-12)
    full = CPCostModel.from_preset("llama3-8b-gqa", 65536)  # the same K/V heads, full attention
    ef = full.exchange_parts(L, 8)
    assert (ef.bytes_s[0, 1:] > 5 * e.bytes_s[0, 1:]).all()  # a window limits the K/V


def test_linear_attention_layers_exchange_no_kv():
    m = CPCostModel.from_preset("qwen3-next-80b-a3b", 65536)
    assert [(k.kind, k.layers) for k in m.kv_layers] == [("full", 12)]  # of 48 layers
    assert m.kv_bytes_per_token() == 12 * 2 * 2 * 256 * m.hardware.kv_bytes


def test_legacy_presets_keep_their_cp_model():
    m = CPCostModel.from_preset("llama-7b", 4096)
    assert m.kv_layers == () and "kv_layers" not in m.model_dump()


def test_report_cp_imbalance_uses_the_layer_types():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1000, 30000, 200)
    cost = CostModel(forward=PassCost(b=1.0), backward=PassCost(b=2.0),
                     attention=(AttentionTerm(kind="sliding", window=256, forward=1.0,
                                              backward=2.5),))
    plan = plan_epoch(SampleTable(lengths), cost, Layout(dp=2, cp=4, microbatches=2,
                                                          capacity=65536), PlannerConfig())
    work = 3.5 * zigzag_pairs(plan.entry_length, 4, "sliding", 256)
    per_mb = np.add.reduceat(work, plan.mb_offsets[:-1], axis=0)
    want = per_mb.max(axis=1) / per_mb.mean(axis=1)
    np.testing.assert_allclose(cp_imbalance(plan, cost), want, rtol=1e-12)
    full = np.add.reduceat(zigzag_attention(plan.entry_length, 4), plan.mb_offsets[:-1], axis=0)
    np.testing.assert_allclose(cp_imbalance(plan), full.max(axis=1) / full.mean(axis=1))
    assert not np.allclose(cp_imbalance(plan, cost), cp_imbalance(plan))


def test_calibration_fits_per_layer_type_coefficients():
    truth = CostModel(name="t", unit="seconds", forward=PassCost(b=2e-6, c=1e-3, d=5e-5),
                      backward=PassCost(b=4e-6, c=2e-3, d=1e-4),
                      attention=(AttentionTerm(kind="full", forward=3e-9, backward=7e-9),
                                 AttentionTerm(kind="sliding", window=512, forward=9e-9,
                                               backward=2e-8)))
    rng = np.random.default_rng(1)
    shapes = calibration.sample_shapes(60, 16384, rng, 8)
    lens, off = calibration.to_csr(shapes)
    from balancer.cost.blocks import microbatch_costs
    f, b = microbatch_costs(truth, lens, off)
    obs = calibration.Observations(lens, off, {"forward": f, "backward": b})
    template = truth.model_copy(update={"attention": tuple(
        t.model_copy(update={"forward": 1.0, "backward": 1.0}) for t in truth.attention)})
    model, q = calibration.calibrate_layered(obs, template, held_out=obs)
    for got, want in zip(model.attention, truth.attention):
        assert (got.kind, got.window) == (want.kind, want.window)
        assert got.forward == pytest.approx(want.forward, rel=1e-6)
        assert got.backward == pytest.approx(want.backward, rel=1e-6)
    assert model.forward.b == pytest.approx(2e-6, rel=1e-6)
    assert q["held_out"]["total"]["rel_error"]["max"] < 1e-6
    with pytest.raises(ValueError, match="no attention terms per layer type"):
        calibration.calibrate_layered(obs, load_cost_model("llama-7b"))


def test_multimodal_llm_from_a_hf_config(tmp_path):
    from balancer import resources
    from balancer.multimodal.cost import load_mm_cost_model
    doc = yaml.safe_load((resources.packaged("configs") / "multimodal" / "llava-7b.yaml")
                         .read_text())
    doc["llm"] = {"hf_config": "mistral.json", "flops_per_second": 4e14}
    (tmp_path / "mistral.json").write_text(json.dumps(MISTRAL))
    (tmp_path / "mm.yaml").write_text(yaml.safe_dump(doc))
    mm = load_mm_cost_model(str(tmp_path / "mm.yaml"))
    (t,) = mm.llm.attention
    assert (t.kind, t.window) == ("sliding", 4096)
    f, _ = mm.llm.doc_costs(np.array([10_000]))
    assert f[0] == pytest.approx(mm.llm.forward.b * 1e4 + t.forward * doc_pairs(
        np.array([10_000]), "sliding", 4096)[0])
