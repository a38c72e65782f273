"""A Megatron-style batch from the padded, unsharded mode (CPU):

    python examples/megatron_batch.py
    python examples/megatron_batch.py --resume   # checkpoint the data position, resume it

Current Megatron-core takes the whole packed microbatch with every document padded to a
multiple of 2 cp and cuts each CP rank's shard itself (``get_thd_batch_on_this_cp_rank``, with
Transformer Engine's ``thd_get_partitioned_indices``). ``PaddedCollator`` gives that batch and
``megatron_batch`` the dict Megatron's ``get_batch`` returns (tokens, next-token labels,
loss_mask, position_ids, cu_seqlens, cu_seqlens_padded, max_seqlen). Here: the batch goes
through megatron-core's own function and ``PackedSeqParams``; without Transformer Engine (CUDA
only) the CP shard is cut with ``balancer.loader.cp_shard.shard_index``, which equals TE's partition;
and a Megatron-style loss ``sum(loss * loss_mask) / step_loss_tokens`` over the padded batch of a
tiny Llama (document-causal additive mask) equals every document run alone. The corpus is SFT
data (a prompt, then a completion: TRL's ``completion_mask``): ``loss_mask`` is 0 on the prompts,
and the sampler counts the completions' tokens (``loss_tokens=``) for ``step_loss_tokens``.
With ``--resume``: the data side of a Megatron-style run over 2 epochs, read by a DataLoader
with 2 workers (which read ahead of the loop). The run stops after 3 microbatches (mid-step,
mid-epoch 0) with ``sampler.state_dict(after=batch)`` saved through ``torch.save``, as a
checkpoint holds it; a fresh dataset, sampler and loader load it, and every remaining Megatron
batch (tokens, labels, loss_mask, position_ids, cu_seqlens, cu_seqlens_padded, max_seqlen) and
its step counts equal the uninterrupted run's, and every token is trained once per epoch.
Tested with torch 2.13.0 (CPU), megatron-core 0.16.1, transformers 5.24.0.
"""
import argparse
import os
import tempfile

import numpy as np
import torch
from megatron.core import utils as mcore_utils
from megatron.core.packed_seq_params import PackedSeqParams
from torch.utils.data import DataLoader

from balancer import CostModel, Layout, PackedBatchSampler, PlannerConfig, SampleTable
from balancer.loader import cp_shard
from balancer.loader.adapters import packed_seq_params
from balancer.loader.collate import PackedDataset
from balancer.integrations.hf import additive_mask
from balancer.integrations.megatron import PaddedCollator, megatron_batch

from _common import TESTED_WITH, check_exactly_once, corpus, pieces, report, tiny_llama

CP = 2
EPOCHS = 2


def main():
    lengths, dataset = corpus(n=24, seed=3, completion_mask=True)
    layout = Layout(dp=1, cp=CP, microbatches=2, capacity=1024)
    packed = PackedDataset(dataset, loss_mask_column="completion_mask")  # train completions only
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 PlannerConfig(seed=0), loss_tokens=packed.loss_tokens())
    loader = DataLoader(packed, batch_sampler=sampler, collate_fn=PaddedCollator())
    full = next(iter(loader))                       # the whole microbatch, padded for CP = 2
    batch = megatron_batch(full)
    cu, cu_p, max_seqlen = (batch.pop(k) for k in ("cu_seqlens", "cu_seqlens_padded", "max_seqlen"))
    batch.pop("attention_mask")
    params = PackedSeqParams(**packed_seq_params(full).as_dict())  # the same fields Megatron builds
    for r in range(CP):                             # what each CP rank of the group trains
        if getattr(mcore_utils, "tex", None) is not None:
            shard, psp = mcore_utils.get_thd_batch_on_this_cp_rank(dict(batch), cu, cu_p,
                                                                   max_seqlen, CP, r)
        else:  # Transformer Engine is CUDA-only: its partition, computed here
            idx = torch.from_numpy(cp_shard.shard_index(np.diff(full["cu_seqlens"].numpy()), CP, r))
            shard = {k: v.index_select(1, idx) for k, v in batch.items()}
            _, psp = mcore_utils.get_thd_batch_on_this_cp_rank(dict(batch), cu, cu_p,
                                                               max_seqlen, 1, 0)
        assert torch.equal(psp.cu_seqlens_q_padded, params.cu_seqlens_q_padded)
        print(f"CP rank {r}: {shard['tokens'].shape[1]} of {batch['tokens'].shape[1]} tokens")

    # a Megatron-style loss over the padded batch equals every document run alone
    model = tiny_llama(torch.float64)
    mask = additive_mask({k: full[k] for k in ("document_ids", "position_ids")}, torch.float64)
    with torch.no_grad():
        logits = model(input_ids=batch["tokens"], position_ids=batch["position_ids"],
                       attention_mask=mask, use_cache=False).logits[0]
        per_token = torch.nn.functional.cross_entropy(logits, batch["labels"][0], reduction="none")
        packed_loss = float((per_token * batch["loss_mask"][0]).sum())
        alone, trained = 0.0, 0
        for s, a, n in zip(full["sample_ids"].tolist(), full["sample_starts"].tolist(),
                           np.diff(full["cu_seqlens"].numpy()).tolist()):
            ids = torch.as_tensor(dataset[s]["input_ids"][a:a + n])[None]
            keep = torch.as_tensor(dataset[s]["completion_mask"][a:a + n])[1:] == 1
            lo = model(input_ids=ids, use_cache=False).logits[0]
            ce = torch.nn.functional.cross_entropy(lo[:-1], ids[0, 1:], reduction="none")
            alone += float(ce[keep].sum())
            trained += int(keep.sum())
    assert int(batch["loss_mask"].sum()) == trained == full["microbatch_loss_tokens"]
    diff = abs(packed_loss - alone) / full["step_loss_tokens"]
    assert diff <= 1e-10, diff
    report(example="megatron_batch", cp=CP, documents=len(full["sample_ids"]),
           padded_tokens=int(full["cu_seqlens_padded"][-1]),
           real_tokens=int(full["cu_seqlens"][-1]), trained_tokens=trained,
           loss_diff_vs_unpacked=diff,
           transformer_engine=getattr(mcore_utils, "tex", None) is not None,
           tested_with=TESTED_WITH)


