"""Calibrate a cost model: time the forward and the backward pass of a real torch module on
packed microbatches of varied document lengths and counts, fit ``a*sum L^2 + b*sum L + c`` per
pass (balancer.cost.calibration), report R^2 and the relative error on held-out shapes, and write a
preset the planner loads.

    ./dev python tools/calibrate.py --name tiny-lm-cpu            # TinyLM, CPU, 1 thread
    ./dev python tools/calibrate.py --module pkg.mod:factory --vocab 32000 --device cuda \
        --capacity 16384 --out configs/models/mine.yaml

The module is ``TinyLM(vocab, dim, layers, heads)`` (tools/tiny_lm.py) by default or whatever
``--module pkg.mod:factory`` returns (``factory(**json.loads(--module-kwargs))``); it is called
as ``module(input_ids[T], position_ids[T], cu_seqlens int32[N+1], max_seqlen)``. A 2-D output
``[T, V]`` is scored with the summed next-token cross-entropy the trainer uses, anything else
with ``output.float().sum()``. The forward time includes the loss (the trainer's forward does);
the backward time is ``loss.backward()`` into existing gradient buffers (the steady state of
gradient accumulation).

Timing is warm (``--warmup`` passes over every shape first), repeated (``--repeats``, each
repeat visits the shapes in a new random order so slow drift of a shared machine spreads over
all shapes instead of biasing a few) and the median per shape is fitted. Fit and held-out shapes
are drawn independently (``--fit-shapes``, ``--held-out-shapes``).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


from balancer.cost import calibration as cal_mod  # noqa: E402
from balancer.cost.model import config_dir  # noqa: E402
from balancer.resources import check_preset_name  # noqa: E402
from tools.tiny_lm import add_model_args, model_from_args  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("module")
    g.add_argument("--module", default=None,
                   help="pkg.mod:factory returning a torch.nn.Module (default: tools.tiny_lm.TinyLM)")
    g.add_argument("--module-kwargs", default="{}", help="JSON keyword arguments of the factory")
    add_model_args(g)
    g = p.add_argument_group("measurement")
    g.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    g.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads (the trainer's ranks use 1)")
    g.add_argument("--capacity", type=int, default=4096, help="largest microbatch in tokens")
    g.add_argument("--max-docs", type=int, default=16, help="most documents in a microbatch")
    g.add_argument("--fit-shapes", type=int, default=48, help="microbatch shapes to fit on")
    g.add_argument("--held-out-shapes", type=int, default=24, help="shapes only evaluated")
    g.add_argument("--warmup", type=int, default=1, help="untimed passes over every shape")
    g.add_argument("--repeats", type=int, default=5, help="timed passes per shape (median)")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("output")
    g.add_argument("--name", default="tiny-lm-cpu", help="preset name (configs/models/<name>.yaml)")
    g.add_argument("--out", default=None, help="preset path (default: configs/models/<name>.yaml)")
    g.add_argument("--json", default=None, help="write observations and fit quality here")
    g.add_argument("--layer-types", default=None, metavar="PRESET|config.json",
                   help="fit one coefficient per attention layer type of this model (a preset "
                        "with hf_config: or a Hugging Face config.json: full, sliding window, "
                        "chunked) instead of a single a*sum L^2 term")
    return p.parse_args(argv)


def build_module(args) -> torch.nn.Module:
    """TinyLM from the flags, or ``factory(**kwargs)`` of ``--module pkg.mod:factory``."""
    if args.module is None:
        return model_from_args(args)
    if ":" not in args.module:
        raise ValueError(f"--module {args.module!r} must be 'package.module:factory'")
    mod, fn = args.module.split(":", 1)
    factory = getattr(importlib.import_module(mod), fn)
    module = factory(**json.loads(args.module_kwargs))
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"{args.module} returned {type(module).__name__}, not a torch.nn.Module")
    return module


def make_inputs(docs: list[int], vocab: int, device, gen: torch.Generator) -> dict:
    """Packed THD tensors of one microbatch: ids, positions, cu_seqlens, max_seqlen, labels."""
    lens = torch.tensor(docs, dtype=torch.int64)
    total = int(lens.sum())
    cu = torch.zeros(len(docs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(cu[:-1].to(torch.int64), lens)
    pos = torch.arange(total) - starts
    ids = torch.randint(0, vocab, (total,), generator=gen)
    labels = torch.cat([ids[1:], ids[:1]])
    labels[cu[1:].to(torch.int64) - 1] = -100  # no label across a document boundary
    return {"input_ids": ids.to(device), "position_ids": pos.to(device),
            "cu_seqlens": cu.to(device), "max_seqlen": int(lens.max()),
            "labels": labels.to(device)}


def _loss(out, labels):
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == labels.shape[0]:
        from tools.tiny_lm import token_loss_sum
        return token_loss_sum(out, labels)
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.float().sum()


class PassTimer:
    """Times forward (with the loss) and backward of ``module`` on one packed microbatch."""

    def __init__(self, module: torch.nn.Module, device):
        self.module, self.device = module, torch.device(device)
        self.cuda = self.device.type == "cuda"

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def __call__(self, x: dict) -> tuple[float, float]:
        self._sync()
        t0 = time.perf_counter()
        out = self.module(x["input_ids"], x["position_ids"], x["cu_seqlens"], x["max_seqlen"])
        loss = _loss(out, x["labels"])
        self._sync()
        t1 = time.perf_counter()
        loss.backward()
        self._sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1


def measure(timer: PassTimer, shapes: list[list[int]], vocab: int, warmup: int, repeats: int,
            seed: int = 0, progress: bool = True) -> cal_mod.Observations:
    """Median forward and backward seconds of every shape (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [make_inputs(s, vocab, timer.device, gen) for s in shapes]
    for p in timer.module.parameters():  # gradient buffers exist, as in accumulation
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    rng = np.random.default_rng(seed)
    times = np.zeros((repeats, len(shapes), 2))
    t_start = time.perf_counter()
    for r in range(-warmup, repeats):
        for i in rng.permutation(len(shapes)):
            f, b = timer(inputs[i])
            if r >= 0:
                times[r, i] = f, b
        if progress:
            print(f"  pass {r + warmup + 1}/{warmup + repeats} "
                  f"({time.perf_counter() - t_start:.1f} s)", file=sys.stderr, flush=True)
    med = np.median(times, axis=0)
    lens, off = cal_mod.to_csr(shapes)
    return cal_mod.Observations(lens, off, {"forward": med[:, 0], "backward": med[:, 1]})


def run(args, timer_cls: type = None) -> dict:
    """Measure, fit, write the preset (and JSON); returns the JSON document. ``timer_cls``
    (default :class:`PassTimer`) is constructed as ``timer_cls(module, device)``; tests pass a
    subclass that runs the real passes but reports deterministic seconds."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    module = build_module(args).to(device=device, dtype=getattr(torch, args.dtype)).train()
    rng = np.random.default_rng(args.seed)
    fit_shapes = cal_mod.sample_shapes(args.fit_shapes, args.capacity, rng, args.max_docs)
    held_shapes = cal_mod.sample_shapes(args.held_out_shapes, args.capacity, rng, args.max_docs)
    timer = (timer_cls or PassTimer)(module, device)
    both = measure(timer, fit_shapes + held_shapes, args.vocab, args.warmup, args.repeats,
                   args.seed)
    nf = len(fit_shapes)
    split = lambda sl: cal_mod.Observations(*cal_mod.to_csr(both.microbatches()[sl]),  # noqa
                                            {k: both.seconds[k][sl] for k in cal_mod.PASSES})
    fit, held = split(slice(0, nf)), split(slice(nf, None))
    cal = cal_mod.calibrate(fit, held)
    label = args.module or f"TinyLM(vocab={args.vocab}, dim={args.dim}, layers={args.layers}, " \
                           f"heads={args.heads}, attention={args.attention})"
    desc = (f"{label} on {args.device} ({args.dtype}, {args.threads} threads), seconds per "
            f"microbatch, fitted on {nf} shapes up to {args.capacity} tokens")
    comments = _comments("tools/calibrate.py", cal.quality)
    # a developer's tool: --name regenerates a shipped preset on purpose (the package's configs),
    # but only a plain name, never a path out of configs/models
    out = Path(args.out) if args.out else \
        config_dir() / "models" / f"{check_preset_name(args.name)}.yaml"
    if getattr(args, "layer_types", None):
        return _run_layered(args, fit, held, out, desc)
    cal_mod.write_preset(cal, out, desc, comments)
    return _document(args, fit, held, cal.quality, {
        "preset": str(out), "description": desc,
        "forward": cal.forward.model_dump(), "backward": cal.backward.model_dump()})


def _run_layered(args, fit, held, out: Path, desc: str) -> dict:
    """``--layer-types``: the per-layer-type fit (balancer.cost.calibration.calibrate_layered)
    written as a preset with ``attention:`` terms."""
    from balancer.cost.model import load_cost_model
    template = load_cost_model(args.layer_types)
    model, quality = cal_mod.calibrate_layered(fit, template, held, name=args.name)
    comments = _comments(f"tools/calibrate.py --layer-types {args.layer_types}", quality)
    cal_mod.write_layered_preset(model, out, desc + ", per attention layer type", comments)
    return _document(args, fit, held, quality, {
        "preset": str(out), "description": desc, "layer_types": args.layer_types,
        "forward": model.forward.model_dump(), "backward": model.backward.model_dump(),
        "attention": [t.model_dump() for t in model.attention]})


def _comments(command: str, quality: dict) -> list[str]:
    """The preset's header comments: what generated it, when, and the fit's quality."""
    hq = quality["held_out"]
    return [f"generated by {command}; {time.strftime('%Y-%m-%d %H:%M:%S')}",
            *(f"{k}: fit R^2 {quality['fit'][k]['r2']:.4f}, held-out R^2 "
              f"{hq[k]['r2']:.4f}, held-out median rel. error {hq[k]['rel_error']['median']:.4f}"
              for k in (*cal_mod.PASSES, "total"))]


def _document(args, fit, held, quality: dict, model: dict) -> dict:
    """The JSON document of a fit (``model``: the preset written and its coefficients, first),
    written to ``--json`` when given."""
    hq = quality["held_out"]
    doc = {**model,
           "quality": {s: {k: {kk: vv for kk, vv in v.items() if kk != "errors"}
                           for k, v in q.items()} for s, q in quality.items()},
           "held_out_errors": {k: hq[k]["errors"] for k in hq},
           "fit_observations": fit.to_json(), "held_out_observations": held.to_json(),
           "args": vars(args)}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return doc


def format_quality(doc: dict) -> str:
    lines = [f"{'pass':9s} {'a':>11s} {'b':>11s} {'c':>11s} {'d':>11s}  {'R2 fit':>7s} {'R2 held':>7s} "
             f"{'rel.err held: median':>21s} {'p90':>7s} {'max':>7s}"]
    q = doc["quality"]
    for k in (*cal_mod.PASSES, "total"):
        co = doc.get(k, {"a": float("nan"), "b": float("nan"), "c": float("nan"),
                         "d": float("nan")})
        e = q["held_out"][k]["rel_error"]
        lines.append(f"{k:9s} {co['a']:11.4e} {co['b']:11.4e} {co['c']:11.4e} "
                     f"{co.get('d', 0.0):11.4e}  "
                     f"{q['fit'][k]['r2']:7.4f} {q['held_out'][k]['r2']:7.4f} "
                     f"{100 * e['median']:20.2f}% {100 * e['p90']:6.2f}% {100 * e['max']:6.2f}%")
    for t in doc.get("attention", ()):  # --layer-types: a cost per pair of each layer type
        lines.append(f"attention {t['kind']}{'' if t.get('window') is None else ' ' + str(t['window'])}"
                     f": forward {t['forward']:.4e}, backward {t['backward']:.4e} per pair")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    doc = run(args)
    print(format_quality(doc))
    print(f"wrote {doc['preset']}" + (f" and {args.json}" if args.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
