"""Issue #25 item 1: cost models from a Hugging Face config.json, per layer type."""
import json
import warnings

import numpy as np
import pytest

from balancer.cost.attention import AttentionTerm, doc_pairs, prefix_pairs, zigzag_pairs
from balancer.cost.hf_config import arch_from_config
from balancer.cost.model import CostModel, cost_model_from_config, load_cost_model
from balancer.zigzag import zigzag_attention

MISTRAL = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": 4096}


def _brute_keys(L, kind, w):
    """keys[i] = the keys query i sees, by the masks' definitions."""
    i = np.arange(L)[:, None]
    j = np.arange(L)[None, :]
    m = j <= i
    if kind == "sliding":
        m &= j > i - w
    elif kind == "chunked":
        m &= (j // w) == (i // w)
    return m.sum(axis=1)


@pytest.mark.parametrize("kind,w", [("full", None), ("sliding", 1), ("sliding", 5),
                                    ("sliding", 64), ("chunked", 1), ("chunked", 7)])
def test_pair_counts_equal_the_masks(kind, w):
    for L in range(0, 40):
        keys = _brute_keys(L, kind, w)
        assert doc_pairs(np.array([L]), kind, w)[0] == keys.sum()
        for n in range(L + 1):
            assert prefix_pairs(np.array([n]), kind, w)[0] == keys[:n].sum()
    if kind == "sliding":  # the definition: sum_i min(i + 1, w)
        L = 1000
        assert doc_pairs(np.array([L]), kind, w)[0] == sum(min(i + 1, w) for i in range(L))


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("kind,w", [("full", None), ("sliding", 6), ("chunked", 5)])
def test_zigzag_pairs_equal_brute_force(cp, kind, w):
    lengths = np.array([1, 7, 8, 16, 33, 100], dtype=np.int64)
    got = zigzag_pairs(lengths, cp, kind, w)
    for k, L in enumerate(lengths.tolist()):
        keys = _brute_keys(L, kind, w)
        c = -(-L // (2 * cp))
        for r in range(cp):
            want = sum(keys[j * c:(j + 1) * c].sum() for j in (r, 2 * cp - 1 - r))
            assert got[k, r] == want
    np.testing.assert_array_equal(got.sum(axis=1), doc_pairs(lengths, kind, w))
    if kind == "full":
        np.testing.assert_array_equal(got, zigzag_attention(lengths, cp))


def test_config_json_loads_as_a_cost_model(tmp_path):
    d = tmp_path / "Mistral-7B"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MISTRAL))
    cost = load_cost_model(str(d / "config.json"))
    assert cost.name == f"mistral ({d})" and cost.unit == "flops"
    (t,) = cost.attention
    assert (t.kind, t.window, t.layers) == ("sliding", 4096, 32)
    assert t.forward == 32 * 2 * 32 * (128 + 128)  # layers x 2 heads (d_qk + d_v)
    # every matmul weight twice per token: q, k, v, o, gate/up/down, LM head
    h, kv = 4096, 8 * 128
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * 14336
    assert cost.forward.b == 2.0 * (32 * per_layer + h * 32000)
    assert cost.forward.a == 0 and cost.backward.b == 2 * cost.forward.b
    L = np.array([16, 4096, 20000])
    f, b = cost.doc_costs(L)
    pairs = np.array([16 * 17 / 2, 4096 * 4097 / 2, 4096 * 4097 / 2 + (20000 - 4096) * 4096])
    np.testing.assert_allclose(f, cost.forward.b * L + t.forward * pairs, rtol=1e-15)
    np.testing.assert_allclose(b, cost.backward.b * L + 2.5 * t.forward * pairs, rtol=1e-15)
    assert cost.capacity() > 0


def test_existing_presets_serialize_as_before():
    """No attention terms: the dump (manifests, plan hashes) has no new key."""
    for name in ("llama-7b", "quadratic-64k", "flexsp-gpt-7b"):
        cost = load_cost_model(name)
        assert "attention" not in cost.model_dump() and "attention" not in cost.model_dump_json()
    cost = cost_model_from_config(MISTRAL)
    back = CostModel.model_validate(cost.model_dump(mode="json"))
    assert back == cost


