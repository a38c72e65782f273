"""``python -m balancer calibrate``: fit a seconds-unit cost preset from timings already measured
(by tools/calibrate.py on any machine, or by a user's own harness), without torch.

The observations file is JSON, either ``{"microbatches": [[L, ...], ...], "forward": [s, ...],
"backward": [s, ...]}`` or the ``--json`` output of tools/calibrate.py (its
``fit_observations`` and ``held_out_observations`` are used)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..cost.calibration import PASSES, Observations, calibrate, write_preset
from .commands import command
from ..cost.model import BUILTIN
from ..resources import (check_preset_name, packaged, preset_path, shipped_preset,
                         user_preset_dir)


def _load(path: str) -> tuple[Observations, Observations | None]:
    """The observations of a JSON file; every problem is a one-line ValueError naming it."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the observations ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(doc).__name__}")
    try:
        if "fit_observations" in doc:
            held = doc.get("held_out_observations")
            out = (Observations.from_json(doc["fit_observations"]),
                   Observations.from_json(held) if held else None)
        else:
            out = Observations.from_json(doc), None
    except KeyError as e:
        raise ValueError(f"{path}: missing key {e.args[0]!r} (need microbatches, "
                         f"{', '.join(PASSES)})") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None
    for obs in out:
        if obs is None:
            continue
        for k in PASSES:
            t = obs.seconds[k]
            bad = np.flatnonzero(~np.isfinite(t) | (t <= 0))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"{path}: {k} time of microbatch {i} is {float(t[i])!r}; "
                                 f"times must be finite and positive (seconds)")
    return out


def _args(p):
    p.add_argument("--observations", required=True, help="JSON of measured microbatch times")
    p.add_argument("--held-out", default=None, help="JSON of held-out times (evaluated only)")
    p.add_argument("--name", default="calibrated",
                   help="preset name, written to the user's presets (models/<name>.yaml under "
                        "$BALANCER_CONFIG_DIR or ~/.config/balancer) and loaded by that name; "
                        "never a shipped preset's")
    p.add_argument("--out", default=None, help="preset path (default: the user's "
                                               "models/<name>.yaml, see --name)")
    p.add_argument("--description", default="", help="description stored in the preset")


def destination(name: str, out) -> Path:
    """Where a fitted preset is written: ``out``, or ``<user presets>/models/<name>.yaml``.
    Refuses a name that is not a plain preset name and any destination that is a shipped
    preset (a fitted seconds model must never replace, or shadow, the preset of that name)."""
    if out is None:
        check_preset_name(name)
        shipped = packaged("configs") / "models" / f"{name}.yaml"
        if name in BUILTIN or shipped.is_file():
            raise ValueError(f"--name {name}: a shipped preset has that name; calibration never "
                             f"overwrites or shadows one (choose another --name)")
        path = user_preset_dir() / "models" / f"{name}.yaml"
        if preset_path(name, "models") not in (None, path):
            raise ValueError(f"--name {name}: the preset {preset_path(name, 'models')} has that "
                             f"name and would shadow the fitted one (choose another --name)")
        return path
    path = Path(out)
    if shipped_preset(path):
        raise ValueError(f"--out {out}: a shipped preset; calibration never overwrites one "
                         f"(write the fitted model elsewhere)")
    return path


def _run(args) -> int:
    out = destination(args.name, args.out)   # refused before any fitting
    fit, held = _load(args.observations)
    if args.held_out:
        held = _load(args.held_out)[0]
    cal = calibrate(fit, held)
    comments = []
    for s, q in cal.quality.items():
        for k in (*PASSES, "total"):
            e = q[k]["rel_error"]
            line = (f"{s:8s} {k:8s} R^2 {q[k]['r2']:.4f}  relative error median "
                    f"{100 * e['median']:.2f}%  p90 {100 * e['p90']:.2f}%  max {100 * e['max']:.2f}%")
            comments.append(line)
            print(line)
    write_preset(cal, out, args.description or f"fitted from {args.observations}", comments)
    for k in PASSES:
        c = getattr(cal, k)
        print(f"{k:8s} a={c.a:.6g} b={c.b:.6g} c={c.c:.6g} d={c.d:.6g}")
    print(f"wrote {out}")
    return 0


command("calibrate", "fit a seconds cost preset (a*sum L^2 + b*sum L + c per pass) from "
                     "measured microbatch times")((_args, _run))
