"""The hybrid DP x CP report: the figures of every hybrid-mode strategy on a workload
(:mod:`.figures`), as ``report.json``, ``report.md`` and three PNGs. ``python -m balancer report
--cp-mode hybrid ...`` (:mod:`balancer.cli.hybrid`) reads the flags and calls these.

The workload is planned in the fixed mode's epoch order (:func:`balancer.planning.planner.
epoch_order`) on the pool of ``D x C`` ranks with every hybrid-mode strategy
(the registry's cp_mode hybrid strategies: ``hybrid``, ``hybrid_stream``, ``megatron_hybrid`` and
fixed CP at every degree that tiles the pool). Written under the output folder:

* ``report.json``: workload, layout (``cp_mode: hybrid``, ``rank_capacity``, ``pool``), the CP
  cost model's figures, and per strategy: ``documents_cut``, ``exposed_comm_fraction``,
  ``est_step_time_total`` (seconds per GPU, barrier per round), the no-cut lower bound and its
  ratio, per-rank compute and exposed seconds, the group-size histogram, planning time; plus
  ``baselines``: ``hybrid``'s estimated step time over every other strategy's, and
  ``baselines_default`` the same for ``default_strategy`` (what cp_mode hybrid plans with when
  no strategy is named: ``hybrid_stream``);
* ``report.md``: the same as tables;
* ``hybrid_rank_time.png`` (per-rank compute vs exposed exchange of the default planner,
  ``hybrid``, Megatron's rule and the no-cut fixed degree), ``hybrid_group_sizes.png`` (group-size histogram),
  ``hybrid_step_time.png`` (estimated epoch time per strategy against the lower bound).

Every figure is recomputed from the plans' items by :func:`balancer.planning.hybrid.estimate`; a
plan that loses or duplicates a token of a document is reported ``"valid": false``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...config import PlannerConfig, renamed
from ...planning.hybrid import HYBRID_STRATEGIES, hybrid_config
from ...planning.stream import epoch_order
from ..build import write_md_json
from .figures import compare_hybrid, ours


@renamed(over_limit="over_length", model="cost")
def build_hybrid_report(lengths: np.ndarray, cost, n_ranks: int, batch_tokens: int,
                        names: list[str], *, config: PlannerConfig | None = None,
                        seed: int | None = None, max_delay: int | None = None,
                        layout: dict | None = None, workload: str | None = None,
                        over_length: str | None = None):
    """``(report dict, plot details, plans)`` of the hybrid-mode strategies ``names`` on
    ``lengths`` under the CP cost model ``cost``, with ``config`` and the keywords on top
    (:func:`~balancer.planning.hybrid.hybrid_config`: seed 0, ``max_delay`` 2,
    ``over_length="error"`` unless set; older names ``model=``, ``over_limit=``)."""
    config = hybrid_config(config, seed=seed, max_delay=max_delay, over_length=over_length)
    seed, max_delay, model = config.seed, config.max_delay, cost
    lengths = np.asarray(lengths, np.int64)
    order = epoch_order(lengths.shape[0], seed, 0)
    res, details, plans = compare_hybrid(lengths, cost, n_ranks, batch_tokens, names,
                                         config=config, order=order)
    hw = model.hardware
    report = {
        "cp_mode": "hybrid",
        "workload": {"name": workload, "samples": int(lengths.shape[0]),
                     "tokens": int(lengths.sum()), "longest": res["longest"]},
        "layout": {**(layout or {}), "cp_mode": "hybrid", "pool": int(n_ranks),
                   "rank_capacity": int(model.rank_capacity)},
        "batch_tokens": int(batch_tokens), "seed": int(seed), "max_delay": int(max_delay),
        "cost_model": model.cost.name,
        "cp_cost_model": {"gpus_per_node": hw.gpus_per_node, "overlap": hw.overlap,
                          "intra_node_bandwidth": hw.intra_node_bandwidth,
                          "inter_node_bandwidth": hw.inter_node_bandwidth,
                          "intra_node_latency": hw.intra_node_latency,
                          "inter_node_latency": hw.inter_node_latency,
                          "kv_bytes_per_token": model.kv_bytes_per_token(), "pp": model.pp},
        "est_step_time_unit": "seconds per GPU (CP cost model, barrier per round)",
        "no_cut_fixed": res["no_cut_fixed"], "best_fixed": res["best_fixed"],
        "default_strategy": res["default_strategy"],
        "strategies": res["strategies"],
    }
    valid = {n: b for n, b in res["strategies"].items() if b.get("valid")}
    # "baselines" (a stable key): the strategy of the per-batch planner, hybrid, against the rest
    if "hybrid" in valid:
        t = valid["hybrid"]["est_step_time_total"]
        report["baselines"] = {n: t / b["est_step_time_total"] for n, b in valid.items()
                               if n != "hybrid" and b["est_step_time_total"] > 0}
    d = res["default_strategy"]
    if d in valid:
        t = valid[d]["est_step_time_total"]
        report["baselines_default"] = {n: t / b["est_step_time_total"] for n, b in valid.items()
                                       if n != d and b["est_step_time_total"] > 0}
    return report, details, plans


def render_md(report: dict) -> str:
    """``report.md`` of a hybrid report (the dict of :func:`build_hybrid_report`)."""
    w, lay = report["workload"], report["layout"]
    out = [f"# Hybrid DP x CP report: {w.get('name') or '?'}", "",
           f"{w['samples']:,} documents, {w['tokens']:,} tokens, longest {w['longest']:,}; pool "
           f"of {lay['pool']} ranks (dp {lay.get('dp')} x cp {lay.get('cp')}), rank capacity "
           f"{lay['rank_capacity']:,} tokens, global batch {report['batch_tokens']:,} tokens; "
           f"cost model {report['cost_model']}, overlap {report['cp_cost_model']['overlap']}, "
           f"{report['cp_cost_model']['gpus_per_node']} GPUs per node.", "",
           f"Step times: {report['est_step_time_unit']}. The fixed degree that cuts nothing is "
           f"{report['no_cut_fixed']}; the fastest fixed degree is {report['best_fixed']} "
           f"(cutting trains something else: attention removed is the share of causal "
           f"query-key pairs the cuts took away).", "",
           "| strategy | valid | documents cut | attention removed | est. step time total | "
           "/ lower bound | no barrier | exposed comm | one exchange per group microbatch | "
           "rounds | rank max/mean | plan ms/batch (median, max) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, b in report["strategies"].items():
        if not b.get("valid"):
            out.append(f"| {n} | no: {'; '.join(b.get('problems', []))} |" + " |" * 10)
            continue
        pm = b["plan_ms_per_batch"]
        out.append(f"| {n} | yes | {b['documents_cut']} | {b['attention_removed']:.3f} | "
                   f"{b['est_step_time_total']:.4g} | {b['lower_bound_ratio']:.3f} | "
                   f"{b['est_step_time_total_async']:.4g} | {b['exposed_comm_fraction']:.3f} | "
                   f"{b['est_step_time_total_packed_exchange']:.4g} | {b['rounds']} | "
                   f"{b['per_rank']['max_over_mean']:.3f} | "
                   f"{pm['median']:.2f}, {pm['max']:.2f} |")
    if report.get("baselines"):
        out += ["", "## hybrid against the baselines", "",
                "| baseline | hybrid est. step time / baseline's |", "|---|---|"]
        out += [f"| {n} | {r:.3f} |" for n, r in report["baselines"].items()]
    d = report.get("default_strategy")
    if report.get("baselines_default") and d != "hybrid":
        out += ["", f"## {d} (the default planner) against the others", "",
                f"| strategy | {d} est. step time / strategy's |", "|---|---|"]
        out += [f"| {n} | {r:.3f} |" for n, r in report["baselines_default"].items()]
    out += ["", "## Per-rank compute vs exposed communication (seconds over the epoch)", "",
            "| strategy | compute min | compute max | exposed min | exposed max | exposed total "
            "/ busy |", "|---|---|---|---|---|---|"]
    for n, b in report["strategies"].items():
        if b.get("valid"):
            c, x = np.asarray(b["per_rank"]["compute_seconds"]), \
                np.asarray(b["per_rank"]["exposed_seconds"])
            out.append(f"| {n} | {c.min():.4g} | {c.max():.4g} | {x.min():.4g} | {x.max():.4g} "
                       f"| {b['exposed_comm_fraction']:.3f} |")
    out += ["", "## Group sizes (groups that ran something, over the epoch)", "",
            "| strategy | " + " | ".join(f"{1 << k}" for k in range(lay['pool'].bit_length()))
            + " |", "|---|" + "---|" * lay['pool'].bit_length()]
    for n, b in report["strategies"].items():
        if b.get("valid"):
            h = b["group_size_histogram"]
            out.append(f"| {n} | " + " | ".join(str(h.get(str(1 << k), 0))
                                                for k in range(lay['pool'].bit_length())) + " |")
    if report.get("files"):
        out += ["", "## Plots", ""] + [f"![{k}]({v})" for k, v in report["files"].items()
                                       if v.endswith(".png")]
    return "\n".join(out) + "\n"


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
    return str(path)


def write_plots(report: dict, out: Path) -> dict:
    """The three PNGs; returns ``{kind: path}``."""
    from ..plots import _plt
    plt = _plt()
    files = {}
    st = {n: b for n, b in report["strategies"].items() if b.get("valid")}
    # the default planner first, then ours, the named baselines, the no-cut fixed degree
    # (a stored plan, ``report --plan``, before them all)
    order = (*[n for n in st if n.endswith(" (stored)")], report.get("default_strategy"),
             *ours(), *HYBRID_STRATEGIES, report.get("no_cut_fixed"))
    show = [n for n in dict.fromkeys(order) if n in st]
    if show:
        fig, axes = plt.subplots(len(show), 1, figsize=(11, 2.6 * len(show)), squeeze=False)
        for ax, n in zip(axes[:, 0], show):
            c = np.asarray(st[n]["per_rank"]["compute_seconds"])
            x = np.asarray(st[n]["per_rank"]["exposed_seconds"])
            r = np.arange(c.shape[0])
            ax.bar(r, c, color="tab:blue", label="compute")
            ax.bar(r, x, bottom=c, color="tab:red", label="exposed K/V exchange")
            ax.set_title(f"{n}: per-rank time over the epoch (cut {st[n]['documents_cut']})")
            ax.set_xlabel("rank in the pool")
            ax.set_ylabel("seconds")
            ax.legend(loc="upper right")
        files["rank_time"] = _save(plt, fig, out / "hybrid_rank_time.png")
    fig, ax = plt.subplots(figsize=(10, 4))
    K = report["layout"]["pool"].bit_length()
    width = 0.8 / max(1, len(st))
    for i, (n, b) in enumerate(st.items()):
        h = [b["group_size_histogram"].get(str(1 << k), 0) for k in range(K)]
        ax.bar(np.arange(K) + i * width, h, width, label=n)
    ax.set_xticks(np.arange(K) + 0.4 - width / 2, [str(1 << k) for k in range(K)])
    ax.set_yscale("symlog")
    ax.set_xlabel("CP group size (ranks)")
    ax.set_ylabel("groups over the epoch")
    ax.set_title("Group-size histogram")
    ax.legend(fontsize=7, ncol=3)
    files["group_sizes"] = _save(plt, fig, out / "hybrid_group_sizes.png")
    fig, ax = plt.subplots(figsize=(10, 4))
    names = list(st)
    ax.bar(names, [st[n]["est_step_time_total"] for n in names], color="tab:gray",
           label="estimated epoch time")
    ax.bar(names, [st[n]["lower_bound_total"] for n in names], color="none",
           edgecolor="black", label="no-cut lower bound")
    ax.set_yscale("log")
    ax.set_ylabel("seconds per GPU")
    ax.set_title("Estimated step time summed over the epoch")
    ax.tick_params(axis="x", rotation=45)
    ax.legend()
    files["step_time"] = _save(plt, fig, out / "hybrid_step_time.png")
    return files


def write_hybrid_report(report: dict, out: str | Path, *, plots: bool = True,
                        t0: float | None = None) -> dict:
    """Write the PNGs (with ``plots``), ``report.md`` and ``report.json`` of ``report`` under
    ``out``; ``report["files"]`` gets their names and, given ``t0`` (a ``time.perf_counter()``
    reading), ``report["report_seconds"]`` the time since. Returns ``{kind: path}``."""
    outp = Path(out)
    outp.mkdir(parents=True, exist_ok=True)
    files = write_plots(report, outp) if plots else {}
    return write_md_json(report, files, outp, render_md, t0)


__all__ = ["build_hybrid_report", "render_md", "write_hybrid_report", "write_plots"]
