"""Trained tokens in the report (issue 24 item 4): the fraction of trained tokens per step from
per-sample counts, bad counts refused naming the sample, plans and costs unchanged by masks."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch
from balancer.cli import main
from balancer.report import build as R
from balancer.report import loss_tokens as LT
from balancer.report.markdown import render


def _lengths(n=1500, seed=0):
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.02, rng.integers(3000, 12000, n),
                 rng.lognormal(np.log(300), 1.0, n))
    return np.maximum(x.astype(np.int64), 1)


def _counts(lengths, seed=1):
    rng = np.random.default_rng(seed)
    c = (lengths * rng.random(len(lengths))).astype(np.int64)
    c[::7] = 0                         # documents with no trained token are allowed
    c[::11] = lengths[::11]            # and fully trained ones
    return c


def _naive_fraction(plan, counts, lengths):
    """Per step, by a loop over entries: whole documents only (the caller checks there is no
    piece), trained / tokens."""
    trained = np.zeros(plan.n_steps)
    tokens = np.zeros(plan.n_steps)
    for m in range(plan.n_microbatches):
        for e in range(plan.mb_offsets[m], plan.mb_offsets[m + 1]):
            s = plan.entry_sample[e]
            assert plan.entry_length[e] == lengths[s]
            trained[plan.mb_step[m]] += counts[s]
            tokens[plan.mb_step[m]] += lengths[s]
    return trained / tokens


def test_bad_counts_are_refused_naming_the_sample():
    lengths = np.array([5, 9, 3], np.int64)
    with pytest.raises(ValueError, match=r"sample 1 has 10 trained tokens, more than its "
                                         r"length 9"):
        LT.check_loss_tokens(np.array([5, 10, 0]), lengths)
    with pytest.raises(ValueError, match=r"sample 2 has -1 trained tokens, below 0"):
        LT.check_loss_tokens(np.array([0, 0, -1]), lengths)
    with pytest.raises(ValueError, match=r"one count per sample, shape \(3,\)"):
        LT.check_loss_tokens(np.array([1, 2]), lengths)
    with pytest.raises(ValueError, match="integer counts"):
        LT.check_loss_tokens(np.array([1.0, 2.0, 3.0]), lengths)
    with pytest.raises(ValueError, match="integer counts"):
        LT.check_loss_tokens(np.array([True, False, True]), lengths)
    ok = LT.check_loss_tokens(np.array([5, 0, 3], np.int32), lengths)
    assert ok.dtype == np.int64 and ok.tolist() == [5, 0, 3]


def test_trained_fraction_per_step_and_costs_unchanged():
    lengths = np.minimum(_lengths(), 8192)
    counts = _counts(lengths)
    cost = load_cost_model("llama-7b")
    lay = Layout(dp=2, pp=2, microbatches=3, capacity=8192)
    cfg = PlannerConfig()
    names = ["sequential", "balanced"]
    plain, _ = R.build_report(lengths, cost, lay, cfg, names)
    rep, _ = R.build_report(lengths, cost, lay, cfg, names, loss_tokens=counts)
    assert rep["workload"]["trained_tokens"] == int(counts.sum())
    assert rep["workload"]["samples_without_trained_tokens"] == int((counts == 0).sum())
    for name in names:
        a, b = plain["strategies"][name], rep["strategies"][name]
        # masks change nothing about the plan or its cost: every other figure is the same
        assert {k: v for k, v in b.items() if k not in ("loss_tokens", "analyze_seconds",
                                                          "plan_seconds", "plan_seconds_per_step",
                                                          "speedup_vs_baseline")} == \
            {k: v for k, v in a.items() if k not in ("analyze_seconds", "plan_seconds",
                                                      "plan_seconds_per_step",
                                                      "speedup_vs_baseline")}
        lt = b["loss_tokens"]
        plan = plan_epoch(SampleTable(lengths), cost, lay, cfg.model_copy(
            update={"strategy": name}))
        ref = _naive_fraction(plan, counts, lengths)
        np.testing.assert_allclose(lt["per_step_trained_fraction"], ref, rtol=0, atol=1e-15)
        assert lt["trained_tokens"] == int(counts.sum()) and lt["tokens"] == int(lengths.sum())
        assert lt["trained_fraction_per_step"]["min"] == pytest.approx(ref.min(), abs=1e-15)
        assert lt["trained_fraction_per_step"]["max"] == pytest.approx(ref.max(), abs=1e-15)
        assert lt["pieces_apportioned"] == 0 and "same forward and backward" in lt["cost_note"]
    text = render(rep)
    assert "## Trained tokens per step (loss mask)" in text and LT.COST_NOTE in text
    assert "a loss-masked token costs the same compute" in render(plain)
    summary = R.format_summary(rep)
    assert "trained tokens (loss mask)" in summary and "balanced mean" in summary
    assert "trained tokens" not in R.format_summary(plain)


def test_bad_counts_refused_before_planning():
    lengths = _lengths(50)
    counts = lengths.copy()
    counts[17] += 1
    with pytest.raises(ValueError, match="sample 17"):
        R.build_report(lengths, load_cost_model("quadratic-64k"),
                       Layout(dp=2, microbatches=2, capacity=65536), PlannerConfig(),
                       ["sequential"], loss_tokens=counts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(0, 60), st.integers(1, 5)),
                min_size=1, max_size=30))
def test_pieces_of_a_document_share_its_count_exactly(docs):
    # a document cut into pieces (any cut points): the pieces' counts sum to the document's
    # count and no piece gets more than its length
    from types import SimpleNamespace
    lengths, counts, sample, start, ln = [], [], [], [], []
    for i, (L, c, k) in enumerate(docs):
        c = min(c, L)
        lengths.append(L)
        counts.append(c)
        cuts = sorted(set(np.linspace(0, L, k + 1).astype(int).tolist()))
        for a, b in zip(cuts[:-1], cuts[1:]):
            sample.append(i)
            start.append(a)
            ln.append(b - a)
    lengths, counts = np.array(lengths, np.int64), np.array(counts, np.int64)
    plan = SimpleNamespace(entry_sample=np.array(sample, np.int64),
                           entry_start=np.array(start, np.int64),
                           entry_length=np.array(ln, np.int64))
    per = LT.entry_loss_tokens(plan, counts, lengths)
    assert (per >= 0).all() and (per <= plan.entry_length).all()
    assert np.bincount(plan.entry_sample, weights=per, minlength=len(lengths)).astype(
        np.int64).tolist() == counts.tolist()


def test_cli_loss_tokens_flag(tmp_path, capsys):
    lengths = _lengths(800, seed=5)
    counts = _counts(lengths, seed=6)
    np.save(tmp_path / "lens.npy", lengths)
    np.save(tmp_path / "lt.npy", counts)
    argv = ["report", "--lengths", str(tmp_path / "lens.npy"), "--capacity", "4096", "--dp", "2",
            "--microbatches", "2", "--over-length", "chunk", "--strategies",
            "sequential,balanced", "--out", str(tmp_path / "r"), "--no-plots"]
    assert main([*argv, "--loss-tokens", str(tmp_path / "lt.npy")]) == 0
    assert "trained tokens (loss mask)" in capsys.readouterr().out
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["workload"]["trained_tokens"] == int(counts.sum())
    for s in rep["strategies"].values():
        lt = s["loss_tokens"]
        assert lt["trained_tokens"] == int(counts.sum())  # apportioned pieces sum exactly
        assert lt["pieces_apportioned"] > 0               # documents over 4096 were cut
        assert len(lt["per_step_trained_fraction"]) == s["steps"]
    assert "Trained tokens per step" in (tmp_path / "r" / "report.md").read_text()
    bad = counts.copy()
    bad[3] = lengths[3] + 2
    np.save(tmp_path / "bad.npy", bad)
    assert main([*argv, "--loss-tokens", str(tmp_path / "bad.npy")]) == 2
    err = capsys.readouterr().err
    assert f"sample 3 has {lengths[3] + 2} trained tokens, more than its length" in err
    assert main([*argv, "--loss-tokens", str(tmp_path / "nope.npy")]) == 2
    assert "--loss-tokens" in capsys.readouterr().err


def test_cli_loss_mask_column_of_a_saved_dataset(tmp_path, capsys):
    import datasets
    rng = np.random.default_rng(2)
    lengths = rng.integers(5, 200, 300)
    masks = [(rng.random(n) < 0.4).astype(np.int64).tolist() for n in lengths]
    ids = [list(range(n)) for n in lengths]
    datasets.Dataset.from_dict({"input_ids": ids, "completion_mask": masks}).save_to_disk(
        str(tmp_path / "ds"))
    argv = ["report", "--dataset", str(tmp_path / "ds"), "--tokens-column", "input_ids",
            "--length-column", "none", "--capacity", "1024", "--dp", "2", "--microbatches", "2",
            "--strategies", "balanced", "--out", str(tmp_path / "r"), "--no-plots"]
    assert main([*argv, "--loss-mask-column", "completion_mask"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["workload"]["trained_tokens"] == sum(map(sum, masks))
    assert main([*argv, "--loss-mask-column", "labels"]) == 2
    assert "no such column" in capsys.readouterr().err
