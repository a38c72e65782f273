"""The closed loop's measured-vs-predicted report (``python -m balancer report --measured FILE``):
reads the JSON lines an :class:`~balancer.loader.online.OnlineCalibrator` writes (one
``{"type": "step"}`` per step, one ``{"type": "refit"}`` per refit) and draws, per step, the
predicted and measured step time (the slowest rank's: what the step waits for) and the DP
imbalance (slowest rank / mean), and every coefficient over time, relative to its last value.
Writes ``measured.json`` (the figures) and ``measured.png``."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_measured(path) -> tuple[list[dict], list[dict]]:
    """``(steps, refits)`` of a JSON-lines file, each sorted by step. Raises a ValueError naming
    the line of anything that is not a step or a refit record."""
    steps, refits = [], []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e})") from None
        kind = rec.get("type") if isinstance(rec, dict) else None
        if kind == "step":
            steps.append(rec)
        elif kind == "refit":
            refits.append(rec)
        else:
            raise ValueError(f"{path}:{i}: a record of type {kind!r}, expected 'step' or 'refit'")
    if not steps:
        raise ValueError(f"{path}: no step records")
    return sorted(steps, key=lambda r: r["step"]), sorted(refits, key=lambda r: r["step"])


def summarize(steps: list[dict], refits: list[dict], tail: int = 10) -> dict:
    """Per-step series and the first/last figures of a measured run."""
    meas = np.array([max(r["measured_s"]) for r in steps])
    pred = np.array([max(r["predicted_s"]) for r in steps])
    err = np.array([r["prediction_error"] for r in steps])
    imb = np.array([r["imbalance_measured"] for r in steps])
    return {"steps": [r["step"] for r in steps],
            "measured_step_s": meas.tolist(), "predicted_step_s": pred.tolist(),
            "prediction_error": err.tolist(), "imbalance_measured": imb.tolist(),
            "imbalance_predicted": [r["imbalance_predicted"] for r in steps],
            "prediction_error_first": float(np.median(err[:tail])),
            "prediction_error_last": float(np.median(err[-tail:])),
            "imbalance_measured_last": float(np.mean(imb[-tail:])),
            "refits": [{k: r[k] for k in ("step", "first_replanned_step", "columns", "forward",
                                          "backward", "fit_error", "ranks_agree")}
                       for r in refits]}


def plot_measured(summary: dict, path) -> None:
    """Three panels: step time predicted vs measured; DP imbalance predicted vs measured;
    coefficients (forward + backward) over the refits, relative to the last."""
    from .plots import _plt
    plt = _plt()
    fig, ax = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    x = summary["steps"]
    ax[0].plot(x, summary["measured_step_s"], label="measured (slowest rank)")
    ax[0].plot(x, summary["predicted_step_s"], label="predicted (slowest rank)")
    ax[0].set_ylabel("step compute, s")
    ax[0].legend()
    ax[1].plot(x, summary["imbalance_measured"], label="measured")
    ax[1].plot(x, summary["imbalance_predicted"], label="predicted")
    ax[1].set_ylabel("DP imbalance (max / mean)")
    ax[1].legend()
    refits = summary["refits"]
    if refits:
        rx = [r["step"] for r in refits]
        coef = np.array([np.add(r["forward"], r["backward"]) for r in refits])
        last = np.where(coef[-1] > 0, coef[-1], 1.0)
        for j, name in enumerate(refits[-1]["columns"]):
            ax[2].plot(rx, coef[:, j] / last[j], marker="o", label=name)
        ax[2].legend()
    ax[2].set_ylabel("coefficient / last")
    ax[2].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_measured(path, out, plots: bool = True) -> dict:
    """Read ``path``, write ``out/measured.json`` (and ``measured.png``); returns the summary."""
    steps, refits = read_measured(path)
    summary = summarize(steps, refits)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "measured.json").write_text(json.dumps(summary, indent=1))
    files = [str(out / "measured.json")]
    if plots:
        plot_measured(summary, out / "measured.png")
        files.append(str(out / "measured.png"))
    summary["files"] = files
    return summary


__all__ = ["plot_measured", "read_measured", "summarize", "write_measured"]
