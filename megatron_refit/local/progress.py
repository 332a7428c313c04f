"""Progress bars for long loops: demo refits, benchmark repetitions, GRPO steps.

A bar is drawn only when both stdout and stderr are terminals (never in CI logs, pipes,
files or pytest's capture) and only once the loop has run ``delay`` seconds, so short runs
print nothing extra. It uses tqdm when installed (the ``megatron`` extra brings it via
transformers) and is silent without it. ``TQDM_DISABLE=1`` turns every bar off.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TextIO

DELAY_S = 2.0
"""Seconds a loop runs before its bar appears."""


def on_terminal(streams: tuple[TextIO, ...] | None = None) -> bool:
    """True if every stream (default: stdout and stderr) is a terminal."""
    streams = (sys.stdout, sys.stderr) if streams is None else streams
    return all(getattr(s, "isatty", lambda: False)() for s in streams)


class Bar:
    """Iterates over ``iterable``; on a terminal also draws a bar on the last stream.

    ``streams`` (tests): the streams that must be terminals, the bar drawn on the last;
    default stdout and stderr, the bar on stderr.
    """

    def __init__(self, iterable: Iterable, *, desc: str = "", total: int | None = None, delay: float = DELAY_S,
                 streams: tuple[TextIO, ...] | None = None):
        self._iterable = iterable
        self._tqdm = None
        streams = (sys.stdout, sys.stderr) if streams is None else streams
        if not on_terminal(streams):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._tqdm = tqdm(iterable, desc=desc, total=total, delay=delay, leave=False, file=streams[-1],
                          dynamic_ncols=True)

    @property
    def active(self) -> bool:
        return self._tqdm is not None

    def __iter__(self) -> Iterator:
        return iter(self._tqdm if self._tqdm is not None else self._iterable)

    def show(self, **values) -> None:
        """Values shown after the bar (e.g. ``reward=0.5``); nothing off a terminal."""
        bar = self._tqdm
        if bar is None:
            return
        bar.set_postfix(values, refresh=False)
        if time.time() >= bar.start_t + bar.delay:  # tqdm's refresh would draw before the delay
            bar.refresh()

    def on_report(self, metrics: dict) -> None:
        """A ``Refitter`` / ``Receiver`` ``on_report`` callback: the refit's GB/s and seconds."""
        self.show(refit_s=f"{metrics['refit/total_s']:.3f}", gbps=f"{metrics['refit/gbps']:.2f}")
