"""Progress on the long commands (issue 31 item 5): compare / report / demo report each stage
(compile, one per strategy, writing) to one tqdm bar on stderr when it is a terminal, nothing
otherwise; the planning layers take a ``progress(label)`` callback."""
from __future__ import annotations

import io

import numpy as np

from balancer import Layout, PlannerConfig, load_cost_model
from balancer.cli import main
from balancer.cli.progress import Stages
from balancer.report.build import build_report
from balancer.report.compare import compare
from balancer.samples import SampleTable

COST = load_cost_model("quadratic-64k")
LAYOUT = Layout(dp=2, microbatches=2, capacity=8192)
CONFIG = PlannerConfig(over_length="chunk")


def _lengths():
    return np.random.default_rng(0).integers(1, 3000, 500)


def test_compare_and_build_report_call_progress_per_strategy():
    seen = []
    compare(SampleTable(_lengths()), COST, LAYOUT, CONFIG, ["sequential", "balanced"],
            progress=seen.append)
    assert seen == ["plan sequential", "plan balanced"]
    seen.clear()
    build_report(_lengths(), COST, LAYOUT, CONFIG, ["ffd_tokens", "balanced"],
                 progress=seen.append)
    assert seen == ["plan ffd_tokens", "plan balanced"]


def test_stages_bar_only_on_a_terminal_or_forced():
    out = io.StringIO()  # not a terminal: nothing is written
    s = Stages(3, "report", file=out)
    s("a")
    s.close()
    assert out.getvalue() == ""
    s = Stages(3, "report", file=out, force=True, tick_s=0.01)
    for label in ("compile kernels", "plan balanced", "write report"):
        s(label)
    s.close()
    text = out.getvalue()
    assert "report" in text and "3/3" in text and "plan balanced" in text
    out = io.StringIO()
    s = Stages(3, "report", file=out, force=True, quiet=True)
    s("a")
    s.close()
    assert out.getvalue() == ""


def test_cli_compare_and_report_print_no_bar_into_a_pipe(tmp_path, capsys):
    npy = tmp_path / "l.npy"
    np.save(npy, _lengths())
    assert main(["compare", "--lengths", str(npy), "--capacity", "8192", "--dp", "2",
                 "--microbatches", "2", "--strategies", "sequential,balanced"]) == 0
    assert main(["report", "--lengths", str(npy), "--capacity", "8192", "--dp", "2",
                 "--microbatches", "2", "--strategies", "balanced", "--no-plots", "--out",
                 str(tmp_path / "r")]) == 0
    assert main(["precompute", "--lengths", str(npy), "--capacity", "8192", "--dp", "2",
                 "--microbatches", "2", "--out", str(tmp_path / "p")]) == 0
    err = capsys.readouterr().err
    assert "stage" not in err and "window/s" not in err and "it/s" not in err
