"""Figures of a plan: metrics, the strategy comparison, the imbalance report (json, markdown,
plots). Plans and cost models in, dicts and files out."""
