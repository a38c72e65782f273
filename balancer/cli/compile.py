"""``python -m balancer compile``: compile every Numba kernel into the disk cache ahead of time.

A fresh install compiles its kernels on first use (about a minute of CPU, per process). Run
this once where the cache lives (``BALANCER_NUMBA_CACHE_DIR``, else ``~/.cache/balancer``): in
a container image build, or on a shared file system before launching the ranks, so that no rank
of the job pays it. The cache is keyed by the package's sources and numba's version
(:mod:`packing._jit`), so an upgrade recompiles instead of loading stale code. With no writable
cache location (or with ``NUMBA_DISABLE_JIT`` set) the command refuses before compiling
anything: compiling in memory would be thrown away when it exits; and it exits 1 when a kernel
it compiled did not reach the cache (numba drops a failed write silently).
"""
from __future__ import annotations

import sys

from .commands import command


def _args(p) -> None:
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")


def _run(args) -> int:
    from numba.core import config as numba_config
    from packing._jit import CACHE_DIR, cache_base
    from ..planning.warmup import PARTS, kernels, uncached, warmup
    if numba_config.DISABLE_JIT:
        raise OSError("compile: NUMBA_DISABLE_JIT is set: the kernels run as plain Python, "
                      "nothing compiles and nothing is cached; unset it to compile")
    if CACHE_DIR is None:
        raise OSError(f"compile: no writable numba cache location ({cache_base()} cannot be "
                      "created or written): the kernels would compile in memory and be lost at "
                      "exit; set BALANCER_NUMBA_CACHE_DIR to a writable directory")
    bar = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=len(PARTS), desc="compile", unit="part", file=sys.stderr)

    started: list[str] = []

    def progress(part: str) -> None:  # called as each part starts
        if bar is not None:
            bar.update(1 if started else 0)
            bar.set_postfix_str(part)
        elif not args.quiet:
            print(f"compile: {part} kernels ...", file=sys.stderr, flush=True)
        started.append(part)

    stats = warmup(progress=progress)
    if bar is not None:
        bar.update(bar.total - bar.n)
        bar.close()
    missing = uncached(kernels(), CACHE_DIR)
    if missing:  # numba drops failed cache writes silently: a job would compile them again
        print(f"error: compile: {len(missing)} of {stats['kernels']} kernels compiled but not "
              f"written to the cache {CACHE_DIR} (e.g. {missing[0]}): is it writable, with "
              f"space left? a job would compile them again", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"compile: {stats['kernels']} kernels ready in {stats['seconds']:.1f} s "
              f"({stats['compiled']} compiled now, {stats['loaded']} loaded from the cache); "
              f"cache: {stats['cache_dir']}")
    return 0


command("compile", "compile every Numba kernel into the disk cache ahead of the job "
                   "(container image build, shared file system)")((_args, _run))
