"""A sample cut into pieces (``over_length='chunk'``) is bounded before any piece is made: at
most :data:`balancer.planning.stream.MAX_PIECES` (2**20, the bound of every count) pieces per
sample, so a corrupt length such as 2**40 is a clear error naming the sample, its length, the
pieces it would need and the limit, instead of allocating its pieces (8 TiB at capacity 1,
3 GiB at 8192) before anything else can complain."""
import numpy as np
import pytest

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.cli import main
from balancer.planning.stream import MAX_PIECES, make_items

COST = CostModel.quadratic(65536)


@pytest.mark.parametrize("capacity", [1, 8192])
def test_a_sample_needing_too_many_pieces_is_refused(capacity):
    lengths = np.array([100, 2 ** 40, 5], np.int64)
    layout = Layout(dp=2, microbatches=2, capacity=capacity)
    pieces = -(-2 ** 40 // capacity)
    with pytest.raises(ValueError, match=rf"sample 1: length {2 ** 40} .* {pieces} pieces .*"
                                         rf"limit of {MAX_PIECES}"):
        plan_epoch(SampleTable(lengths), COST, layout, PlannerConfig(over_length="chunk"))


def test_the_limit_itself_is_accepted():
    order = np.arange(2, dtype=np.int64)
    items, stats = make_items(order, np.array([4 * MAX_PIECES, 3], np.int64), 4, 1, "chunk")
    assert items.sample.shape[0] == MAX_PIECES + 1 and stats["samples_chunked"] == 1
    with pytest.raises(ValueError, match=rf"sample 0: length {4 * MAX_PIECES + 1} "):
        make_items(order, np.array([4 * MAX_PIECES + 1, 3], np.int64), 4, 1, "chunk")


def test_the_cli_names_the_sample(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([10, 20, 2 ** 40], np.int64))
    rc = main(["precompute", "--lengths", str(tmp_path / "l.npy"), "--capacity", "8192",
               "--over-length", "chunk", "--out", str(tmp_path / "plan")])
    err = capsys.readouterr().err
    assert rc == 2 and f"sample 2: length {2 ** 40}" in err and "pieces" in err, err
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("strategy", ["hybrid_stream", "hybrid", "megatron_hybrid",
                                      "fixed_cp2"])
def test_the_hybrid_mode_bounds_the_pieces_too(strategy):
    from balancer.cost.cp import CPCostModel
    from balancer.planning.hybrid import plan_hybrid_epoch
    lengths = np.array([100, 5, 2 ** 40], np.int64)
    model = CPCostModel.from_preset("llama-7b", 4096)
    with pytest.raises(ValueError, match=rf"sample 2: length {2 ** 40} .* pieces .*limit of "
                                         rf"{MAX_PIECES}"):
        plan_hybrid_epoch(lengths, model, 4, 16384, strategy=strategy, over_length="chunk")


def test_the_hybrid_report_and_precompute_name_the_sample(tmp_path, capsys):
    np.save(tmp_path / "l.npy", np.array([10, 2 ** 40, 20], np.int64))
    flags = ["--lengths", str(tmp_path / "l.npy"), "--dp", "2", "--cp", "2", "--cp-mode",
             "hybrid", "--rank-capacity", "4096", "--over-length", "chunk"]
    for argv in (["report", *flags, "--out", str(tmp_path / "rep"), "--no-plots"],
                 ["precompute", *flags, "--cost-model", "llama-7b", "--out",
                  str(tmp_path / "plan")]):
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2 and f"sample 1: length {2 ** 40} would be cut" in err, (argv[0], err)
