"""Megatron/Transformer Engine route: the padded, unsharded microbatch, Megatron-core's own
``get_thd_batch_on_this_cp_rank`` on it, ``packed_seq_params`` refusing whole-document shards,
and a Megatron-style masked token-sum loss over the padded batch equal to the unpacked reference.

Transformer Engine needs CUDA, so its THD attention and ``thd_get_partitioned_indices`` are not
run here: the partition is its documented order (``te_partition_index``), and attention over
``cu_seqlens_padded`` is the tiny varlen model of ``tools/tiny_lm.py``."""

import numpy as np
import pytest
import torch

from balancer import CostModel
from balancer.loader import cp_shard
from balancer.loader.adapters import packed_seq_params
from balancer.loader.collate import FetchedMicrobatch, PackedCollator
from balancer.integrations.megatron import (PaddedCollator, megatron_batch,
                                            te_partition_index)
from balancer.loader.sampler import MicrobatchRef
from integration_helpers import need

LENGTHS = [300, 7, 45, 1, 90, 18, 5, 64]
KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "document_ids")


def _docs(lengths=LENGTHS, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50, n) for n in lengths]


def _ref(n, cp, r=0):
    return MicrobatchRef(list(range(n)), cp=cp, cp_rank=r, step=0, slot=0, epoch=0,
                         position=0, step_microbatches=1, mb=0, step_loss_tokens=99)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_padded_batch_shards_equal_collator_and_te_partition(cp):
    docs = _docs()
    full = PaddedCollator()(FetchedMicrobatch(_ref(len(docs), cp), docs))
    assert full["padded_for_cp"] == cp and full["step_loss_tokens"] == 99
    assert int(full["cu_seqlens_padded"][-1]) == full["input_ids"].shape[0]
    assert full["num_loss_tokens"] == sum(LENGTHS) - len(LENGTHS)
    for r in range(cp):
        shard = PackedCollator()(FetchedMicrobatch(_ref(len(docs), cp, r), docs))
        idx = te_partition_index(full["cu_seqlens_padded"], cp, r)
        if cp > 1:
            assert np.array_equal(idx, shard["cp_index"].numpy())
        assert np.array_equal(idx, cp_shard.shard_index(np.array(LENGTHS), cp, r))
        for k in KEYS:
            assert torch.equal(full[k][idx], shard[k]), (cp, r, k)
        assert torch.equal(full["cu_seqlens"], shard["cu_seqlens"])
        assert torch.equal(full["cu_seqlens_padded"], shard["cu_seqlens_padded"])


def test_packed_seq_params_refuses_whole_document_shards():
    docs = _docs()
    auto = PackedCollator(cp_balance="auto", cost=CostModel.quadratic(256))
    shard = auto(FetchedMicrobatch(_ref(len(docs), 2), docs))
    assert (shard["cp_owner"] >= 0).any()
    with pytest.raises(ValueError, match="zigzag"):
        packed_seq_params(shard)
    zig = PackedCollator()(FetchedMicrobatch(_ref(len(docs), 2), docs))
    p = packed_seq_params(zig)
    full = PaddedCollator()(FetchedMicrobatch(_ref(len(docs), 2), docs))
    q = packed_seq_params(full)
    for k in ("cu_seqlens_q", "cu_seqlens_kv_padded"):
        assert torch.equal(getattr(p, k), getattr(q, k))
    assert p.max_seqlen_q == q.max_seqlen_q == 300  # already a multiple of 2 cp
    with pytest.raises(ValueError, match="PaddedCollator"):
        megatron_batch(zig)


