import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def wlbllm():
    from balancer import workloads
    try:
        return workloads.load("wlbllm")
    except ValueError:  # no shared/ beside the checkout: a long-tailed stand-in under 128K
        return np.minimum(workloads.synthetic("lognormal-4k", 100_000), 124_913)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
