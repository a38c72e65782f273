"""The hybrid DP x CP loader (issue #15 item 4) on real gloo ranks: every token of every
document trained exactly once per epoch with mixed group sizes, equal rounds on every rank,
the members of a group agreeing on its documents, the tokens equal to the dataset's."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
import torch.distributed as dist
from torch.utils.data import DataLoader

from balancer.loader.collate import FlatTokens, PackedDataset
from balancer.config import Layout
from balancer.cost.cp import CPCostModel
from balancer.loader.hybrid import HybridBatchSampler, HybridCollator, aligned_groups
from balancer.samples import SampleTable
from balancer.strategies import registry as strategy_registry
from tests.common.gloo import run_ranks
from tests.common.strategies import each_hybrid_strategy

CAP = 64
WORLD = 4


def lengths_mixed(n=160, seed=0):
    rng = np.random.default_rng(seed)
    short = rng.integers(2, 40, n)
    long = rng.integers(CAP + 1, WORLD * CAP, n)  # need a group of 2 or 4
    return np.where(rng.random(n) < 0.12, long, short).astype(np.int64)


def _setup(lengths, strategy="hybrid", rank=0, epoch=0):
    model = CPCostModel.from_preset("llama-7b", CAP)
    layout = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                    rank_capacity=CAP)
    return HybridBatchSampler(SampleTable(lengths), model, layout, strategy=strategy, seed=7,
                              rank=rank, epoch=epoch)


def _tokens_seen(batch):
    """(sample, position, token) of every real token this rank holds."""
    out = []
    for key, ids_key, st_key in (("whole", "whole_sample_ids", "whole_sample_starts"),
                                 ("shard", "shard_sample_ids", "shard_sample_starts")):
        b = batch[key]
        if b is None:
            continue
        doc = b["document_ids"].numpy()
        real = doc >= 0
        sid = batch[ids_key].numpy()[doc[real]]
        pos = batch[st_key].numpy()[doc[real]] + b["position_ids"].numpy()[real]
        tok = b["input_ids"].numpy()[real]
        out += list(zip(sid.tolist(), pos.tolist(), tok.tolist()))
    return out


def _loader_rank(rank, world, out, strategy):
    lengths = lengths_mixed()
    ds = FlatTokens.from_lengths(lengths, vocab=1000, seed=3)
    sampler = _setup(lengths, strategy, rank=None)
    assert sampler.rank == rank
    loader = DataLoader(PackedDataset(ds), batch_sampler=sampler, collate_fn=HybridCollator(),
                        num_workers=0)
    seen, groups, loss = [], [], {}
    for b in loader:
        seen += _tokens_seen(b)
        groups.append([b["step"], b["round"], list(b["group_ranks"]),
                       b["shard_sample_ids"].tolist()])
        loss.setdefault(b["step"], [0, b["step_loss_tokens"]])
        loss[b["step"]][0] += b["num_loss_tokens"]
    rec = {"n": len(sampler), "batches": len(groups), "seen": seen, "groups": groups,
           "loss": {str(k): v for k, v in loss.items()}}
    allrec = [None] * world
    dist.all_gather_object(allrec, rec)
    if rank == 0:
        Path(out, "result.json").write_text(json.dumps(allrec))


@pytest.mark.slow
@pytest.mark.parametrize("strategy", each_hybrid_strategy())
def test_every_token_trained_exactly_once_on_4_gloo_ranks(tmp_path, strategy):
    lengths = lengths_mixed()
    s0 = _setup(lengths, strategy)   # compiles the kernels here, before the ranks start
    plan = s0.plan
    if strategy == "hybrid":
        used = set(np.unique(plan.group_size[np.diff(plan.group_entries) > 0]).tolist())
        assert used == {1, 2, 4}, used  # mixed group sizes
    run_ranks(_loader_rank, WORLD, tmp_path, strategy)
    recs = json.loads((tmp_path / "result.json").read_text())
    # equal rounds on every rank, len() exact
    assert len({r["n"] for r in recs}) == 1 and all(r["n"] == r["batches"] for r in recs)
    ds = FlatTokens.from_lengths(lengths, vocab=1000, seed=3)
    count = {}
    for r in recs:
        for sid, pos, tok in r["seen"]:
            assert tok == int(ds[sid][pos]), (sid, pos)
            count[(sid, pos)] = count.get((sid, pos), 0) + 1
    want = {(i, p) for i, L in enumerate(lengths.tolist()) for p in range(L)}
    assert set(count) == want
    assert max(count.values()) == 1
    # members of a group agree on the group and its sharded documents
    for j in range(recs[0]["n"]):
        for p, r in enumerate(recs):
            step, rnd, ranks, shard = r["groups"][j]
            assert p in ranks
            for q in ranks:
                assert recs[q]["groups"][j] == [step, rnd, ranks, shard]
    # the step's loss tokens: every rank's labelled tokens summed over the pool, from the plan
    for step, (_, total) in recs[0]["loss"].items():
        assert sum(r["loss"][step][0] for r in recs) == total


def test_sampler_refuses_a_fixed_layout_and_a_rank_outside_the_pool():
    model = CPCostModel.from_preset("llama-7b", CAP)
    with pytest.raises(ValueError, match="cp_mode='hybrid'"):
        HybridBatchSampler(SampleTable(np.array([5, 6])), model,
                           Layout(dp=2, capacity=CAP, rank_capacity=CAP), rank=0)
    with pytest.raises(ValueError, match="rank 4 is outside"):
        _setup(np.array([5, 6]), rank=4)
    with pytest.raises(ValueError, match="rank_capacity"):
        HybridBatchSampler(SampleTable(np.array([5, 6])), CPCostModel.from_preset(
            "llama-7b", 2 * CAP), Layout(dp=2, capacity=CAP, rank_capacity=CAP,
                                         cp_mode="hybrid"), rank=0)


def test_refs_are_deterministic_and_epochs_differ():
    lengths = lengths_mixed(80, seed=1)
    a, b = _setup(lengths, rank=1), _setup(lengths, rank=1)
    ra = [(list(r), r.starts.tolist(), r.sharded.tolist(), r.group_offset) for r in a]
    assert ra == [(list(r), r.starts.tolist(), r.sharded.tolist(), r.group_offset) for r in b]
    b.set_epoch(1)
    assert [list(r) for r in b] != [x[0] for x in ra]


def test_aligned_groups():
    assert aligned_groups(4) == [(0, 1), (2, 3), (0, 1, 2, 3)]
    assert len(aligned_groups(64)) == 63


def test_packed_sampler_refuses_a_hybrid_layout():
    from balancer import CostModel, PackedBatchSampler
    lay = Layout(dp=2, cp=2, capacity=2 * CAP, cp_mode="hybrid", rank_capacity=CAP)
    with pytest.raises(ValueError, match="HybridBatchSampler"):
        PackedBatchSampler(SampleTable(np.array([5, 6])), CostModel.quadratic(65536), lay,
                           rank=0)


def _fetch(ds, ref):
    from balancer.loader.collate import FetchedMicrobatch
    docs = [np.asarray(ds[s][st:st + ln]) for s, st, ln in
            zip(list(ref), ref.starts.tolist(), ref.lengths.tolist())]
    return FetchedMicrobatch(ref, docs)


@settings(max_examples=25, deadline=None)
@given(P=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2 ** 16),
       strategy=st.sampled_from(strategy_registry.names("hybrid", n_ranks=2)),
       rounds=st.integers(1, 3))
def test_every_rank_of_any_pool_gets_each_token_once_in_process(P, seed, strategy, rounds):
    """The loader's contract without processes: over every rank of the pool, every token of
    every document exactly once, rounds equal, the members of a group agreeing, and (hybrid,
    fixed) no rank over its token limit in a round, CP padding included."""
    if strategy == "fixed_cp2" and P == 1:
        strategy = "fixed_cp1"
    cap = 32
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    big = P * cap if strategy != "fixed_cp1" else cap * 3
    lengths = np.where(rng.random(n) < 0.15, rng.integers(cap + 1, max(cap + 2, big), n),
                       rng.integers(1, cap // 2, n)).astype(np.int64)
    if strategy in ("hybrid", "hybrid_stream", "megatron_hybrid"):
        lengths = np.minimum(lengths, P * (cap - cap % 2))
    model = CPCostModel.from_preset("llama-7b", cap)
    layout = Layout(dp=P, cp=1, microbatches=rounds, capacity=cap, cp_mode="hybrid",
                    rank_capacity=cap)
    ds = FlatTokens.from_lengths(lengths, vocab=100, seed=seed)
    col = HybridCollator(return_tensors="np")
    seen = {}
    per_rank = []
    for p in range(P):
        s = HybridBatchSampler(SampleTable(lengths), model, layout, strategy=strategy, seed=1,
                               rank=p)
        refs = list(s)
        per_rank.append([(r.step, r.round, r.group_offset, r.group_size,
                          [x for x, sh in zip(list(r), r.sharded.tolist()) if sh])
                         for r in refs])
        for r in refs:
            b = col(_fetch(ds, r))
            held = 0
            for key, ids, sts in (("whole", "whole_sample_ids", "whole_sample_starts"),
                                  ("shard", "shard_sample_ids", "shard_sample_starts")):
                if b[key] is None:
                    continue
                held += b[key]["input_ids"].shape[0]
                doc = b[key]["document_ids"]
                real = doc >= 0
                for sid, pos, tok in zip(b[ids][doc[real]], b[sts][doc[real]]
                                         + b[key]["position_ids"][real],
                                         b[key]["input_ids"][real]):
                    assert tok == ds[int(sid)][int(pos)]
                    seen[(int(sid), int(pos))] = seen.get((int(sid), int(pos)), 0) + 1
            if strategy != "megatron_hybrid":
                assert held <= cap, (held, cap)
    assert len({len(x) for x in per_rank}) == 1
    assert set(seen) == {(i, q) for i, L in enumerate(lengths.tolist()) for q in range(L)}
    assert max(seen.values()) == 1
    for j in range(len(per_rank[0])):
        for p in range(P):
            step, rnd, off, size, shard = per_rank[p][j]
            assert off <= p < off + size
            if strategy != "megatron_hybrid":   # Megatron's groups are consecutive, not aligned
                assert off % size == 0
            assert all(per_rank[q][j] == per_rank[p][j] for q in range(off, off + size))


def test_resume_from_every_round_is_exact():
    lengths = lengths_mixed(70, seed=5)
    full = [(r.epoch, r.position, list(r)) for e in (0, 1)
            for r in (lambda s: (s.set_epoch(e), list(s))[1])(_setup(lengths, rank=2))]
    n0 = len(_setup(lengths, rank=2))
    for k in range(0, n0 + 2):
        a = _setup(lengths, rank=2)
        it = iter(a)
        got = []
        for _ in range(min(k, n0)):
            r = next(it)
            got.append((r.epoch, r.position, list(r)))
        state = a.state_dict()
        b = _setup(lengths, rank=2)
        b.load_state_dict(state)
        rest = [(r.epoch, r.position, list(r)) for r in b]
        if b.epoch == 0:
            b.set_epoch(1)
            rest += [(r.epoch, r.position, list(r)) for r in b]
        else:
            got = [x for x in full if x[0] == 0]
        assert got + rest == full, k
    # after= a collated batch: resume right after it
    s = _setup(lengths, rank=2)
    refs = list(s)
    b = _setup(lengths, rank=2)
    b.load_state_dict(s.state_dict(after={"epoch": 0, "position": refs[3].position}))
    assert [list(r) for r in b] == [list(r) for r in refs[4:]]
    with pytest.raises(ValueError, match="seed"):
        c = HybridBatchSampler(SampleTable(lengths), s.model, s.layout, seed=8, rank=2)
        c.load_state_dict(s.state_dict())


def test_sampler_names_the_over_long_sample_by_its_id():
    lengths = np.array([5, 6, 7, 5 * CAP, 8], np.int64)
    with pytest.raises(ValueError, match=f"sample 3: length {5 * CAP} exceeds the pool's "
                                         f"limit of {4 * CAP}"):
        len(_setup(lengths))
    s = HybridBatchSampler(SampleTable(lengths), CPCostModel.from_preset("llama-7b", CAP),
                           Layout(dp=2, cp=2, capacity=2 * CAP, cp_mode="hybrid",
                                  rank_capacity=CAP), rank=0, over_limit="chunk")
    assert s.plan.documents_cut == 1 and int(s.plan.item_length.sum()) == int(lengths.sum())


def test_bad_arguments_are_refused_at_construction_naming_the_value(monkeypatch):
    """As PackedBatchSampler: lengths as a list or array are planned (was AttributeError); a
    non-integral or negative epoch, an unknown strategy or over_limit, a budget <= 0, a negative
    delay bound or a state that is not a dict are one clear error, not a silent plan."""
    L = lengths_mixed()
    model = CPCostModel.from_preset("llama-7b", CAP)
    lay = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                 rank_capacity=CAP)
    ref = [r.position for r in HybridBatchSampler(SampleTable(L), model, lay, rank=1)]
    for given in (L, L.tolist(), L.astype(np.int32)):
        s = HybridBatchSampler(given, model, lay, rank=1)
        assert [r.position for r in s] == ref and s.plan.item_doc.shape[0] >= len(L)
    with pytest.raises(ValueError, match=r"sample 1: length -2 is not positive"):
        HybridBatchSampler([3, -2, 4, 5], model, lay, rank=0)
    bad = [(dict(epoch=-1), r"epoch must be an integer >= 0"),
           (dict(epoch=1.5), r"epoch must be an integer >= 0"),
           (dict(strategy="bogus"), r"strategy 'bogus' is not a hybrid-mode strategy of a pool "
                                    r"of 4 ranks \(choose from fixed_cp1, fixed_cp2, fixed_cp4, "
                                    r"hybrid, hybrid_stream, megatron_hybrid\)"),
           (dict(strategy="fixed_cp3"), r"strategy 'fixed_cp3' is not"),
           (dict(over_limit="drop"), r"over_limit must be 'error' or 'chunk', got 'drop'"),
           (dict(batch_tokens=0), r"batch_tokens must be a positive number of tokens, got 0"),
           (dict(batch_tokens=-5), r"batch_tokens must be a positive number of tokens, got -5"),
           (dict(max_delay=-1), r"max_delay must be >= 0, got -1")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg):
            HybridBatchSampler(SampleTable(L), model, lay, rank=0, **kw)
    s = HybridBatchSampler(SampleTable(L), model, lay, rank=0)
    for e in (1.5, -1, "2", None):
        with pytest.raises(ValueError, match=r"set_epoch\(.*\): the epoch must be an integer"):
            s.set_epoch(e)
    s.set_epoch(np.int64(1))
    s.set_epoch(2.0)
    assert s.epoch == 2
    for st_ in (None, [1], "state"):
        with pytest.raises(ValueError, match=r"load_state_dict takes the dict of state_dict\(\)"):
            s.load_state_dict(st_)


def test_launched_processes_without_a_process_group_are_refused(monkeypatch):
    """Under a launcher (WORLD_SIZE > 1) with no process group and no rank given, every process
    would serve rank 0 and the other ranks' documents would never train: refused, naming the
    fix (as PackedBatchSampler). One process, or a pool of one rank, still defaults to rank 0."""
    model = CPCostModel.from_preset("llama-7b", CAP)
    lay = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                 rank_capacity=CAP)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=4 .* torch.distributed is not "
                                         r"initialized.*pass rank="):
        HybridBatchSampler(SampleTable(lengths_mixed()), model, lay)
    assert HybridBatchSampler(SampleTable(lengths_mixed()), model, lay, rank=3).rank == 3
    one = Layout(dp=1, cp=1, microbatches=2, capacity=CAP, cp_mode="hybrid", rank_capacity=CAP)
    assert HybridBatchSampler(SampleTable(lengths_mixed() % CAP + 1), model, one).rank == 0
    monkeypatch.delenv("WORLD_SIZE")
    assert HybridBatchSampler(SampleTable(lengths_mixed()), model, lay).rank == 0


def test_a_process_group_of_another_size_is_refused(tmp_path):
    """rank taken from a process group whose size is not the pool's: ranks past the group would
    never be served (their documents untrained), so it is an error naming both sizes."""
    model = CPCostModel.from_preset("llama-7b", CAP)
    lay = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                 rank_capacity=CAP)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1)
    try:
        with pytest.raises(ValueError, match=r"process group has 1 ranks but the hybrid pool is "
                                             r"dp 2 x cp 2 = 4"):
            HybridBatchSampler(SampleTable(lengths_mixed()), model, lay)
        assert HybridBatchSampler(SampleTable(lengths_mixed()), model, lay, rank=2).rank == 2
    finally:
        dist.destroy_process_group()
