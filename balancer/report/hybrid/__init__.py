"""The figures and the report of the hybrid DP x CP mode: per-strategy figures and every
strategy side by side (:mod:`.figures`), ``report.json`` / ``report.md`` / PNGs of
``report --cp-mode hybrid`` (:mod:`.build`)."""
from __future__ import annotations

from .build import build_hybrid_report, render_md, write_hybrid_report, write_plots
from .figures import (add_fixed_mode_figures, compare_hybrid, coverage, format_table,
                      group_size_histogram, ours, sharded_documents_by_size, summarize)

__all__ = ["add_fixed_mode_figures", "build_hybrid_report", "compare_hybrid", "coverage",
           "format_table", "group_size_histogram", "ours", "render_md",
           "sharded_documents_by_size", "summarize", "write_hybrid_report", "write_plots"]
