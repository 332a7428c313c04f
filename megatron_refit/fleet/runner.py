"""Every thread the trainer side of a fleet runs on one train rank, in one owner.

A :class:`Runner` holds named lanes: each a daemon thread, created once on first use, that runs
the calls submitted to it in order (``replica-<r>``: that replica's part of each refit, its join;
``control-<r>``: train rank 0's calls to that replica's engine; ``background``: the refits sent
from a snapshot under ``refit.overlap``). A replica that leaves retires its lanes; :meth:`Runner.close`
retires every lane and joins its thread. A lane whose call is stuck (a peer that stalls inside a
transport wait) is not waited for beyond the bound given: its thread is a daemon and ends with
the call, whose own waits are bounded by ``refit.timeout_s``, so an exiting process is never held
by it (Python joins a ``ThreadPoolExecutor``'s workers at exit; it does not join daemons).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future

logger = logging.getLogger(__name__)

PREFIX = "megatron_refit-"
"""Every thread of ours is named ``PREFIX + <lane>`` (a test lists what is left after close)."""


class Lane:
    """One named daemon thread running the calls submitted to it, in order."""

    def __init__(self, name: str):
        self.name = name
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=PREFIX + name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        future: Future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def _loop(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 -- the caller reads it from the future
                future.set_exception(exc)

    @property
    def busy(self) -> bool:
        return self._thread.is_alive() and not self._calls.empty()

    def retire(self, wait_s: float | None = None) -> bool:
        """No more calls: the queued ones are cancelled, the running one ends the thread. Waits up
        to ``wait_s`` (None: not at all) for it; returns whether the thread has ended."""
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._calls.put(None)
        if wait_s is not None:
            self._thread.join(wait_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


class Runner:
    """The lanes of one fleet on one train rank (see the module docstring)."""

    def __init__(self):
        self._lanes: dict[str, Lane] = {}
        self._lock = threading.Lock()
        self._closed = False

    def lane(self, name: str) -> Lane:
        """The lane ``name``, started on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"refit: the fleet is closed; no lane {name!r} starts")
            lane = self._lanes.get(name)
            if lane is None or not lane.alive:
                lane = self._lanes[name] = Lane(name)
            return lane

    def submit(self, name: str, fn: Callable, *args, **kwargs) -> Future:
        return self.lane(name).submit(fn, *args, **kwargs)

    def retire(self, *names: str, wait_s: float | None = None) -> None:
        """Retire the lanes ``names`` (a replica that left or was dropped), waiting up to
        ``wait_s`` for each (None: not at all: its engine may hang)."""
        with self._lock:
            lanes = [self._lanes.pop(name) for name in names if name in self._lanes]
        for lane in lanes:
            lane.retire(wait_s)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._lanes)

    def close(self, wait_s: float = 5.0) -> list[str]:
        """Retire every lane and join their threads, up to ``wait_s`` in all; returns the lanes
        still running a call then (each ends with its call, a daemon meanwhile)."""
        with self._lock:
            self._closed, lanes, self._lanes = True, list(self._lanes.values()), {}
        for lane in lanes:
            lane.retire()
        deadline = time.monotonic() + wait_s
        for lane in lanes:
            lane.retire(max(0.0, deadline - time.monotonic()))
        stuck = [lane.name for lane in lanes if lane.alive]
        if stuck:
            logger.warning("refit: lanes %s still run a call after close (each ends with it)", stuck)
        return stuck


def running_threads() -> list[str]:
    """The names of this process's threads of ours that are alive (a leak check)."""
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(PREFIX) and t.is_alive())


def abort_at_exit(owner, reason: str) -> Callable[[], None]:
    """``owner.abort(reason)`` when the interpreter exits (``atexit``: after Python joined its
    non-daemon threads, while daemon threads still run; a Ctrl-C or an error that left the training
    loop without closing), unless the function returned is called first (``close()`` does). The
    owner is held weakly: one that was collected is not kept alive for it."""
    ref = weakref.ref(owner)

    def at_exit() -> None:
        target = ref()
        if target is not None:
            target.abort(reason)

    atexit.register(at_exit)
    return lambda: atexit.unregister(at_exit)