def test_mixed_layers_sum_per_kind():
    cfg = dict(MISTRAL, model_type="gemma3_text", sliding_window=512,
               layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4,
               num_hidden_layers=24)
    cost = cost_model_from_config(cfg)
    kinds = {(t.kind, t.window): t.layers for t in cost.attention}
    assert kinds == {("full", None): 4, ("sliding", 512): 20}


def test_moe_counts_active_and_shared_experts():
    cfg = {"model_type": "qwen2_moe", "hidden_size": 8, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10,
           "intermediate_size": 99, "num_experts": 6, "num_experts_per_tok": 2,
           "moe_intermediate_size": 5, "shared_expert_intermediate_size": 7}
    a = arch_from_config(cfg)
    attn = 8 * 8 + 2 * 8 * 4 + 8 * 8
    ffn = 8 * 6 + 2 * 3 * 8 * 5 + 3 * 8 * 7 + 8  # router, 2 experts, shared expert, its gate
    assert a.linear_flops == 2.0 * (attn + ffn + 8 * 10)


def test_unknown_model_type_and_layer_type_are_named():
    with pytest.raises(ValueError, match=r"model_type 'rwkv9' is not supported; supported: "
                                         r"\[.*'gpt_oss'.*'mistral'"):
        cost_model_from_config(dict(MISTRAL, model_type="rwkv9"))
    with pytest.raises(ValueError, match=r"layer_types\[1\] 'hyena' is not supported; "
                                         r"supported: \[.*'sliding_attention'"):
        cost_model_from_config(dict(MISTRAL, num_hidden_layers=2,
                                    layer_types=["full_attention", "hyena"]))
    with pytest.raises(ValueError, match="required field 'hidden_size' is missing"):
        cost_model_from_config({k: v for k, v in MISTRAL.items() if k != "hidden_size"})


def test_missing_defaulted_fields_are_named_in_a_warning():
    cfg = {k: v for k, v in MISTRAL.items() if k != "num_key_value_heads"}
    with pytest.warns(UserWarning, match=r"documented defaults used: num_key_value_heads=32"):
        cost_model_from_config(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cost_model_from_config(MISTRAL)  # nothing missing: no warning


def test_not_json_is_a_clear_error(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("model_type: llama\n")
    with pytest.raises(ValueError, match="not a JSON file"):
        load_cost_model(str(p))
    with pytest.raises(ValueError, match="no such file"):
        load_cost_model(str(tmp_path / "missing.json"))


def test_yaml_preset_with_hf_config(tmp_path):
    (tmp_path / "m.json").write_text(json.dumps(MISTRAL))
    (tmp_path / "a.yaml").write_text("source: test\nhf_config: m.json\nrecompute: true\n"
                                     "flops_per_second: 4.0e+14\n")
    (tmp_path / "b.yaml").write_text("hf_config: " + json.dumps(MISTRAL) + "\nrecompute: true\n"
                                     "flops_per_second: 4.0e+14\n")
    a, b = load_cost_model(str(tmp_path / "a.yaml")), load_cost_model(str(tmp_path / "b.yaml"))
    assert a.attention == b.attention and a.recompute and a.forward == b.forward
    (tmp_path / "c.yaml").write_text("hf_config: m.json\nbogus: 1\n")
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        load_cost_model(str(tmp_path / "c.yaml"))


def test_sliding_window_moves_the_busiest_cp_rank():
    """Zigzag balances full causal attention; under a window every chunk past the first does
    the same work, so the rank holding chunk 0 is the idlest: shard_costs says so."""
    full = CostModel(forward=__import__("balancer").PassCost(b=0.0),
                     backward=__import__("balancer").PassCost(b=0.0),
                     attention=(AttentionTerm(kind="full", forward=1.0, backward=2.0),))
    slid = full.model_copy(update={"attention": (
        AttentionTerm(kind="sliding", window=64, forward=1.0, backward=2.0),)})
    L = np.array([4096])
    _, fs = full.shard_costs(L, 4)
    _, ss = slid.shard_costs(L, 4)
    assert fs[0].max() - fs[0].min() <= 3 * 64  # zigzag: nearly equal
    assert ss[0].argmin() == 0 and ss[0, 0] < ss[0, 1]
    whole, _ = slid.shard_costs(L, 4)
    assert whole[0] == pytest.approx(ss[0].sum())
