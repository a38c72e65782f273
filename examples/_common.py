"""Shared by the examples (not an API): the versions they were tested with, a tiny random-init
Llama, a toy tokenized corpus, and the check that every token of every sample was trained
exactly once over all processes."""
import json

import numpy as np
import torch

from balancer.cli.args import at_least  # noqa: F401 (the examples' integer flags)

TESTED_WITH = ("torch 2.13.0 (CPU), transformers 5.24.0, accelerate 1.16.0, trl 1.16.0, "
               "megatron-core 0.16.1, datasets, numba; Python 3.11")
VOCAB = 128


def tiny_llama(dtype=torch.float32, attn="sdpa", seed=0):
    """A 2-layer random-init Llama (32 wide, GQA 4/2 heads): seconds on a CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).to(dtype)


def corpus(n=96, seed=0, max_len=160, completion_mask=False):
    """``lengths`` int64[n] and a tokenized ``datasets.Dataset`` with an ``input_ids`` column;
    with ``completion_mask`` also TRL's ``completion_mask`` (0 on a prompt of a third to a half
    of each sample, 1 on its completion: SFT trains the completion only)."""
    import datasets
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, max_len, n)
    ids = [rng.integers(0, VOCAB, int(k)).tolist() for k in lengths]
    cols = {"input_ids": ids}
    if completion_mask:
        prompt = [int(rng.integers(k // 3, k // 2 + 1)) for k in lengths.tolist()]
        cols["completion_mask"] = [[0] * p + [1] * (k - p) for p, k in zip(prompt, lengths.tolist())]
    return lengths, datasets.Dataset.from_dict(cols)


def pieces(batch_or_meta) -> list:
    """(sample, start, length) of every document of a collated batch (or the HF Trainer
    mixin's per-microbatch metadata)."""
    b = batch_or_meta
    lengths = b["lengths"] if "lengths" in b else torch.diff(torch.as_tensor(b["cu_seqlens"]))
    return [tuple(map(int, t)) for t in zip(torch.as_tensor(b["sample_ids"]).tolist(),
                                             torch.as_tensor(b["sample_starts"]).tolist(),
                                             torch.as_tensor(lengths).tolist())]


def _world():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_exactly_once(mine: list, lengths) -> int:
    """Gather every process's (sample, start, length) pieces and raise unless each token of
    each sample was trained exactly once; returns the number of microbatch documents."""
    import torch.distributed as dist
    rank, world = _world()
    parts = [mine]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    lengths = np.asarray(lengths, np.int64)
    off = np.concatenate([[0], np.cumsum(lengths)])
    cover = np.zeros(int(off[-1]), np.int64)
    for part in parts:
        for s, a, n in part:
            cover[off[s] + a:off[s] + a + n] += 1
    lost, dup = int((cover == 0).sum()), int((cover > 1).sum())
    if lost or dup:
        raise SystemExit(f"{lost} tokens never trained, {dup} trained more than once")
    return sum(len(p) for p in parts)


def report(**figures) -> None:
    """One ``RESULT {json}`` line on the first process (what tests/integrations read)."""
    if _world()[0] == 0:
        print("RESULT " + json.dumps(figures), flush=True)


def shutdown() -> None:
    """Tear the process group down cleanly: every rank done (barrier), finished collective work
    and DDP reducers released (gc) before ``destroy_process_group``. gloo can abort a process
    ("terminate called without an active exception") when its threads still hold work objects
    while the group or the interpreter goes away. Drop your DDP modules before calling this."""
    import gc
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()
