"""PNG plots of an imbalance report (matplotlib, Agg backend, no display needed).

Every figure has a title, axis labels with units and a legend; strategies keep one colour
across figures. Inputs are the ``report`` dict and per-strategy ``details`` of
:func:`balancer.report.analyze`.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from . import metrics
from ..cost.model import CostModel

DPI = 110
MAX_GANTT_RANKS = 8


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _colors(names):
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _valid(report, details):
    return [n for n, s in report["strategies"].items() if s.get("valid") and details.get(n)]


def _time_axis(details: dict, name: str, x):
    """Values in seconds (ms when small) when the cost model has a clock, else cost units."""
    to_s = details[name]["to_seconds"]
    if to_s is None:
        return np.asarray(x), "cost units"
    return to_s(x), "s"


def _rolling(y, w):
    if w <= 1 or y.shape[0] < 2 * w:
        return None
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = (c[w:] - c[:-w]) / w
    return np.concatenate([np.full(w - 1, np.nan), out])


def plot_steps(report, details, path) -> None:
    """Microbatch imbalance, DP imbalance and estimated step time of every step."""
    plt = _plt()
    names = _valid(report, details)
    col = _colors(report["strategies"])
    fig, axes = plt.subplots(3, 1, figsize=(11, 9), sharex=True)
    n_steps = max(details[n]["step_time"].shape[0] for n in names)
    w = n_steps // 50 if n_steps >= 300 else 1
    unit = "cost units"
    for n in names:
        d = details[n]
        st, unit = _time_axis(details, n, d["step_time"])
        for ax, y, key in ((axes[0], d["step_mb_imbalance"], "microbatch_imbalance"),
                           (axes[1], d["step_dp_imbalance"], "dp_imbalance"),
                           (axes[2], st, None)):
            x = np.arange(y.shape[0])
            smooth = _rolling(np.asarray(y, float), w)
            mean = report["strategies"][n][key]["mean"] if key else float(np.mean(y))
            label = f"{n} (mean {mean:.3g})"
            if smooth is None:
                ax.plot(x, y, color=col[n], lw=1.0, label=label)
            else:
                ax.plot(x, y, color=col[n], lw=0.5, alpha=0.25)
                ax.plot(x, smooth, color=col[n], lw=1.6, label=label)
    axes[0].set_ylabel("max microbatch cost x n / total\n(1 = even)")
    axes[0].set_title("Microbatch imbalance per step")
    axes[1].set_ylabel("slowest / mean DP rank time\n(1 = even)")
    axes[1].set_title("DP imbalance per step" + (" (1F1B-simulated)" if report["layout"]["pp"] > 1
                                                 else ""))
    axes[2].set_ylabel(f"step time ({unit})")
    axes[2].set_title("Estimated step time (slowest DP rank)")
    axes[2].set_xlabel("training step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncol=2)
    for ax in axes[:2]:
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
    if w > 1:
        fig.text(0.01, 0.005, f"thick lines: moving average over {w} steps; thin: every step",
                 fontsize=8)
    fig.suptitle(_subtitle(report), fontsize=10)
    # fixed margins: tight_layout costs more than drawing the figure
    fig.subplots_adjust(left=0.09, right=0.98, top=0.91, bottom=0.07, hspace=0.3)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def _subtitle(report) -> str:
    w, lay = report["workload"], report["layout"]
    return (f"{w.get('name') or 'workload'}: {w['samples']:,} samples | dp={lay['dp']} "
            f"pp={lay['pp']} cp={lay['cp']}, {lay['microbatches']} microbatches/rank, capacity "
            f"{lay['capacity']:,} tokens | cost model {report['cost_model']}")


def plot_ranks(report, details, path) -> None:
    """Distribution of per-DP-rank step time and of microbatch cost, relative to the mean."""
    plt = _plt()
    names = _valid(report, details)
    col = _colors(report["strategies"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 5))
    data = []
    for n in names:
        t = details[n]["rank_time"]
        mean = t.mean(axis=1, keepdims=True)
        data.append((t / np.where(mean > 0, mean, 1)).ravel())
    bp = a1.boxplot(data, whis=(1, 99), showfliers=False, patch_artist=True, widths=0.6)
    for patch, n in zip(bp["boxes"], names):
        patch.set_facecolor(col[n])
        patch.set_alpha(0.6)
    for i, (n, x) in enumerate(zip(names, data)):
        a1.plot(i + 1, x.max(), marker="v", color="black", ms=6,
                label="largest value" if i == 0 else None)
    a1.set_xticks(range(1, len(names) + 1), names)
    a1.axhline(1.0, color="black", lw=0.8, ls=":", label="even (1.0)")
    a1.set_ylabel("DP rank step time / step mean rank time")
    a1.set_xlabel("strategy")
    a1.set_title("Per-rank time relative to its step's mean\n(box: quartiles, whiskers: p1-p99)")
    a1.legend(fontsize=8, loc="upper right")
    a1.grid(alpha=0.3, axis="y")
    hi = max(float(np.percentile(details[n]["microbatch_cost"] /
                                 details[n]["microbatch_cost"].mean(), 99.9)) for n in names)
    bins = np.linspace(0, max(hi, 1.5), 60)
    for n in names:
        c = details[n]["microbatch_cost"]
        a2.hist(c / c.mean(), bins=bins, histtype="step", lw=1.6, color=col[n],
                label=f"{n} (CV {c.std() / c.mean():.2f})")
    a2.set_yscale("log")
    a2.set_xlabel("microbatch cost / mean microbatch cost")
    a2.set_ylabel("microbatches (log scale)")
    a2.set_title("Microbatch cost distribution (fwd + bwd, cost model)")
    a2.legend(fontsize=8)
    a2.grid(alpha=0.3)
    fig.suptitle(_subtitle(report), fontsize=10)
    fig.subplots_adjust(left=0.07, right=0.98, top=0.82, bottom=0.11, wspace=0.22)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_gantt(report, details, path) -> None:
    """The 1F1B timeline of every strategy's worst step: one row per (DP rank, stage)."""
    plt = _plt()
    from matplotlib.patches import Patch
    names = _valid(report, details)
    lay = report["layout"]
    dp, pp = lay["dp"], lay["pp"]
    shown = min(dp, MAX_GANTT_RANKS)
    rows = shown * (pp + 1)
    fig, axes = plt.subplots(len(names), 1, figsize=(12, 1.3 + len(names) * (0.8 + 0.075 * rows)),
                             sharex=True, squeeze=False)
    unit = "cost units"
    fc, bc = "#6baed6", "#fd8d3c"
    for ax, n in zip(axes[:, 0], names):
        d = details[n]
        tl = [metrics.pipeline_timeline(f, b, pp) for f, b in zip(d["worst_fwd"], d["worst_bwd"])]
        ends = np.array([t["end"].max() if t["end"].size else 0.0 for t in tl])
        ranks = list(range(dp))
        if dp > shown:  # the slowest and the fastest ranks
            o = np.argsort(-ends)
            ranks = sorted(set(o[: shown // 2].tolist()) | set(o[-(shown - shown // 2):].tolist()))
        yt, yl = [], []
        for i, r in enumerate(ranks):
            t = tl[r]
            st, unit = _time_axis(details, n, t["start"])
            en, _ = _time_axis(details, n, t["end"])
            for s in range(pp):
                y = i * (pp + 1) + s
                for k, c in ((0, fc), (1, bc)):
                    sel = (t["stage"] == s) & (t["kind"] == k)
                    ax.broken_barh(list(zip(st[sel], en[sel] - st[sel])), (y - 0.4, 0.8),
                                   facecolors=c, edgecolors="white", linewidth=0.3)
            yt.append(i * (pp + 1) + (pp - 1) / 2)
            yl.append(f"rank {r}")
        step_end, _ = _time_axis(details, n, ends.max())
        ax.axvline(step_end, color="red", lw=1.2, ls="--")
        ax.set_yticks(yt, yl, fontsize=7)
        ax.set_ylim(rows - 0.5, -1)
        s = report["strategies"][n]["worst_step"]
        some = f" ({shown} of {dp} ranks: the slowest and the fastest)" if dp > shown else ""
        ax.set_title(f"{n}{some}: step {s['step']} takes {float(step_end):.3g} {unit}; DP imbalance "
                     f"{s['dp_imbalance']:.3f}; {s['inflation']:.2f}x the step's cost spread "
                     f"evenly over all GPUs", fontsize=10)
        ax.grid(alpha=0.3, axis="x")
    axes[-1, 0].set_xlabel(f"time within the step ({unit})")
    rows_label = "DP rank (rows: stages 0..pp-1, top first)" if pp > 1 else "DP rank"
    fig.supylabel(rows_label, fontsize=9)
    handles = [Patch(color=fc, label="forward"), Patch(color=bc, label="backward"),
               plt.Line2D([], [], color="red", ls="--", label="step end (slowest rank)")]
    fig.legend(handles=handles, loc="lower right", fontsize=8, ncol=3, frameon=False,
               bbox_to_anchor=(0.99, 0.0))
    what = "1F1B pipeline timeline" if pp > 1 else "Timeline (no pipeline)"
    fig.suptitle(f"{what} of each strategy's worst step\n" + _subtitle(report),
                 fontsize=11)
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.08, right=0.98, top=1 - 0.95 / height, bottom=0.55 / height,
                        hspace=0.45 / (0.8 + 0.075 * rows) * len(names) / max(len(names), 1))
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_lengths(report, lengths: np.ndarray, cost: CostModel, path) -> None:
    """Histogram of sample lengths with the cumulative share of samples, tokens and cost."""
    plt = _plt()
    lengths = np.sort(np.asarray(lengths, dtype=np.int64))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    hi = max(int(lengths[-1]), 2)
    bins = np.unique(np.logspace(0, np.log10(hi) + 1e-9, 70).astype(np.int64))
    counts, _ = np.histogram(lengths, bins=bins)
    ax.stairs(counts, bins, fill=True, color="#9ecae1", label="samples")
    ax.stairs(counts, bins, color="#3182bd", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("sample length (tokens, log scale)")
    ax.set_ylabel("samples per bin (log scale)")
    cap = report["layout"]["capacity"]
    ax.axvline(cap, color="red", ls="--", lw=1.2, label=f"microbatch capacity {cap:,}")
    ax2 = ax.twinx()
    f, b = cost.doc_costs(lengths)
    for y, c, lab in ((np.arange(1, lengths.size + 1) / lengths.size, "black", "samples"),
                      (np.cumsum(lengths) / lengths.sum(), "green", "tokens"),
                      (np.cumsum(f + b) / (f.sum() + b.sum()), "purple",
                       f"cost ({cost.name}, whole samples)")):
        grid = np.unique(np.logspace(0, np.log10(hi), 400))
        k = np.searchsorted(lengths, grid, side="right")  # samples with length <= grid
        ax2.plot(grid, np.where(k > 0, y[np.maximum(k - 1, 0)], 0.0), color=c, lw=1.5,
                 label=f"cumulative share of {lab}")
    ax2.set_ylim(0, 1.02)
    ax2.set_ylabel("cumulative share (samples up to this length)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="center left", fontsize=8)
    w = report["workload"]
    ax.set_title(f"Sample lengths: {w.get('name') or 'workload'}, {w['samples']:,} samples, "
                 f"{w['tokens']:,} tokens")
    ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.08, right=0.92, top=0.93, bottom=0.1)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def write_all(report, details, lengths, cost, out: Path) -> dict:
    """Write every plot that has data; returns ``{kind: path}``."""
    files = {}
    if _valid(report, details):
        for kind, fn in (("plot_steps", plot_steps), ("plot_ranks", plot_ranks),
                         ("plot_gantt", plot_gantt)):
            p = out / f"{kind[5:]}.png"
            fn(report, details, p)
            files[kind] = str(p)
    if np.asarray(lengths).size:
        p = out / "lengths.png"
        plot_lengths(report, lengths, cost, p)
        files["plot_lengths"] = str(p)
    return files
