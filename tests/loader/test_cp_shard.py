"""Per-document CP sharding: zigzag chunks, whole-document owners, exact reconstruction,
attention work per rank, and the cost-model choice of whole documents."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer import CostModel
from balancer.loader.collate import pack_documents
from balancer.loader.cp_shard import (choose_owners, padded_lengths, rank_attention, shard_index,
    unshard)

lens_st = st.lists(st.integers(1, 60), min_size=1, max_size=10)


def naive_index(lengths, cp, r, owner):
    out, off = [], 0
    for L, o in zip(lengths, owner):
        P = -(-L // (2 * cp)) * 2 * cp
        c = P // (2 * cp)
        if o < 0:
            out += list(range(off + r * c, off + (r + 1) * c))
            out += list(range(off + (2 * cp - 1 - r) * c, off + (2 * cp - r) * c))
        elif o == r:
            out += list(range(off, off + P))
        off += P
    return out


@given(lens_st, st.integers(2, 4), st.data())
def test_shards_partition_and_rebuild_the_padded_microbatch(lengths, cp, data):
    owner = np.array(data.draw(st.lists(st.integers(-1, cp - 1), min_size=len(lengths),
                                        max_size=len(lengths))))
    L = np.array(lengths)
    total = int(padded_lengths(L, cp).sum())
    idx = [shard_index(L, cp, r, owner) for r in range(cp)]
    for r in range(cp):
        assert idx[r].tolist() == naive_index(lengths, cp, r, owner)
    cat = np.concatenate(idx)
    assert np.array_equal(np.sort(cat), np.arange(total))
    # shards of the real collator rebuild the full padded microbatch in the documented order
    rng = np.random.default_rng(len(lengths))
    docs = [rng.integers(0, 1000, n) for n in lengths]
    full = pack_documents(docs, cp=cp, cp_rank=0, owner=owner)
    shards = [pack_documents(docs, cp=cp, cp_rank=r, owner=owner) for r in range(cp)]
    rebuilt = {}
    for key in ("input_ids", "labels", "shift_labels", "position_ids", "document_ids"):
        rebuilt[key] = unshard([s[key] for s in shards], [s["cp_index"] for s in shards], total)
        assert np.array_equal(rebuilt[key][cat], np.concatenate([s[key] for s in shards]))
    real = rebuilt["document_ids"] >= 0
    assert np.array_equal(rebuilt["input_ids"][real], np.concatenate(docs))
    # labels of the rebuilt microbatch are those of the unsharded one, restricted to real tokens
    flat = pack_documents(docs)
    for key in ("labels", "shift_labels", "position_ids", "document_ids"):
        assert np.array_equal(rebuilt[key][real], flat[key])
    assert (rebuilt["shift_labels"][~real] == -100).all()
    # loss tokens and real cu_seqlens are those of the unsharded microbatch
    assert sum(s["num_loss_tokens"] for s in shards) == sum(n - 1 for n in lengths)
    assert full["cu_seqlens"].tolist() == [0] + np.cumsum(lengths).tolist()
    assert full["cu_seqlens_padded"].tolist() == [0] + np.cumsum(padded_lengths(L, cp)).tolist()
    assert full["cu_seqlens_padded"].dtype == np.int32


@given(lens_st, st.integers(2, 4), st.data())
def test_rank_attention_counts_pairs(lengths, cp, data):
    owner = np.array(data.draw(st.lists(st.integers(-1, cp - 1), min_size=len(lengths),
                                        max_size=len(lengths))))
    docs = [np.zeros(n, np.int64) for n in lengths]
    for r in range(cp):
        s = pack_documents(docs, cp=cp, cp_rank=r, owner=owner)
        real = s["document_ids"] >= 0
        pairs = float((s["position_ids"][real] + 1).sum())  # causal keys of every real query
        assert s["cp_attention"][r] == pytest.approx(pairs)
    assert rank_attention(np.array(lengths), cp, owner).sum() == pytest.approx(
        sum(n * (n + 1) / 2 for n in lengths))


@given(lens_st, st.integers(2, 4))
def test_whole_documents_never_worse_than_zigzag(lengths, cp):
    L = np.array(lengths) * 37
    cost = CostModel.quadratic(1024)
    from balancer.loader.cp_shard import _doc_loads
    whole, sharded = _doc_loads(L, cp, cost)

    def max_load(owner):
        load = sharded[owner < 0].sum(axis=0)
        np.add.at(load, owner[owner >= 0], whole[owner >= 0])
        return load.max()

    owner = choose_owners(L, cp, cost)
    assert max_load(owner) <= max_load(np.full(len(L), -1)) * (1 + 1e-9)
    cap = int(padded_lengths(L, cp).sum() // cp) + 2 * cp
    owner = choose_owners(L, cp, cost, max_rank_tokens=cap)
    tok = np.zeros(cp)
    tok += padded_lengths(L[owner < 0], cp).sum() / cp
    np.add.at(tok, owner[owner >= 0], padded_lengths(L[owner >= 0], cp))
    assert tok.max() <= cap


def test_short_documents_stay_whole_long_ones_shard():
    cost = CostModel.quadratic(1024)
    L = np.array([8000, 64, 64, 64, 64, 64, 64, 64, 64])
    owner = choose_owners(L, 2, cost)
    assert owner[0] == -1 and (owner[1:] >= 0).all()
    assert set(owner[1:].tolist()) == {0, 1}
    # a single short document is sharded (whole on one rank would leave the other idle)
    assert choose_owners(np.array([64]), 2, cost).tolist() == [-1]
