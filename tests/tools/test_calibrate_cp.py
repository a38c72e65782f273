"""tools/calibrate_cp.py: the exchange fit recovers known figures, 2 real gloo ranks are timed,
main writes a CP hardware file that the CLI takes with --cp-hardware (report.json carries its
figures; the flags override it), and a bad file is one error naming it."""
import json

import numpy as np
import pytest
import yaml

from balancer import cli
from balancer.cost.cp import CPHardware
from tools import calibrate_cp


@pytest.mark.parametrize("g", [2, 4, 8])
def test_fit_recovers_latency_and_bandwidth(g):
    sizes = np.array([4096, 65536, 1 << 20, 8 << 20])
    lat, bw = 3e-5, 2.5e10
    t = lat * (g - 1) + (g - 1) * sizes / bw
    fit = calibrate_cp.fit_exchange(sizes, t, g)
    assert fit["latency"] == pytest.approx(lat, rel=1e-9)
    assert fit["bandwidth"] == pytest.approx(bw, rel=1e-9)
    assert max(abs(e) for e in fit["rel_error"]) < 1e-9


def test_fit_refuses_what_cannot_be_fitted():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        calibrate_cp.fit_exchange([1, 2], [1.0, 2.0], 1)
    with pytest.raises(ValueError, match="two different sizes"):
        calibrate_cp.fit_exchange([4096, 4096], [1.0, 1.0], 2)
    with pytest.raises(ValueError, match="no cost per byte"):
        calibrate_cp.fit_exchange([4096, 65536], [2e-3, 1e-3], 2)


def test_two_gloo_ranks_are_timed(tmp_path):
    """The measurement itself on 2 real gloo ranks: every size timed, positive, the bytes as
    asked (the figures depend on the machine's load, so nothing is fitted here)."""
    args = calibrate_cp.parse_args(["--world", "2", "--sizes", "4096,65536", "--warmup", "1",
                                    "--repeats", "2"])
    timings, g = calibrate_cp.measure(args)
    assert g == 2 and [r["bytes_per_rank"] for r in timings] == [4096, 65536]
    assert all(0 < r["seconds_min"] <= r["seconds"] <= r["seconds_max"] for r in timings)


def test_main_writes_a_file_the_cli_takes(tmp_path, capsys, monkeypatch):
    """main: the timings (here fixed, the measurement is tested above) -> the fit -> a CP
    hardware YAML that report / precompute / bench take with --cp-hardware; the flags override
    it; a bad file is one error naming it."""
    sizes = [4096, 65536, 1 << 20]
    monkeypatch.setattr(calibrate_cp, "measure", lambda args: (
        [{"bytes_per_rank": b, "seconds": 1e-3 + b / 5e8, "seconds_min": 1e-3,
          "seconds_max": 1.0} for b in sizes], 2))
    hw = tmp_path / "hw.yaml"
    res = calibrate_cp.main(["--gpus-per-node", "4", "--out", str(hw),
                             "--json", str(tmp_path / "cal.json")])
    assert res["fit"]["latency"] == pytest.approx(1e-3) and \
        res["fit"]["bandwidth"] == pytest.approx(5e8)
    doc = yaml.safe_load(hw.read_text())
    assert set(doc) == {"intra_node_bandwidth", "intra_node_latency", "gpus_per_node"}
    assert json.loads((tmp_path / "cal.json").read_text())["hardware"] == doc
    got = CPHardware.from_yaml(hw)
    assert got.intra_node_bandwidth == doc["intra_node_bandwidth"] == pytest.approx(5e8)
    assert got.gpus_per_node == 4 and got.inter_node_bandwidth == CPHardware().inter_node_bandwidth
    # the other scope merged on top keeps this one
    inter = calibrate_cp.hardware_yaml({"latency": 2e-5, "bandwidth": 1e9}, "inter", merge=hw)
    assert inter["intra_node_bandwidth"] == doc["intra_node_bandwidth"]
    assert inter["inter_node_bandwidth"] == 1e9

    lengths = tmp_path / "lengths.npy"
    rng = np.random.default_rng(0)
    np.save(lengths, rng.integers(16, 6000, 300))
    argv = ["report", "--cp-mode", "hybrid", "--lengths", str(lengths), "--dp", "2", "--cp",
            "2", "--rank-capacity", "4096", "--cost-model", "llama-7b", "--strategies",
            "hybrid,fixed_cp1", "--cp-hardware", str(hw), "--no-plots"]
    assert cli.main(argv + ["--out", str(tmp_path / "a")]) == 0
    cm = json.loads((tmp_path / "a" / "report.json").read_text())["cp_cost_model"]
    assert cm["intra_node_bandwidth"] == doc["intra_node_bandwidth"]
    assert cm["intra_node_latency"] == doc["intra_node_latency"]
    assert cm["gpus_per_node"] == 4 and cm["overlap"] == 1.0
    assert cli.main(argv + ["--cp-overlap", "0.5", "--gpus-per-node", "8",
                            "--out", str(tmp_path / "b")]) == 0
    cm = json.loads((tmp_path / "b" / "report.json").read_text())["cp_cost_model"]
    assert cm["overlap"] == 0.5 and cm["gpus_per_node"] == 8
    assert cm["intra_node_bandwidth"] == doc["intra_node_bandwidth"]

    bad = tmp_path / "bad.yaml"
    bad.write_text("intra_node_bandwith: 1e9\n")
    capsys.readouterr()
    assert cli.main(argv + ["--cp-hardware", str(bad), "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert f"--cp-hardware {bad}: intra_node_bandwith: Extra inputs are not permitted" in err \
        and err.count("\n") == 1
    assert cli.main(argv + ["--cp-hardware", str(tmp_path / "none.yaml"),
                            "--out", str(tmp_path / "d")]) == 2
    assert "--cp-hardware" in capsys.readouterr().err


def test_demo_trainer_estimate_takes_the_calibrated_figures(tmp_path):
    """tools/train_cp.py --cp-hardware: the calibrated gloo figures replace --gloo-bandwidth /
    --gloo-latency in the demo's CP cost model (the rest of its hardware stays the demo's)."""
    from tools import train_cp
    hw = tmp_path / "hw.yaml"
    hw.write_text("intra_node_bandwidth: 8.75e8\nintra_node_latency: 3.3e-4\n")
    base = train_cp.demo_cost_model(train_cp.parse_args(["--world", "4"])).hardware
    got = train_cp.demo_cost_model(train_cp.parse_args(["--world", "4", "--cp-hardware",
                                                        str(hw)])).hardware
    assert (base.intra_node_bandwidth, base.intra_node_latency) == (5e8, 1e-3)
    assert got.intra_node_bandwidth == got.inter_node_bandwidth == 8.75e8
    assert got.intra_node_latency == got.inter_node_latency == 3.3e-4
    assert got.overlap == base.overlap == 0.0 and got.gpus_per_node == base.gpus_per_node == 4
