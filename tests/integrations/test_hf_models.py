"""transformers models on a packed microbatch: per-document logits, loss and gradients equal the
unpacked reference for every HF route (positions + use_cache=False, additive float mask,
FlexAttention BlockMask) with the model's defaults; known-wrong inputs are refused."""
import numpy as np
import pytest
import torch

from integration_helpers import need  # noqa: E402

transformers = need("transformers")

from balancer.loader.adapters import hf_flattening  # noqa: E402
from balancer.loader.collate import FetchedMicrobatch, PackedCollator  # noqa: E402
from balancer.integrations import hf  # noqa: E402
from integration_helpers import VOCAB, doc_loss_sum, tiny_llama  # noqa: E402

LENGTHS = (13, 1, 7, 30, 2, 19)
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def route_tol(attn, dtype):
    """transformers' eager attention computes the softmax in float32 whatever the model's dtype
    (``softmax(..., dtype=torch.float32).to(query.dtype)`` in modeling_llama), so a float64
    eager model is float32-exact: packed and alone differ by ~1e-8 there from rounding alone."""
    return TOL[torch.float32] if attn == "eager" else TOL[dtype]


def _docs():
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, n) for n in LENGTHS]


def _batch(docs):
    return PackedCollator()(FetchedMicrobatch(list(range(len(docs))), docs))


def packed_loss(logits, labels):
    """Token-sum next-token cross entropy of a packed row (HF label convention) in float64,
    divided by its labelled tokens."""
    lab = labels[0, 1:]
    return torch.nn.functional.cross_entropy(logits[0, :-1].to(torch.float64), lab,
                                             ignore_index=-100, reduction="sum") / (lab >= 0).sum()


def _compare(model, inputs, docs, dtype, grads=True):
    """(max |logit diff|, |loss diff|, max |grad diff|, |HF loss diff|) of the packed call against
    every document run alone. The loss is computed from the logits in float64 (transformers'
    own loss upcasts the logits to float32 only, so it is compared separately)."""
    out = model(**inputs)
    labelled = sum(len(d) - 1 for d in docs)
    with torch.no_grad():
        ref_logits = torch.cat([model(input_ids=torch.as_tensor(d)[None], use_cache=False)
                                .logits[0] for d in docs])
    dl = float((out.logits[0].detach() - ref_logits).abs().max())
    if not grads:
        return dl, None, None, None
    loss = packed_loss(out.logits, inputs["labels"])
    model.zero_grad()
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref_loss = sum(doc_loss_sum(model, d) for d in docs) / labelled
    ref_loss.backward()
    dg = max(float((packed[n] - p.grad).abs().max()) for n, p in model.named_parameters())
    return dl, abs(float(loss) - float(ref_loss)), dg, abs(float(out.loss) - float(ref_loss))


ROUTES = [(attn, mask, dtype)  # every (attn implementation, mask route, dtype)
          for attn in ("sdpa", "eager") for mask in ("positions", "additive")
          for dtype in (torch.float64, torch.float32)]


