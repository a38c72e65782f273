"""Shared pieces of the integration tests: a tiny random-init Llama, a small packed workload, the
unpacked per-document reference and exactly-once coverage of every token."""
import numpy as np
import torch

VOCAB = 64


def tiny_llama(attn="sdpa", dtype=torch.float64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(dtype)


def workload(n=48, seed=0):
    from balancer import CostModel, Layout, PlannerConfig, SampleTable
    from balancer.loader.collate import FlatTokens
    lengths = np.random.default_rng(seed).integers(1, 60, n)
    layout = Layout(dp=2, microbatches=2, capacity=128)
    return (SampleTable(lengths), CostModel.quadratic(4096), layout,
            PlannerConfig(seed=seed), FlatTokens.from_lengths(lengths, vocab=VOCAB, seed=seed + 1))


def doc_loss_sum(model, doc):
    """Summed next-token cross entropy of one document run alone (the unpacked reference)."""
    ids = torch.as_tensor(doc, dtype=torch.long)[None]
    logits = model(input_ids=ids, use_cache=False).logits[0]
    if ids.shape[1] < 2:
        return logits.sum() * 0
    return torch.nn.functional.cross_entropy(logits[:-1].to(torch.float64), ids[0, 1:],
                                             reduction="sum")


def reference_step_grads(model, dataset, samples, cost, layout, config, step=0):
    """Gradient of step ``step``'s loss (token sum over every DP rank's microbatches divided by
    the plan's step_loss_tokens), every document run alone, in one process."""
    from balancer import PackedBatchSampler
    model.zero_grad()
    total = None
    for r in range(layout.dp):
        s = PackedBatchSampler(samples, cost, layout, config, dp_rank=r)
        for pos in range(len(s)):
            ref = s.ref(pos)
            if ref.step != step:
                continue
            total = ref.step_loss_tokens
            for i, st, ln in zip(list(ref), ref.starts.tolist(), ref.lengths.tolist()):
                (doc_loss_sum(model, dataset[i][st:st + ln]) / total).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def coverage(pieces, lengths):
    """Times every token of every sample was trained, from (sample, start, length) pieces."""
    lengths = np.asarray(lengths)
    off = np.concatenate([[0], np.cumsum(lengths)])
    cover = np.zeros(int(off[-1]), np.int64)
    for s, a, n in pieces:
        cover[off[s] + a: off[s] + a + n] += 1
    return cover


def max_grad_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


#: set by .ci/run: a missing integration library fails the test instead of skipping it
REQUIRE_ENV = "BALANCER_REQUIRE_INTEGRATIONS"


def need(module: str):
    """``pytest.importorskip(module)``, except under ``BALANCER_REQUIRE_INTEGRATIONS=1`` (CI),
    where a missing library is an error naming the extra that installs it: CI must never pass
    by silently skipping the integration tests."""
    import importlib
    import os

    import pytest
    if os.environ.get(REQUIRE_ENV) == "1":
        try:
            return importlib.import_module(module)
        except ImportError as e:
            raise ImportError(f"{module} is required ({REQUIRE_ENV}=1): install the "
                              f"integrations extra, pip install -e '.[test,integrations]' "
                              f"({e})") from e
    return pytest.importorskip(module)
