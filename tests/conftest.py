import fcntl
import os
import tempfile
from pathlib import Path

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
# fitted presets are looked up in the user's folder ($XDG_CONFIG_HOME/balancer): an empty one
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="balancer-tests-xdg-")

settings.register_profile("ci", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Every kernel compiled (or loaded) once per test process before its first test, the
    package's one warm-up: spawned ranks then load them from the disk cache instead of
    compiling side by side. Under xdist the first worker compiles while the others wait on a
    file lock, then load what it wrote. The cache is the package's usual one (keyed by the
    sources: it cannot serve stale code), so the demo's compile serves the suite too."""
    from balancer.planning.warmup import warmup
    from packing._jit import CACHE_DIR
    lock = Path(CACHE_DIR or tempfile.gettempdir()) / "balancer-tests.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            return warmup()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def wlbllm():
    from balancer import workloads
    return workloads.load("wlbllm")  # shipped in the package: no folder outside the repo


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