def _resume_build(lengths, dataset, layout):
    """A fresh dataset, sampler and loader, as a restarted job builds them."""
    packed = PackedDataset(dataset, loss_mask_column="completion_mask")
    sampler = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(4096), layout,
                                 PlannerConfig(seed=0), loss_tokens=packed.loss_tokens())
    loader = DataLoader(packed, batch_sampler=sampler, collate_fn=PaddedCollator(),
                        num_workers=2)  # workers read ahead: checkpoint with after=batch
    return sampler, loader


def _read(sampler, loader, stop_after=None, ckpt=None):
    """(epoch, the loader's batch, its Megatron batch) from the sampler's position to the end
    of EPOCHS; with ``stop_after``: save the data position after that many and return."""
    out = []
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)  # keeps a restored position inside its epoch
        for full in loader:
            out.append((epoch, full, megatron_batch(full)))
            if len(out) == stop_after:
                torch.save({"data": sampler.state_dict(after=full)}, ckpt)
                return out
    return out


def resume():
    lengths, dataset = corpus(n=96, seed=3, completion_mask=True)
    layout = Layout(dp=1, cp=CP, microbatches=2, capacity=1024)
    straight = _read(*_resume_build(lengths, dataset, layout))
    stop = 3
    ckpt = os.path.join(tempfile.gettempdir(), f"balancer-megatron-{os.getpid()}.pt")
    first = _read(*_resume_build(lengths, dataset, layout), stop_after=stop, ckpt=ckpt)
    state = torch.load(ckpt, weights_only=False)
    os.remove(ckpt)
    sampler, loader = _resume_build(lengths, dataset, layout)  # the restarted job
    sampler.load_state_dict(state["data"])
    rest = _read(sampler, loader)
    assert 0 < state["data"]["position"] < sum(1 for e, _, _ in straight if e == 0)
    assert len(first) + len(rest) == len(straight), (len(first), len(rest), len(straight))
    for (e0, f0, m0), (e1, f1, m1) in zip(straight, first + rest):
        assert e0 == e1 and m0.keys() == m1.keys()
        for k in m0:
            assert (m0[k] is None and m1[k] is None) or torch.equal(m0[k], m1[k]), k
        for k in ("step", "step_loss_tokens", "last_in_step", "sample_ids", "sample_starts"):
            assert torch.equal(torch.as_tensor(f0[k]), torch.as_tensor(f1[k])), k
    docs = [check_exactly_once([p for e, f, _ in first + rest if e == ep for p in pieces(f)],
                               lengths) for ep in range(EPOCHS)]
    report(example="megatron_batch", resumed=True, cp=CP, epochs=EPOCHS,
           microbatches=len(straight), checkpoint_after_microbatch=stop,
           checkpoint_step=int(first[-1][1]["step"]), resumed_identical=True,
           documents_per_epoch=docs, tested_with=TESTED_WITH)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--resume", action="store_true",
                    help="checkpoint the data position after 3 microbatches, resume it")
    resume() if ap.parse_args().resume else main()
