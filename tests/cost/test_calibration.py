"""Cost-model calibration: the least-squares fit recovers known coefficients from synthetic
timings, non-negative least squares is optimal (KKT), held-out errors are what they say, presets
round-trip through the loader, and tools/calibrate.py measures a real module end to end."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.cost import calibration as cal  # noqa: E402
from balancer.cost.model import CostModel, PassCost, load_cost_model  # noqa: E402

# a CPU-like model: a long document is attention-bound, a full packed one linear-bound
TRUE = {"forward": PassCost(a=1.6e-7, b=4.2e-5, c=7.0e-3, d=1.5e-4),
        "backward": PassCost(a=3.1e-7, b=8.5e-5, c=4.0e-3, d=2.5e-4)}


def synthetic(n, seed, noise=0.0, capacity=4096):
    rng = np.random.default_rng(seed)
    shapes = cal.sample_shapes(n, capacity, rng)
    lens, off = cal.to_csr(shapes)
    secs = {}
    for k, coef in TRUE.items():
        y = cal.predict(coef, lens, off)
        secs[k] = y * (1 + noise * rng.standard_normal(y.shape[0])) if noise else y
    return cal.Observations(lens, off, secs)


def rel(x, y):
    return abs(x - y) / abs(y)


def test_features_are_sums_per_microbatch():
    lens, off = cal.to_csr([[3], [1, 2, 5], [4, 4]])
    x = cal.features(lens, off)
    np.testing.assert_array_equal(x, [[9, 3, 1, 1], [30, 8, 1, 3], [32, 8, 1, 2]])


def test_exact_timings_recover_coefficients_exactly():
    c = cal.calibrate(synthetic(40, 0))
    for k in cal.PASSES:
        got, want = getattr(c, k), TRUE[k]
        for f in "abcd":
            assert rel(getattr(got, f), getattr(want, f)) < 1e-8, (k, f)
    assert c.quality["fit"]["total"]["rel_error"]["max"] < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_timings_recover_coefficients_within_2_percent(seed):
    # 1% multiplicative timing noise, 200 shapes: every coefficient within 2%
    fit, held = synthetic(200, seed, noise=0.01), synthetic(60, seed + 100, noise=0.01)
    c = cal.calibrate(fit, held)
    for k in cal.PASSES:
        for f in "abc":
            assert rel(getattr(getattr(c, k), f), getattr(TRUE[k], f)) < 0.02, (seed, k, f)
        # the per-document constant adds only ~2% of a microbatch's time here, so 1% noise
        # moves it more
        assert rel(getattr(c, k).d, TRUE[k].d) < 0.2, (seed, k)
    # held-out error is the noise itself (median |N(0, 1%)| ~ 0.67%)
    assert c.quality["held_out"]["forward"]["rel_error"]["median"] < 0.012
    assert c.quality["held_out"]["forward"]["r2"] > 0.999


def test_relative_weighting_beats_unweighted_on_short_microbatches():
    obs = synthetic(200, 3, noise=0.02)
    short = cal.features(obs.doc_lengths, obs.offsets)[:, 1] < 512
    errs = {}
    for relative in (True, False):
        coef = cal.fit_pass(obs.doc_lengths, obs.offsets, obs.seconds["forward"], relative)
        pred = cal.predict(coef, obs.doc_lengths, obs.offsets)
        errs[relative] = np.median(cal.relative_errors(pred, obs.seconds["forward"])[short])
    assert errs[True] <= errs[False]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(3, 30))
def test_nnls3_satisfies_kkt(seed, m):
    rng = np.random.default_rng(seed)
    x = rng.random((m, 3)) * rng.choice([1e-3, 1.0, 1e3], 3)
    y = x @ rng.normal(size=3) + rng.normal(scale=0.1, size=m)
    xs = x / np.linalg.norm(x, axis=0)
    c = cal.nnls3(xs, y)
    g = xs.T @ (xs @ c - y)  # gradient of half the squared residual
    tol = 1e-8 * max(1.0, float(np.abs(xs.T @ y).max()))
    assert (c >= 0).all()
    assert (np.abs(g[c > 0]) <= tol).all()  # stationary on the support
    assert (g[c == 0] >= -tol).all()  # no descent direction into the feasible set


def test_negative_unconstrained_constant_is_clamped_to_zero():
    # times with no constant and a small negative offset: the unconstrained c is < 0
    lens, off = cal.to_csr([[n] for n in range(100, 2100, 100)])
    y = cal.predict(PassCost(a=0.0, b=1e-4), lens, off) - 1e-4
    coef = cal.fit_pass(lens, off, y)
    assert coef.c == 0.0 and coef.a >= 0 and rel(coef.b, 1e-4) < 0.05
    CostModel(unit="seconds", forward=coef, backward=coef)  # valid for the cost model


def test_held_out_errors_are_per_point_relative_errors():
    obs = synthetic(30, 5)
    c = cal.Calibration(**TRUE)
    scaled = cal.Observations(obs.doc_lengths, obs.offsets,
                              {k: v * 1.25 for k, v in obs.seconds.items()})
    q = c.evaluate(scaled)
    for k in (*cal.PASSES, "total"):
        np.testing.assert_allclose(q[k]["errors"], 0.2, rtol=1e-12)  # |p - 1.25p| / 1.25p
        assert q[k]["rel_error"]["median"] == pytest.approx(0.2)
    assert c.evaluate(obs)["total"]["rel_error"]["max"] < 1e-12
    np.testing.assert_allclose(cal.relative_errors([1.0, 3.0], [2.0, 2.0]), [0.5, 0.5])
    assert cal.r_squared(np.array([1.0, 2, 3]), np.array([1.0, 2, 3])) == 1.0


def test_preset_round_trip_through_the_loader(tmp_path):
    c = cal.calibrate(synthetic(30, 7, noise=0.01))
    path = cal.write_preset(c, tmp_path / "models" / "tiny-cal.yaml", "unit test",
                            comments=["fit R^2 0.99"])
    for m in (load_cost_model(str(path)), CostModel.from_yaml(path)):
        assert m.unit == "seconds" and m.name == "tiny-cal"
        assert m.forward == c.forward and m.backward == c.backward
    m = load_cost_model(str(path))
    docs = [700, 12, 3000]
    lens, off = cal.to_csr([docs])
    f, b = m.microbatch_cost(docs)
    assert f == pytest.approx(cal.predict(c.forward, lens, off)[0], rel=1e-12)
    assert b == pytest.approx(cal.predict(c.backward, lens, off)[0], rel=1e-12)


def test_observations_json_round_trip_and_bad_input():
    obs = synthetic(10, 9)
    back = cal.Observations.from_json(json.loads(json.dumps(obs.to_json())))
    np.testing.assert_array_equal(back.doc_lengths, obs.doc_lengths)
    np.testing.assert_array_equal(back.offsets, obs.offsets)
    np.testing.assert_array_equal(back.seconds["backward"], obs.seconds["backward"])
    with pytest.raises(ValueError, match="microbatch 1 has no documents"):
        cal.to_csr([[1], []])
    with pytest.raises(ValueError, match="microbatch 0 document 1: length 0"):
        cal.to_csr([[5, 0]])
    lens, off = cal.to_csr([[1], [2], [3], [4]])
    with pytest.raises(ValueError, match="microbatch 2: measured time"):
        cal.fit_pass(lens, off, [1.0, 1.0, -1.0, 1.0])
    with pytest.raises(ValueError, match="3 times for 4 microbatches"):
        cal.fit_pass(lens, off, [1.0, 1.0, 1.0])


def test_sample_shapes_fit_capacity_and_vary():
    shapes = cal.sample_shapes(300, 2048, np.random.default_rng(0), max_docs=12)
    totals = np.array([sum(s) for s in shapes])
    counts = np.array([len(s) for s in shapes])
    assert totals.max() <= 2048 and min(min(s) for s in shapes) >= 16
    assert counts.min() == 1 and counts.max() >= 8
    assert totals.min() < 64 and totals.max() > 1800


def test_calibrate_tool_measures_a_real_module(tmp_path):
    """The tool runs the real module's forward and backward on every shape; the seconds come
    from a deterministic clock (a known formula of the shape), so the fit is checked exactly
    and nothing depends on how loaded the machine is. Real timing quality is a benchmark
    (tools/calibrate.py prints R^2 and held-out errors), not a test."""
    from tools import calibrate
    true = {"forward": (2e-9, 3e-6, 1e-4, 5e-6), "backward": (5e-9, 6e-6, 2e-4, 1e-5)}
    calls = []

    class ShapeClock(calibrate.PassTimer):
        def __call__(self, x):
            real_f, real_b = super().__call__(x)  # the real passes run (and are timed)
            assert real_f > 0 and real_b > 0
            lens = np.diff(x["cu_seqlens"].numpy()).astype(np.float64)
            calls.append(int(lens.sum()))
            a, b, c, d = true["forward"]
            f = a * (lens ** 2).sum() + b * lens.sum() + c + d * len(lens)
            a, b, c, d = true["backward"]
            return f, a * (lens ** 2).sum() + b * lens.sum() + c + d * len(lens)

    out = tmp_path / "tiny.yaml"
    args = calibrate.parse_args([
        "--module", "tools.tiny_lm:TinyLM",
        "--module-kwargs", '{"vocab": 32, "dim": 16, "layers": 1, "heads": 2}', "--vocab", "32",
        "--capacity", "256", "--fit-shapes", "12", "--held-out-shapes", "4", "--repeats", "2",
        "--out", str(out), "--json", str(tmp_path / "cal.json")])
    doc = calibrate.run(args, timer_cls=ShapeClock)
    assert len(calls) == (1 + 2) * 16  # warm-up + repeats over fit and held-out shapes
    m = load_cost_model(str(out))
    assert m.unit == "seconds" and m.forward.model_dump() == doc["forward"]
    for k in cal.PASSES:
        for f, want in zip("abcd", true[k]):
            assert rel(getattr(getattr(m, k), f), want) < 1e-6, (k, f)
    saved = json.loads((tmp_path / "cal.json").read_text())
    held = cal.Observations.from_json(saved["held_out_observations"])
    assert held.n == 4 and (held.seconds["forward"] > 0).all()
    # the reported held-out errors are those of the written preset on the held-out timings
    pred = cal.predict(m.backward, held.doc_lengths, held.offsets)
    np.testing.assert_allclose(saved["held_out_errors"]["backward"],
                               cal.relative_errors(pred, held.seconds["backward"]), rtol=1e-9)


def test_cli_fits_a_preset_from_observations(tmp_path, capsys):
    from balancer.cli import main
    obs_path = tmp_path / "obs.json"
    obs_path.write_text(json.dumps({"fit_observations": synthetic(40, 11).to_json(),
                                    "held_out_observations": synthetic(10, 12).to_json()}))
    out = tmp_path / "fitted.yaml"
    assert main(["calibrate", "--observations", str(obs_path), "--out", str(out)]) == 0
    m = load_cost_model(str(out))
    for k in cal.PASSES:
        for f in "abcd":
            assert rel(getattr(getattr(m, k), f), getattr(TRUE[k], f)) < 1e-8
    assert "held_out total" in capsys.readouterr().out.replace("  ", " ").replace("  ", " ")


def test_calibrate_tool_fits_per_layer_type(tmp_path):
    """--layer-types: one coefficient per attention pattern of the given model (here a
    config.json with full attention: the deterministic clock's a sum L^2 becomes 2a per causal
    pair and b - a per token, exactly)."""
    from tools import calibrate
    true = {"forward": (2e-9, 3e-6, 1e-4, 5e-6), "backward": (5e-9, 6e-6, 2e-4, 1e-5)}

    class ShapeClock(calibrate.PassTimer):
        def __call__(self, x):
            super().__call__(x)
            lens = np.diff(x["cu_seqlens"].numpy()).astype(np.float64)
            out = []
            for k in cal.PASSES:
                a, b, c, d = true[k]
                out.append(a * (lens ** 2).sum() + b * lens.sum() + c + d * len(lens))
            return tuple(out)

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "num_key_value_heads": 2,
                               "intermediate_size": 32, "vocab_size": 32}))
    out = tmp_path / "tiny.yaml"
    args = calibrate.parse_args([
        "--module", "tools.tiny_lm:TinyLM",
        "--module-kwargs", '{"vocab": 32, "dim": 16, "layers": 1, "heads": 2}', "--vocab", "32",
        "--capacity", "256", "--fit-shapes", "12", "--held-out-shapes", "4", "--repeats", "1",
        "--out", str(out), "--layer-types", str(cfg)])
    doc = calibrate.run(args, timer_cls=ShapeClock)
    m = load_cost_model(str(out))
    (t,) = m.attention
    assert t.kind == "full" and m.forward.a == 0.0
    for k in cal.PASSES:
        a, b, c, d = true[k]
        assert rel(getattr(t, k), 2 * a) < 1e-6
        pc = getattr(m, k)
        assert rel(pc.b, b - a) < 1e-6 and rel(pc.c, c) < 1e-6 and rel(pc.d, d) < 1e-6
    assert "attention full" in calibrate.format_quality(doc)
