"""The workload and layout flags shared by ``tools/bench.py``, ``python -m balancer report`` and
``precompute`` (a stable interface: extend, never rename)."""
from __future__ import annotations

import argparse
import math
import re
import typing
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from pydantic import ValidationError

from packing.validate import MAX_LENGTH

from ..strategies import registry as strategies
from ..config import Layout, PlannerConfig, check_fixed_delay
from ..cost.model import CostModel, load_cost_model
from .. import workloads
from ..samples import SampleTable

#: Layout / PlannerConfig field -> the flag that sets it (for one-line errors naming the flag)
FLAGS = {"capacity": "--capacity", "dp": "--dp", "pp": "--pp", "cp": "--cp",
         "microbatches": "--microbatches", "global_batch_tokens": "--global-batch-tokens",
         "global_batch_samples": "--global-batch-samples", "max_delay": "--max-delay",
         "max_advance": "--max-advance", "seed": "--seed", "over_length": "--over-length",
         "tail": "--tail", "cp_mode": "--cp-mode", "rank_capacity": "--rank-capacity",
         "sync": "--sync"}

#: a config argument with a string value as Python writes it: ``over_length='chunk'`` (numbers
#: such as ``cp=2`` describe a layout and stay as they are)
_PY_ARGUMENT = re.compile(r"\b(" + "|".join(FLAGS) + r")=(['\"])([\w.-]+)\2")
#: a config field a setting asks for: ``needs rank_capacity``
_NEEDS_FIELD = re.compile(r"\bneeds (" + "|".join(FLAGS) + r")\b")


def at_least(low: int):
    """An argparse ``type``: an integer >= ``low`` (argparse names the flag in its error);
    the tools and the examples use it for their own flags."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"{v} must be >= {low}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"{v} must be a finite number > 0")
    return v


def as_flags(message: str) -> str:
    """An error message of the package as the command line says it: a config argument written
    the Python way (``over_length='chunk'``) becomes its flag (``--over-length chunk``), unless
    the message names the flag already."""
    def flag(m):
        f = FLAGS[m.group(1)]
        return m.group(0) if f in message else f"{f} {m.group(3)}"
    message = _PY_ARGUMENT.sub(flag, message)
    return _NEEDS_FIELD.sub(lambda m: f"needs {FLAGS[m.group(1)]}", message)


#: every registered strategy, in registry order (balancer.strategies.registry.STRATEGY_MODULES)
DEFAULT_STRATEGIES = tuple(strategies.names())


def flag_type(annotation) -> dict:
    """argparse kwargs for a pydantic field annotation (int, float, str, bool, Literal,
    Optional of these)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in args if a is not type(None))
        args = typing.get_args(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(annotation) is Literal:
        return {"choices": args}
    return {"type": annotation if annotation in (int, float, str) else str}


_FIELD_DEFAULT = object()


def config_flag(g, model, field: str, help: str, default=_FIELD_DEFAULT) -> None:
    """``--field-name``: type or choices and default from the config model's field, so a flag
    and the field it sets cannot drift apart (the flag's name is ``FLAGS[field]``). ``default``
    None: the flag is None unless given, for a field whose default depends on the CP mode
    (:data:`balancer.config.MODE_DEFAULTS`)."""
    info = model.model_fields[field]
    g.add_argument(FLAGS[field], default=info.default if default is _FIELD_DEFAULT else default,
                   help=help, **flag_type(info.annotation))


def add_workload_args(p: argparse.ArgumentParser, *, default_workload: str | None = None) -> None:
    g = p.add_argument_group("workload and layout")
    g.add_argument("--lengths", default=default_workload,
                   help="int lengths, one per sample: a .npy file or a workload name "
                        "(wikipedia, wlbllm, prolong, bimodal-sft, ...)")
    g.add_argument("--samples", type=int, default=None,
                   help="resample (seeded, with replacement) to this many samples")
    g.add_argument("--capacity", type=int, default=None, help="tokens per microbatch")
    config_flag(g, Layout, "dp", "data-parallel ranks")
    config_flag(g, Layout, "pp", "pipeline stages")
    config_flag(g, Layout, "cp", "context-parallel ranks")
    config_flag(g, Layout, "microbatches", "microbatches per DP rank per step")
    config_flag(g, Layout, "sync", "when the DP ranks wait for each other: step (DDP with "
                "no_sync gradient accumulation) or microbatch (FSDP / ZeRO-3: balance every "
                "microbatch slot across ranks)")
    config_flag(g, PlannerConfig, "global_batch_tokens",
                "tokens per step (default dp x microbatches x capacity)")
    config_flag(g, PlannerConfig, "global_batch_samples",
                "samples per step instead of a token budget")
    g.add_argument("--cost-model", default="quadratic-64k",
                   help="built-in name (quadratic-64k), preset in configs/models, a YAML file, "
                        "or a Hugging Face config.json (docs/cost-models.md)")
    config_flag(g, PlannerConfig, "over_length",
                "samples longer than the capacity: raise, or cut into pieces")
    config_flag(g, PlannerConfig, "max_delay", "most steps a sample may wait (default 4); with "
                "--cp-mode hybrid, most steps a document may move from its global batch "
                "(default 2)", default=None)
    config_flag(g, PlannerConfig, "max_advance",
                "most steps a heavy sample may be read early (default: 3 x --max-delay)")
    config_flag(g, PlannerConfig, "tail", "samples left at the end of an epoch")
    g.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                   help=f"comma-separated strategy names ({', '.join(strategies.names())})")
    config_flag(g, PlannerConfig, "seed", "shuffle seed")


