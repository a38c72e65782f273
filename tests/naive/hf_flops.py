"""Forward FLOPs of tiny Hugging Face models counted by torch's FlopCounterMode (issue #25,
item 2): the reference the config cost model is checked against.

FlopCounterMode counts every matrix multiply, convolution and attention call as the dense op it
is; an attention kernel that skips masked blocks (flash / flex attention) does fewer FLOPs than
the dense count, and CPU has no such kernel to count. So the attention core is counted by its
mask instead: a registered attention implementation ``count`` records, for every layer, the
query-key pairs the mask transformers builds for that layer allows (sliding window, chunked,
document boundaries of the packed batch from its position_ids), and returns zeros without
computing (FLOP counts do not depend on the values). The measured forward FLOPs are the
counter's total (projections, MLP / experts, router, LM head, linear-attention kernels) plus
``2 heads (d_qk + d_v)`` per allowed pair."""
from __future__ import annotations

import os

# no Hub kernels (causal_conv1d, fla, ...): the torch reference implementations are what
# this counts
os.environ.setdefault("USE_HUB_KERNELS", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from transformers import AttentionInterface, AutoModelForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

_ROWS = 1024  # query rows of the mask evaluated at once (bounds the memory at 16K tokens)


class PairCount:
    """The 'mask' the count implementation passes on: allowed query-key pairs of one batch."""

    def __init__(self, pairs: int):
        self.pairs = pairs


def _count_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                mask_function=None, attention_mask=None, **_):
    assert attention_mask is None or bool(attention_mask.all()), "no padding in these tests"
    total = 0
    for lo in range(0, q_length, _ROWS):
        q = torch.arange(lo, min(q_length, lo + _ROWS)) + q_offset
        # keys from the first row's document start on: every mask here is causal within a
        # document (what is left out is outside the document, so never allowed)
        first = int(_START[q[0]]) if q_offset == 0 and kv_offset == 0 else 0
        kv = torch.arange(first, min(kv_length, int(q[-1]) + 1)) + kv_offset
        m = mask_function(torch.arange(batch_size)[:, None, None, None],
                          torch.zeros(1, dtype=torch.long)[None, :, None, None],
                          q[None, None, :, None], kv[None, None, None, :])
        # the documents of the packed batch: transformers ANDs them in from the position ids
        # for most models; GPT-OSS (5.x) builds its masks without them, so they are ANDed
        # here too (packed training runs varlen kernels, which never cross documents)
        same = _DOC[q][:, None] == _DOC[kv][None, :]
        total += int((m & same[None, None]).expand(batch_size, 1, q.shape[0], kv.shape[0]).sum())
    return PairCount(total)


_CALLS: list = []
_DOC = torch.zeros(0, dtype=torch.long)  # document index of every token of the packed batch
_START = torch.zeros(0, dtype=torch.long)  # first token of every token's document


def _count_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """query float[b, H, q, d_qk], value float[b, H_kv, k, d_v]: records the layer's core
    FLOPs and returns a zero output float[b, q, H, d_v]."""
    b, heads, q, dqk = query.shape
    dv = value.shape[-1]
    _CALLS.append(2 * heads * (dqk + dv) * attention_mask.pairs)
    return query.new_zeros(b, q, heads, dv), None


AttentionInterface.register("count", _count_attention)
AttentionMaskInterface.register("count", _count_mask)


def build(config: dict):
    """A tiny random model of this config dict (float32, eval mode, CPU)."""
    cfg = dict(config)
    mt = cfg.pop("model_type")
    hf = CONFIG_MAPPING[mt](**cfg)
    hf._attn_implementation = "count"
    torch.manual_seed(0)
    # eager experts: a loop over the experts hit, each a counted matmul (the grouped / batched
    # kernels are not counted, or compute every expert)
    model = AutoModelForCausalLM.from_config(hf, attn_implementation="count",
                                             experts_implementation="eager")
    # no parameter needs a gradient: FlopCounterMode's module tracker hooks fail on the
    # hub-kernel wrapped modules (Qwen3-Next's) when parameters require grad under no_grad
    return model.eval().requires_grad_(False)


def forward_flops(model, lengths) -> tuple[int, int]:
    """``(FlopCounterMode's count, attention-core FLOPs of the allowed pairs)`` of one forward
    pass over the documents ``lengths`` packed into one sequence (position ids restart at 0
    at every document, which is how transformers finds the document boundaries)."""
    lengths = [int(x) for x in lengths]
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    global _DOC, _START
    _DOC = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)
    _START = starts[_DOC]
    _CALLS.clear()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    return int(fc.get_total_flops()), int(sum(_CALLS))