def test_megatron_core_consumes_the_padded_batch(monkeypatch):
    mcore = need("megatron.core")
    import megatron.core.utils as mu
    from megatron.core.packed_seq_params import PackedSeqParams
    docs = _docs()
    cp = 2
    full = PaddedCollator()(FetchedMicrobatch(_ref(len(docs), cp), docs))
    params = PackedSeqParams(**packed_seq_params(full).as_dict())
    assert params.qkv_format == "thd"

    class TEPartition:  # Transformer Engine is CUDA-only: its partition, in its order
        @staticmethod
        def thd_get_partitioned_indices(cu_padded, total, cp_size, cp_rank):
            assert total == int(cu_padded[-1])
            return torch.from_numpy(te_partition_index(cu_padded, cp_size, cp_rank))

    monkeypatch.setattr(mu, "tex", TEPartition, raising=False)
    monkeypatch.setattr(mu, "is_te_min_version", lambda *a, **k: True)
    for r in range(cp):
        mb = megatron_batch(full)
        cu, cu_p, ms = mb.pop("cu_seqlens"), mb.pop("cu_seqlens_padded"), mb.pop("max_seqlen")
        mb.pop("attention_mask")
        got, psp = mu.get_thd_batch_on_this_cp_rank(mb, cu, cu_p, ms, cp_size=cp, cp_rank=r)
        shard = PackedCollator()(FetchedMicrobatch(_ref(len(docs), cp, r), docs))
        assert torch.equal(got["tokens"][0], shard["input_ids"])
        assert torch.equal(got["position_ids"][0], shard["position_ids"])
        keep = shard["shift_labels"] != -100
        assert torch.equal(got["loss_mask"][0].bool(), keep)
        assert torch.equal(got["labels"][0][keep], shard["shift_labels"][keep])
        assert psp.max_seqlen_q == int(full["max_seqlen_padded"])
        assert torch.equal(psp.cu_seqlens_q_padded, full["cu_seqlens_padded"])
    print(f"megatron-core {mcore.__version__}: get_thd_batch_on_this_cp_rank shards == ours")


def test_megatron_style_loss_equals_unpacked_reference():
    """Masked token-sum loss of the padded batch (attention over cu_seqlens_padded, pads at the
    end of each document) equals every document alone; gradients too (float64)."""
    from tools.tiny_lm import TinyLM
    docs = _docs([37, 1, 12, 5, 23])
    torch.manual_seed(0)
    model = TinyLM(vocab=50, dim=32, layers=2, heads=4, attention="loop").double()
    full = PaddedCollator(cp=2)(FetchedMicrobatch(_ref(len(docs), 1), docs))
    mb = megatron_batch(full)
    logits = model(mb["tokens"][0], mb["position_ids"][0], mb["cu_seqlens_padded"],
                   int(mb["max_seqlen"][0]))
    per_token = torch.nn.functional.cross_entropy(logits, mb["labels"][0], reduction="none")
    loss = (per_token * mb["loss_mask"][0]).sum() / mb["loss_mask"].sum()
    loss.backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref, n = 0.0, 0
    real = full["document_ids"] >= 0
    for j, d in enumerate(docs):
        ids = torch.as_tensor(d)
        lo = model(ids, torch.arange(len(d)), torch.tensor([0, len(d)], dtype=torch.int32),
                   len(d))
        at = real.nonzero()[full["document_ids"][real] == j].flatten()
        assert float((logits[at] - lo).abs().max()) <= 1e-10
        ref = ref + torch.nn.functional.cross_entropy(lo[:-1], ids[1:], reduction="sum")
        n += len(d) - 1
    (ref / n).backward()
    assert abs(float(loss) - float(ref / n)) <= 1e-10
    dg = max(float((packed[k] - p.grad).abs().max()) for k, p in model.named_parameters())
    assert dg <= 1e-10, dg


def test_megatron_core_unsharded_batch_without_mocks():
    """cp_size=1: megatron-core's own get_thd_batch_on_this_cp_rank, nothing replaced, takes the
    padded batch as it is and builds the PackedSeqParams our adapter gives."""
    need("megatron.core")
    import megatron.core.utils as mu
    docs = _docs()
    for cp in (1, 2):  # padded for cp = 2 too: Megatron with cp_size 1 still gets padded offsets
        full = PaddedCollator(cp=cp)(FetchedMicrobatch(_ref(len(docs), 1), docs))
        mb = megatron_batch(full)
        want = {k: v.clone() for k, v in mb.items() if isinstance(v, torch.Tensor)}
        cu, cu_p, ms = mb.pop("cu_seqlens"), mb.pop("cu_seqlens_padded"), mb.pop("max_seqlen")
        got, psp = mu.get_thd_batch_on_this_cp_rank(mb, cu, cu_p, ms, cp_size=1, cp_rank=0)
        for k in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(got[k], want[k]), k
        ours = packed_seq_params(full)
        for k in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            assert torch.equal(getattr(psp, k), getattr(ours, k)), k
        assert psp.max_seqlen_q == ours.max_seqlen_q and psp.qkv_format == ours.qkv_format