@pytest.mark.parametrize("attn,mask,dtype", ROUTES)
def test_route_equals_unpacked_reference(attn, mask, dtype):
    docs = _docs()
    model = tiny_llama(attn, dtype)
    assert model.config.use_cache  # the model's default: the case that used to leak
    inputs = hf.model_inputs(_batch(docs), model, mask=mask)
    dl, dloss, dg, dhf = _compare(model, inputs, docs, dtype)
    tol = route_tol(attn, dtype)
    assert dl <= tol and dloss <= tol and dg <= tol, (attn, mask, dtype, dl, dloss, dg)
    assert dhf <= 1e-5, dhf  # transformers' loss (float32 inside)
    print(f"{attn} {mask} {dtype}: logits {dl:.1e} loss {dloss:.1e} grad {dg:.1e} hf-loss {dhf:.1e}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_without_use_cache_false_the_model_leaks(attn):
    """The bug of issue #14: the DataCollatorWithFlattening keys without ``use_cache=False``
    (the model's default ``use_cache=True``) attend across documents; check_inputs refuses it."""
    docs = _docs()
    model = tiny_llama(attn, torch.float64)
    leaky = {k: v for k, v in hf_flattening(_batch(docs)).items() if k != "use_cache"}
    dl, _, _, _ = _compare(model, leaky, docs, torch.float64, grads=False)
    assert dl > 1e-2, dl
    with pytest.raises(ValueError, match="use_cache"):
        hf.check_inputs(model, leaky)


def test_hf_flattening_alone_is_exact_with_model_defaults():
    """The DataCollatorWithFlattening keys as they are: transformers used to build a cache with
    the default use_cache=True and leak across documents (logits off by ~0.3)."""
    docs = _docs()
    model = tiny_llama("sdpa", torch.float64)
    inputs = hf_flattening(_batch(docs))
    assert inputs["use_cache"] is False
    dl, dloss, dg, _ = _compare(model, inputs, docs, torch.float64)
    assert max(dl, dloss, dg) <= 1e-10, (dl, dloss, dg)


@pytest.fixture
def uncompiled_flex(monkeypatch):
    """transformers compiles flex_attention with inductor (40-50 s per mask on a CPU); run
    torch's own uncompiled flex_attention instead: the same masks (transformers' BlockMask from
    position_ids, or ours), the reference math."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers.integrations import flex_attention as fa
    monkeypatch.setattr(fa.WrappedFlexAttention, "__init__", lambda self, training: None)
    monkeypatch.setattr(fa.WrappedFlexAttention, "__call__", lambda self: flex_attention)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask", ["positions", "block"])
def test_flex_attention_forward(uncompiled_flex, mask, dtype):
    """attn_implementation="flex_attention": logits and loss (torch 2.13 has no FlexAttention
    backward on CPU: "FlexAttention does not support backward on CPU", so the gradient is not
    compared here); the reference runs every document alone with sdpa and the same weights."""
    docs = _docs()
    model = tiny_llama("flex_attention", dtype)
    with torch.no_grad():
        inputs = hf.model_inputs(_batch(docs), model, mask=mask)
        out = model(**inputs).logits
        loss = packed_loss(out, inputs["labels"])
        model.set_attn_implementation("sdpa")
        ref = torch.cat([model(input_ids=torch.as_tensor(d)[None], use_cache=False).logits[0]
                         for d in docs])
        ref_loss = sum(doc_loss_sum(model, d) for d in docs) / sum(len(d) - 1 for d in docs)
    dl = float((out[0] - ref).abs().max())
    dloss = abs(float(loss) - float(ref_loss))
    assert dl <= TOL[dtype] and dloss <= TOL[dtype], (dl, dloss)
    print(f"flex_attention {mask} {dtype} forward: logits {dl:.1e} loss {dloss:.1e}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sdpa_boolean_keep_mask_is_exact(dtype):
    """check_inputs lets a 4D boolean mask through for sdpa only (True = attend there): it is
    exact, logits, loss and gradients."""
    docs = _docs()
    model = tiny_llama("sdpa", dtype)
    b = _batch(docs)
    inputs = {**hf_flattening(b), "attention_mask": hf.additive_mask(b, dtype) == 0}
    hf.check_inputs(model, inputs)
    dl, dloss, dg, _ = _compare(model, inputs, docs, dtype)
    assert max(dl, dloss, dg) <= TOL[dtype], (dl, dloss, dg)
    print(f"sdpa bool-4D {dtype}: logits {dl:.1e} loss {dloss:.1e} grad {dg:.1e}")


def test_refusals():
    docs = _docs()
    b = _batch(docs)
    eager, sdpa = tiny_llama("eager", torch.float32), tiny_llama("sdpa", torch.float32)
    leaky = {k: v for k, v in hf_flattening(b).items() if k != "use_cache"}
    with pytest.raises(ValueError, match="use_cache"):
        hf.check_inputs(sdpa, leaky)
    bool_mask = hf.additive_mask(b, torch.float32) == 0
    with pytest.raises(ValueError, match="boolean"):
        hf.check_inputs(eager, {**leaky, "attention_mask": bool_mask})
    hf.check_inputs(sdpa, {**leaky, "attention_mask": bool_mask})  # sdpa reads bool as keep
    with pytest.raises(ValueError, match="dtype"):
        hf.check_inputs(sdpa, {**leaky, "attention_mask": hf.additive_mask(b, torch.float64)})
    with pytest.raises(ValueError, match="2D attention_mask"):
        hf.check_inputs(sdpa, {**leaky, "use_cache": False,
                               "attention_mask": torch.ones_like(leaky["input_ids"])})
    with pytest.raises(ValueError, match="BlockMask"):
        hf.check_inputs(sdpa, {**leaky, "attention_mask": hf.block_mask(b)})
    with pytest.raises(ValueError, match="mask must be"):
        hf.model_inputs(b, sdpa, mask="bool")
    with torch.no_grad():  # the refused boolean mask is indeed wrong for eager
        wrong = eager(**{**leaky, "attention_mask": bool_mask}).logits
        right = eager(**hf.model_inputs(b, eager, mask="additive")).logits
    assert float((wrong - right).abs().max()) > 1e-3


def test_single_document_and_cp_refusal():
    docs = _docs()[:1]
    model = tiny_llama("sdpa", torch.float64)
    dl, dloss, dg, _ = _compare(model, hf.model_inputs(_batch(docs), model), docs,
                                torch.float64)
    assert max(dl, dloss, dg) <= 1e-10
    b = dict(_batch(_docs()), cp=2)
    with pytest.raises(ValueError, match="cp == 1"):
        hf.additive_mask(b, torch.float32)
