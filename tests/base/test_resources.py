"""What the package finds by name ships inside it: the presets (configs/ is a link to them), the real workloads
bit for bit, and lookups that need no folder outside the package."""
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

from balancer import load_cost_model, resources, workloads
from balancer.multimodal import cost as mm_cost, workloads as mm_workloads
from balancer.cost.model import available_presets

ROOT = Path(__file__).resolve().parents[2]


def test_configs_is_the_package_presets():
    # one source of presets: the checkout's configs/ is a relative symbolic link to the package
    # data, so a preset edited or calibrated there (tools/calibrate.py --name X) is what the
    # wheel ships, with no copy to keep equal
    configs = ROOT / "configs"
    assert configs.is_symlink(), "configs/ must be a symbolic link to balancer/data/configs"
    assert not os.path.isabs(os.readlink(configs))  # resolves in a clone anywhere
    assert configs.resolve() == resources.packaged("configs").resolve()
    assert {p.name for p in configs.iterdir()} >= {"models", "layouts", "multimodal", "workloads"}


def test_a_new_preset_in_a_checkout_is_package_data():
    # where calibration writes by default in a checkout, and each preset root once
    assert resources.user_config_dir().resolve() == resources.packaged("configs").resolve()
    roots = [d.resolve() for d in resources.preset_dirs()]
    assert len(roots) == len(set(roots)), roots


# sha256 of the int32 bytes of the real length arrays as first published (the shipped .npz must
# hold exactly those)
REAL_SHA = {"wikipedia": ("db8342e4ec2c74b3", 1_000_000),
            "wlbllm": ("6fc115d4fbb53751", 99_519),
            "prolong": ("4111030c4176ebad", 77_932)}


@pytest.mark.parametrize("name", sorted(REAL_SHA))
def test_real_workloads_ship_bit_for_bit(name):
    arr = workloads.load(name)
    digest, n = REAL_SHA[name]
    assert arr.dtype == np.int64 and arr.shape == (n,)
    assert hashlib.sha256(arr.astype(np.int32).tobytes()).hexdigest()[:16] == digest
    assert name in workloads.available()


def test_workload_lookup_needs_no_outside_folder(monkeypatch, tmp_path):
    assert workloads.WORKLOADS_ENV not in os.environ  # tests/conftest.py removed it
    monkeypatch.setattr(resources, "_CHECKOUT", tmp_path)  # as if installed from a wheel
    assert set(workloads.REAL) <= set(workloads.available())
    assert workloads.load("wlbllm", n=10, seed=1).shape == (10,)


def test_extra_workload_folder_takes_precedence(monkeypatch, tmp_path):
    np.save(tmp_path / "mine_lengths.npy", np.array([5, 6, 7], np.int32))
    monkeypatch.setenv(workloads.WORKLOADS_ENV, str(tmp_path))
    assert workloads.load("mine").tolist() == [5, 6, 7]
    assert "wlbllm" in workloads.available()


def test_every_preset_loads_from_the_package_alone(monkeypatch, tmp_path):
    assert resources.CONFIG_DIR_ENV not in os.environ  # tests/conftest.py removed it
    monkeypatch.setattr(resources, "_CHECKOUT", tmp_path)  # no checkout configs/
    assert resources.preset_dirs() == [resources.packaged("configs")]
    names = available_presets()
    assert {"llama-7b", "llama-70b", "tiny-lm-cpu", "quadratic-64k"} <= set(names)
    for name in names:
        assert load_cost_model(name).name
    for name in mm_cost.available_presets():
        assert mm_cost.load_mm_cost_model(name).name
    assert mm_workloads.available()
    for name in mm_workloads.available():
        assert mm_workloads.load_workload(name)
    # new presets never go into the installed package
    monkeypatch.chdir(tmp_path)
    assert resources.user_config_dir() == tmp_path / "configs"


def test_config_dir_env_comes_first(monkeypatch, tmp_path):
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "llama-7b.yaml").write_text("name: mine\na: 1.0\nb: 2.0\n")
    monkeypatch.setenv(resources.CONFIG_DIR_ENV, str(tmp_path))
    assert resources.preset_path("llama-7b", "models") == tmp_path / "models" / "llama-7b.yaml"
