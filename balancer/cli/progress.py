"""Progress of the commands that take more than a few seconds (compare, demo, report; compile
and precompute have their own bars): one tqdm bar on stderr over the command's stages, shown only
when stderr is a terminal (never in logs or pipes) and not ``--quiet``. While a stage runs the
bar's elapsed time keeps ticking, so a long stage (one strategy planning 10M samples) is not
mistaken for a hang."""
from __future__ import annotations

import sys
import threading
from typing import Optional


class Stages:
    """``stages(label)`` starts the next of ``total`` stages; ``close()`` completes the bar.
    A no-op when disabled. ``file``/``force``: for tests (a non-terminal stream, bar forced)."""

    def __init__(self, total: int, desc: str, *, quiet: bool = False, file=None,
                 force: bool = False, tick_s: float = 1.0):
        file = file if file is not None else sys.stderr
        self.bar = None
        self._done = threading.Event()
        if total <= 0 or quiet or not (force or _isatty(file)):
            return
        from tqdm import tqdm
        self.bar = tqdm(total=total, desc=desc, unit="stage", file=file, dynamic_ncols=True,
                        leave=True)
        self._started = False
        self._thread = threading.Thread(target=self._tick, args=(tick_s,), daemon=True)
        self._thread.start()

    def _tick(self, tick_s: float) -> None:
        while not self._done.wait(tick_s):
            self.bar.refresh()  # the elapsed time moves while a stage runs

    def __call__(self, label: str) -> None:
        if self.bar is None:
            return
        if self._started:
            self.bar.update(1)
        self._started = True
        self.bar.set_postfix_str(label)

    def close(self) -> None:
        if self.bar is None:
            return
        self._done.set()
        self._thread.join()
        self.bar.update(self.bar.total - self.bar.n)
        self.bar.close()
        self.bar = None


def _isatty(f) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


def stages(total: int, desc: str, quiet: bool = False) -> Stages:
    return Stages(total, desc, quiet=quiet)


Progress = Optional[Stages]