def parse_strategies(text: str, mode: str = "fixed") -> list[str]:
    """``--strategies`` names, each a strategy of the registry serving ``mode`` (one error
    naming an unknown one, or one of the other mode)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        strategies.get(s, mode)
    if not names:
        raise ValueError(f"--strategies {text!r}: give at least one strategy (known: "
                         f"{', '.join(strategies.names(mode))})")
    return names


def flag_errors(e: ValidationError, flags: dict | None = None) -> str:
    """A config ValidationError as one line naming the flags (``flags``: field -> flag, default
    the Layout / PlannerConfig ones) and values."""
    flags = FLAGS if flags is None else flags
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        if loc:
            parts.append(f"{flags.get(loc, loc)} {err.get('input')!r}: {msg}")
        else:
            parts.append(msg)
    return "; ".join(parts)


def build(args) -> tuple[CostModel, Layout, PlannerConfig]:
    samples = getattr(args, "samples", None)
    if samples is not None and not 1 <= samples <= MAX_LENGTH:
        raise ValueError(f"--samples {samples}: must be between 1 and 2**40 ({MAX_LENGTH})")
    cost = load_cost_model(args.cost_model)
    rc = getattr(args, "rank_capacity", None)
    capacity = args.capacity if args.capacity is not None else (
        args.cp * rc if rc is not None else cost.capacity(args.cp, args.pp))
    try:
        layout = Layout(dp=args.dp, pp=args.pp, cp=args.cp, microbatches=args.microbatches,
                        capacity=capacity, cp_mode=getattr(args, "cp_mode", None) or "fixed",
                        rank_capacity=rc, sync=getattr(args, "sync", None) or "step")
        # --max-delay only when given: its default is the CP mode's (MODE_DEFAULTS)
        delay = {} if getattr(args, "max_delay", None) is None else {"max_delay": args.max_delay}
        config = PlannerConfig(seed=args.seed, global_batch_tokens=args.global_batch_tokens,
                               global_batch_samples=args.global_batch_samples, **delay,
                               max_advance=getattr(args, "max_advance", None),
                               over_length=args.over_length, tail=args.tail)
        if layout.cp_mode == "fixed":
            check_fixed_delay(config.max_delay)
    except ValidationError as e:
        raise ValueError(flag_errors(e)) from None
    return cost, layout, config


# ---- context parallelism: fixed or hybrid ------------------------------------------------------
CP_FLAGS = {"cp_mode": "--cp-mode", "rank_capacity": "--rank-capacity",
            "gpus_per_node": "--gpus-per-node", "overlap": "--cp-overlap"}


def cp_hardware(args):
    """The CP cost model's interconnect figures: ``--cp-hardware FILE`` (a YAML mapping of
    :class:`~balancer.cost.cp.CPHardware` fields, e.g. from ``tools/calibrate_cp.py``) or the
    defaults, then ``--gpus-per-node`` and ``--cp-overlap`` where given. Errors name the flag."""
    from ..cost.cp import CPHardware
    over = {k: v for k, v in (("gpus_per_node", getattr(args, "gpus_per_node", None)),
                              ("overlap", getattr(args, "cp_overlap", None))) if v is not None}
    path = getattr(args, "cp_hardware", None)
    try:
        return CPHardware.from_yaml(path, **over) if path else CPHardware(**over)
    except ValidationError as e:
        raise ValueError(flag_errors(e, CP_FLAGS)) from None
    except (OSError, ValueError) as e:  # the file's own errors already name it
        raise ValueError(f"--cp-hardware {path}: {str(e).removeprefix(f'{path}: ')}") from None


def add_cp_args(p: argparse.ArgumentParser) -> None:
    """``--cp-mode fixed|hybrid`` and ``--rank-capacity TOKENS`` (stable), with the
    interconnect figures of the CP cost model."""
    g = p.add_argument_group("context parallelism (fixed or hybrid DP x CP)")
    g.add_argument("--cp-mode", choices=("fixed", "hybrid"), default="fixed",
                   help="fixed: every microbatch on a CP group of --cp ranks; hybrid: the "
                        "--dp x --cp ranks of a stage are one pool and every document gets its "
                        "own CP degree (balancer.planning.hybrid)")
    g.add_argument("--rank-capacity", type=int, default=None,
                   help="tokens one rank holds in one microbatch round (memory); in fixed mode "
                        "the microbatch capacity is cp x this; needed by --cp-mode hybrid; "
                        "with it every strategy is also evaluated by the CP cost model "
                        "(exposed K/V exchange, seconds per GPU)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs on the fast intra-node fabric (CP cost model; default 8, or "
                        "--cp-hardware's)")
    g.add_argument("--cp-overlap", type=float, default=None,
                   help="fraction of the K/V exchange that can overlap attention compute "
                        "(default 1.0, or --cp-hardware's)")
    g.add_argument("--cp-hardware", default=None, metavar="FILE",
                   help="YAML of the CP cost model's interconnect figures (bandwidths, "
                        "latencies, overlap, gpus_per_node), e.g. written by "
                        "tools/calibrate_cp.py; the two flags above override it")


def build_cp(args):
    """``(CPCostModel or None, pool ranks, batch tokens)`` from the CP flags; None without
    ``--rank-capacity`` in fixed mode. Errors name the flag."""
    from ..cost.cp import CPCostModel
    mode = getattr(args, "cp_mode", "fixed") or "fixed"
    rc = getattr(args, "rank_capacity", None)
    if rc is None:
        if mode == "hybrid":
            raise ValueError("--cp-mode hybrid needs --rank-capacity TOKENS (the per-rank token "
                             "limit of one microbatch round)")
        return None, args.dp * args.cp, None
    if not 1 <= rc <= MAX_LENGTH:
        raise ValueError(f"--rank-capacity {rc}: must be between 1 and 2**40 ({MAX_LENGTH})")
    if args.capacity is not None and mode == "fixed" and args.capacity != args.cp * rc:
        raise ValueError(f"--capacity {args.capacity} disagrees with --cp {args.cp} x "
                         f"--rank-capacity {rc} = {args.cp * rc} (in fixed mode the microbatch "
                         f"capacity is cp x rank capacity); give one of them")
    if mode == "hybrid":
        for flag, v in (("--capacity", args.capacity),
                        ("--global-batch-samples", getattr(args, "global_batch_samples", None))):
            if v is not None:
                raise ValueError(f"{flag} {v}: not used by --cp-mode hybrid (a rank holds "
                                 f"--rank-capacity tokens per round; the step takes "
                                 f"--global-batch-tokens, default dp x cp x microbatches x "
                                 f"rank capacity)")
    hw = cp_hardware(args)
    try:
        model = CPCostModel.from_preset(args.cost_model or "llama-7b", rc, hardware=hw,
                                        pp=args.pp)
    except ValueError as e:
        if not isinstance(e, ValidationError):
            raise ValueError(f"--cost-model {args.cost_model}: {e}") from None
        raise ValueError(flag_errors(e, CP_FLAGS)) from None
    P = args.dp * args.cp
    budget = getattr(args, "global_batch_tokens", None) or P * args.microbatches * rc
    if budget > 2 ** 52:
        raise ValueError(f"--global-batch-tokens {budget}: exceeds 2**52")
    return model, P, int(budget)


def pick_split(ds, split: str):
    """``ds[split]`` of a DatasetDict (an error naming its splits when it has none such), a
    Dataset as it is."""
    import datasets
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"--split {split}: the dataset has the splits {list(ds)}")
        return ds[split]
    return ds


def read_lengths(args) -> tuple[np.ndarray | None, str | None]:
    """Lengths and a workload name from ``--dataset DIR`` or ``--lengths FILE|NAME`` (the
    report commands); ``(None, None)`` when neither is given."""
    if getattr(args, "dataset", None):
        import datasets
        ds = open_dataset(args.dataset, args.split)
        return SampleTable.from_dataset(ds, args.length_column, args.tokens_column).lengths, \
            Path(args.dataset).name
    if args.lengths:
        return workloads.load(args.lengths, n=args.samples, seed=args.seed), \
            Path(args.lengths).stem if args.lengths.endswith(".npy") else args.lengths
    return None, None


def manifest_lengths(manifest: dict, plan_dir: Path) -> np.ndarray | None:
    """Sample lengths a plan directory points at: a ``.npy`` named in the manifest (top level,
    its ``extra`` or the ``extra.source`` precompute records), or ``lengths.npy`` inside the
    directory; None when there is none."""
    m = manifest if isinstance(manifest, dict) else {}
    extra = m.get("extra") if isinstance(m.get("extra"), dict) else {}
    source = extra.get("source") if isinstance(extra.get("source"), dict) else {}
    if source.get("samples") is not None:   # resampled from the file: not its lengths
        source = {}
    for where in (m, extra, source):
        for key in ("lengths", "lengths_path", "lengths_file", "workload"):
            v = where.get(key)
            if isinstance(v, str):
                for cand in (plan_dir / v, Path(v)):
                    if cand.suffix == ".npy" and cand.is_file():
                        return workloads.load(str(cand))
    f = plan_dir / "lengths.npy"
    return workloads.load(str(f)) if f.is_file() else None


def open_dataset(spec: str, split: Optional[str] = None):
    """A saved HF dataset directory (``save_to_disk``), or jsonl / json / parquet files
    (a file, a comma-separated list, or a directory of them); a saved DatasetDict gives its
    ``split`` (without one, only a single split is taken)."""
    import datasets
    paths = [Path(s) for s in spec.split(",") if s]
    if len(paths) == 1 and paths[0].is_dir():
        d = paths[0]
        if (d / "dataset_info.json").is_file() or (d / "state.json").is_file() or \
                (d / "dataset_dict.json").is_file():
            ds = datasets.load_from_disk(str(d))
            if isinstance(ds, datasets.DatasetDict) and split is not None:
                return pick_split(ds, split)
            if isinstance(ds, datasets.DatasetDict):
                if len(ds) != 1:
                    raise ValueError(f"{d}: a DatasetDict with splits {list(ds)}; give one split "
                                     f"directory")
                ds = next(iter(ds.values()))
            return ds
        paths = sorted(p for p in d.iterdir() if p.suffix in (".jsonl", ".json", ".parquet"))
        if not paths:
            raise ValueError(f"{d}: neither a saved dataset nor a folder of jsonl/parquet files")
    for p in paths:
        if not p.is_file():
            raise ValueError(f"{p}: no such dataset file")
    kinds = {"parquet" if p.suffix == ".parquet" else "json" for p in paths}
    if len(kinds) != 1 or not all(p.suffix in (".jsonl", ".json", ".parquet") for p in paths):
        raise ValueError(f"dataset files must all be .jsonl/.json or all .parquet: {spec}")
    return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in paths], split="train")
