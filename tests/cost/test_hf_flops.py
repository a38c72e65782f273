"""Issue #25 item 2: the config cost model's forward FLOPs equal what a tiny instance of each
architecture family computes, counted by torch's FlopCounterMode (tests/naive/hf_flops.py: the
attention core counted by the pairs its mask allows), for packed batches of documents of 16 to
16K tokens. Exact, not within 2%: every term of the formula is the same integer product."""
import warnings

import numpy as np
import pytest

pytest.importorskip("transformers")

from balancer.cost.model import cost_model_from_config  # noqa: E402

_BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, vocab_size=128)
FAMILIES = {
    "llama": dict(model_type="llama", **_BASE),
    "mistral": dict(model_type="mistral", sliding_window=32, **_BASE),
    "gemma3_text": dict(model_type="gemma3_text", sliding_window=32,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"], **_BASE),
    "gpt_oss": dict(model_type="gpt_oss", sliding_window=32, num_local_experts=4,
                    num_experts_per_tok=2, **_BASE),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, **_BASE),
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **_BASE),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, shared_expert_intermediate_size=64, **_BASE),
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                        vocab_size=128, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
    "llama4_text": dict(model_type="llama4_text", attention_chunk_size=32, num_local_experts=4,
                        num_experts_per_tok=1, intermediate_size_mlp=128,
                        interleave_moe_layer_step=2, **_BASE),
    "qwen3_next": dict(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=48, shared_expert_intermediate_size=64,
                       linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, **_BASE),
}


def _dense_expert_excess(cfg: dict, tokens: int) -> float:
    """Llama 4's transformers implementation runs every expert on every token (the router
    scores zero the unused ones), FLOPs a real MoE kernel does not do: by formula, the
    ``E - k`` unused experts' 3 matrices on every token of every MoE layer."""
    n_moe = cfg["num_hidden_layers"] // cfg["interleave_moe_layer_step"]
    unused = cfg["num_local_experts"] - cfg["num_experts_per_tok"]
    return 2.0 * 3 * cfg["hidden_size"] * cfg["intermediate_size"] * unused * n_moe * tokens


def _gdn_reference_excess(cfg: dict, tokens: int) -> float:
    """Qwen3-Next's Gated DeltaNet layers as transformers' CPU reference runs them, against the
    cost model's chunked delta rule, by formula: (1) its two triangular solves (the UT
    transform, ``2 C^2 (d_k + d_v)`` per chunk and head in a kernel) are
    ``torch.linalg.solve_triangular``, which FlopCounterMode does not count; (2) it runs the
    packed batch as one sequence padded to a multiple of the chunk (64), so the counted work
    is ``(4 C d_k + 2 C d_v + 6 d_k d_v)`` per head per padded token; (3) its causal
    convolution computes ``kernel - 1`` extra positions."""
    c, dk, dv = 64, cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    hv, hk, k = cfg["linear_num_value_heads"], cfg["linear_num_key_heads"], \
        cfg["linear_conv_kernel_dim"]
    n_lin = cfg["num_hidden_layers"] - cfg["num_hidden_layers"] // 4
    padded = -(-tokens // c) * c
    counted = hv * (4 * c * dk + 2 * c * dv + 6 * dk * dv) * padded
    modelled = hv * 2.0 * (3 * c * dk + 2 * c * dv + 3 * dk * dv) * tokens
    conv = 2.0 * (2 * hk * dk + hv * dv) * k * (k - 1)
    return n_lin * (counted - modelled + conv)


def _check(family: str, lengths_list):
    from tests.naive.hf_flops import build, forward_flops  # torch + transformers, when run
    cfg = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cost = cost_model_from_config(cfg)
    model = build(cfg)
    for L in lengths_list:
        docs = np.array([L, max(16, L // 3), 16], dtype=np.int64)
        counted, core = forward_flops(model, docs)
        fwd, _ = cost.doc_costs(docs)
        core_model = sum(t.forward * t.pairs(docs).sum() for t in cost.attention)
        assert core == core_model, (family, L)  # the pairs every layer's mask allows
        expected = float(fwd.sum())
        if family == "llama4_text":
            expected += _dense_expert_excess(cfg, int(docs.sum()))
        if family == "qwen3_next":
            expected += _gdn_reference_excess(cfg, int(docs.sum()))
        assert counted + core == pytest.approx(expected, rel=1e-12), (family, L)


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_flops_match_flop_counter(family):
    _check(family, [16, 256, 4096])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "llama4_text", "qwen3_next"])
def test_forward_flops_match_at_16k(family):
    """Sliding/full mix, sliding + MoE, chunked + MoE, linear attention + MoE at 16K-token
    documents."""
    _check(family, [16384])
