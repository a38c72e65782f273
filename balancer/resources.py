"""Files the package finds by name: YAML presets (cost models, multimodal models, workloads,
layouts) and the real length distributions.

Both ship inside the package (``balancer/data/``, found with :mod:`importlib.resources`), so a
wheel installed anywhere finds them. ``configs/`` at the repository root is a symbolic link to
``balancer/data/configs``: one source of presets, so a preset edited or calibrated in a checkout
is the one the wheel ships (``tools/calibrate.py --name X`` writes there in a checkout). Lookup
order for a preset name: ``$BALANCER_CONFIG_DIR``, the package's presets, then the user's folder
of fitted presets (:func:`user_preset_dir`, where ``python -m balancer calibrate`` writes).
"""
from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path
from typing import Optional

_CHECKOUT = Path(__file__).resolve().parent.parent


def packaged(*parts: str) -> Path:
    """A path inside the installed package's ``data/`` folder (a real directory: the package is
    never imported from a zip)."""
    return Path(str(resources.files("balancer").joinpath("data", *parts)))


#: environment variable naming a preset root looked up before the checkout's and the package's
CONFIG_DIR_ENV = "BALANCER_CONFIG_DIR"


def _checkout_configs() -> Optional[Path]:
    """The checkout's ``configs/`` (a link to the package's presets), None outside a checkout."""
    d = _CHECKOUT / "configs"
    return d if d.is_dir() and (_CHECKOUT / "pyproject.toml").is_file() else None


def preset_dirs() -> list[Path]:
    """Preset roots in lookup order (each holds ``models/``, ``multimodal/``, ``workloads/``,
    ``layouts/``)."""
    out = []
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        out.append(Path(env))
    co = _checkout_configs()
    if co is not None and co.resolve() != packaged("configs").resolve():
        out.append(co)  # a configs/ folder that is not the link to the package's presets
    out.append(packaged("configs"))
    user = user_preset_dir()
    if user.is_dir() and all(user.resolve() != d.resolve() for d in out):
        out.append(user)  # last: a fitted preset never shadows a shipped one
    return out


def user_preset_dir() -> Path:
    """Where ``python -m balancer calibrate`` writes fitted presets: ``$BALANCER_CONFIG_DIR``,
    else ``$XDG_CONFIG_HOME/balancer`` (``~/.config/balancer``); looked up after the shipped
    presets (:func:`preset_dirs`), never inside the package."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(xdg) / "balancer"


#: a preset name: a plain file stem, never a path (no '/', no leading '.', at most 64 chars)
PRESET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_preset_name(name: str, flag: str = "--name") -> str:
    """``name`` when it is a plain preset name (:data:`PRESET_NAME`), else one ValueError line
    naming it."""
    if not isinstance(name, str) or not PRESET_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{flag} {name!r}: not a preset name (1 to 64 letters, digits, '.', "
                         f"'_', '-', starting with a letter or digit; no path)")
    return name


def shipped_preset(path) -> bool:
    """Whether ``path`` is (or resolves to) one of the presets shipped in the package."""
    p = Path(path)
    try:
        rp = p.resolve()
    except OSError:
        return False
    root = packaged("configs").resolve()
    return rp.is_file() and rp.is_relative_to(root)


def user_config_dir() -> Path:
    """Where new presets are written by default (calibration): ``$BALANCER_CONFIG_DIR``, the
    checkout's ``configs/`` (the package's own presets, so the next wheel ships the new one), or
    ``./configs`` outside a checkout (never inside an installed package)."""
    env = os.environ.get(CONFIG_DIR_ENV)
    if env:
        return Path(env)
    return _checkout_configs() or Path.cwd() / "configs"


def preset_path(name_or_path: str, subdir: str) -> Optional[Path]:
    """A YAML file given by path, or the first ``<root>/<subdir>/<name>.yaml`` over
    :func:`preset_dirs`; None if neither exists."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    for root in preset_dirs():
        f = root / subdir / f"{name_or_path}.yaml"
        if f.is_file():
            return f
    return None


def preset_names(subdir: str, pattern: str = "*.yaml") -> list[str]:
    """Every preset name under ``subdir`` over all roots, sorted."""
    names: set[str] = set()
    for root in preset_dirs():
        d = root / subdir
        if d.is_dir():
            names.update(p.stem for p in d.glob(pattern))
    return sorted(names)


__all__ = ["PRESET_NAME", "check_preset_name", "packaged", "preset_dirs", "preset_names",
           "preset_path", "shipped_preset", "user_config_dir", "user_preset_dir"]
