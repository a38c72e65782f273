"""The closed loop's robust refit (balancer.cost.refit): times made by a known model from a
deterministic synthetic clock give back that model's coefficients exactly, stalls and warm-up
steps do not move them, and the fit stays non-negative on any data."""
import numpy as np
import pytest

from balancer.cost.attention import AttentionTerm
from balancer.cost.blocks import microbatch_costs
from balancer.cost.calibration import sample_shapes, to_csr
from balancer.cost.model import CostModel, PassCost
from balancer.cost.refit import coefficients, predict_total, refit, robust_nnls

TRUE = CostModel(name="true", unit="seconds",
                 forward=PassCost(a=2e-8, b=1.2e-5, c=1.5e-3, d=1e-4),
                 backward=PassCost(a=3e-8, b=2.5e-5, c=1e-3, d=2e-4))
LAYERED = CostModel(name="layered", unit="seconds", forward=PassCost(b=1e-5, c=1e-3, d=5e-5),
                    backward=PassCost(b=2e-5, c=2e-3, d=1e-4),
                    attention=(AttentionTerm(kind="full", forward=3e-8, backward=6e-8),
                               AttentionTerm(kind="sliding", window=256, forward=2e-8,
                                             backward=4e-8)))


def shapes(n=60, seed=0, capacity=4096):
    return to_csr(sample_shapes(n, capacity, np.random.default_rng(seed)))


def close(model, truth, rtol=1e-9):
    for got, want in zip(coefficients(model), coefficients(truth)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-18)


@pytest.mark.parametrize("truth", [TRUE, LAYERED], ids=["aL2+bL", "per-layer-type"])
def test_exact_recovery_per_pass(truth):
    lens, off = shapes()
    f, b = microbatch_costs(truth, lens, off)
    # a wrong template of the same form: the coefficients come from the times alone
    template = CostModel.quadratic(65536) if not truth.attention else truth.model_copy(
        update={"attention": tuple(t.model_copy(update={"forward": 1.0, "backward": 2.0})
                                   for t in truth.attention)})
    got = refit(template, lens, off, forward=f, backward=b)
    close(got, truth)
    assert got.unit == "seconds"


def test_exact_recovery_of_the_total_split_by_the_template():
    lens, off = shapes(seed=1)
    f, b = microbatch_costs(TRUE, lens, off)
    # only forward + backward measured (the HF Trainer's training_step): the split per
    # coefficient is the template's, so a template with the true ratios gives the truth back
    template = TRUE.model_copy(update={"name": "shape only"})
    got = refit(template, lens, off, total=f + b)
    close(got, TRUE)


def test_stalls_and_dropped_steps_do_not_move_the_fit():
    lens, off = shapes(n=80, seed=2)
    f, b = microbatch_costs(TRUE, lens, off)
    rng = np.random.default_rng(3)
    stalled = rng.choice(80, 8, replace=False)  # 10% of the microbatches waited 3-8x longer
    fs, bs = f.copy(), b.copy()
    fs[stalled] *= rng.uniform(3, 8, 8)
    bs[stalled] *= rng.uniform(3, 8, 8)
    plain = refit(TRUE, lens, off, forward=fs, backward=bs, iterations=1)  # no reweighting
    robust = refit(TRUE, lens, off, forward=fs, backward=bs, iterations=30)
    close(robust, TRUE, rtol=1e-6)
    assert not np.allclose(coefficients(plain)[0], coefficients(TRUE)[0], rtol=1e-3)
    # weight 0 (the first steps' compilation): left out entirely, exactly
    w = np.ones(80)
    w[stalled] = 0.0
    close(refit(TRUE, lens, off, forward=fs, backward=bs, weight=w, iterations=1), TRUE)


def test_non_negative_and_deterministic_on_noisy_data():
    lens, off = shapes(n=50, seed=4)
    rng = np.random.default_rng(5)
    t = predict_total(TRUE, lens, off) * rng.lognormal(0, 0.4, 50)
    a = refit(CostModel.quadratic(65536), lens, off, total=t)
    b = refit(CostModel.quadratic(65536), lens, off, total=t)
    assert a == b
    for c in coefficients(a):
        assert (c >= 0).all()


def test_bad_observations_are_named():
    lens, off = shapes(n=10)
    t = predict_total(TRUE, lens, off)
    t[3] = 0.0
    with pytest.raises(ValueError, match="observation 3"):
        robust_nnls(np.ones((10, 2)), t)
    with pytest.raises(ValueError, match="at least 4"):
        refit(TRUE, lens, off, total=np.ones(10), weight=np.r_[np.ones(3), np.zeros(7)])
    with pytest.raises(ValueError, match="not both"):
        refit(TRUE, lens, off, total=np.ones(10), forward=np.ones(10))
