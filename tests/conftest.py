import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from balancer.resources import CONFIG_DIR_ENV
from balancer.workloads import WORKLOADS_ENV

# Hermetic: presets and workloads come from the repository alone, whatever the environment of
# the machine running the suite names (removed before any test or subprocess reads it; a test
# that exercises the override points it at its own tmp_path).
for _var in (WORKLOADS_ENV, CONFIG_DIR_ENV):
    os.environ.pop(_var, None)

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def wlbllm():
    from balancer import workloads
    return workloads.load("wlbllm")  # shipped in the package: no folder outside the repo


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
