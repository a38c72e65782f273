"""Where ``calibrate`` writes a fitted preset (issue #30 item 5): never over a shipped preset
(``--name llama-7b`` made ``load_cost_model('llama-7b')`` return the fitted model), names
confined to a plain preset name (``--name ../../../x`` wrote outside configs/models), and fitted
presets go to the user's preset folder, where ``load_cost_model(name)`` finds them."""
import hashlib
import json

import pytest

from balancer import resources
from balancer.cli import main
from balancer.cost import calibration as cal
from balancer.cost.model import load_cost_model
from tests.cost.test_calibration import synthetic

SHIPPED = resources.packaged("configs") / "models"


def _digests():
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(SHIPPED.glob("*.yaml"))}


@pytest.fixture
def obs(tmp_path, monkeypatch):
    # the user's preset folder for this test only (hermetic: never the machine's ~/.config)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    p = tmp_path / "obs.json"
    p.write_text(json.dumps(synthetic(30, 5).to_json()))
    return p


def _cli(capsys, *argv):
    rc = main(list(argv))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name", ["llama-7b", "tiny-lm-cpu", "quadratic-64k"])
def test_a_shipped_preset_is_never_overwritten(obs, capsys, name):
    before, want = _digests(), load_cost_model(name)
    rc, err = _cli(capsys, "calibrate", "--observations", str(obs), "--name", name)
    assert rc == 2 and f"--name {name}" in err and "shipped preset" in err, err
    assert len(err.strip().splitlines()) == 1
    assert _digests() == before
    assert load_cost_model(name) == want
    rc, err = _cli(capsys, "calibrate", "--observations", str(obs), "--out",
                   str(SHIPPED / "llama-7b.yaml"))
    assert rc == 2 and "shipped preset" in err, err
    assert _digests() == before


@pytest.mark.parametrize("name", ["../../../x", "/tmp/x", "a/b", "..", ".hidden", "", "x" * 65,
                                  "x\x00y", "bad name"])
def test_preset_names_are_confined(obs, tmp_path, capsys, name):
    before = _digests()
    rc, err = _cli(capsys, "calibrate", "--observations", str(obs), "--name", name)
    assert rc == 2 and "--name" in err and "not a preset name" in err, err
    assert _digests() == before
    assert not list(tmp_path.rglob("x.yaml"))


def test_a_fitted_preset_goes_to_the_user_folder_and_loads_by_name(obs, tmp_path, capsys):
    before = _digests()
    rc, err = _cli(capsys, "calibrate", "--observations", str(obs), "--name", "my-gpu.v2")
    assert rc == 0, err
    f = tmp_path / "xdg" / "balancer" / "models" / "my-gpu.v2.yaml"
    assert f.is_file()
    assert _digests() == before and not (SHIPPED / "my-gpu.v2.yaml").exists()
    m, want = load_cost_model("my-gpu.v2"), cal.calibrate(synthetic(30, 5))
    assert m.forward == want.forward and m.backward == want.backward
    assert "my-gpu.v2" in resources.preset_names("models")
    # re-fitting one's own preset under the same name replaces it
    assert _cli(capsys, "calibrate", "--observations", str(obs), "--name", "my-gpu.v2")[0] == 0
