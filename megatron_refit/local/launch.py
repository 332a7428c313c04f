"""Run a function in N spawned processes (one per rank) with a hard timeout.

Used by the demo, the benchmarks and the multi-process tests. Each rank's return value
comes back to the parent; an exception in any rank, or the timeout, kills every rank and
raises in the parent with the failing rank's traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from megatron_refit.errors import SpawnError  # noqa: F401 -- raised here; its callers take it here too
from megatron_refit.local.ports import free_port, free_ports  # noqa: F401 -- this module's callers take them here


def _to_bytes(value: Any) -> bytes:
    # torch.save, not the queue's pickler: torch registers shared-memory reductions for
    # tensors with multiprocessing, and those need the sender alive when the parent reads.
    import io

    import torch

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _from_bytes(data: bytes) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


THIRD_PARTY_WARNINGS = (r"megatron\.", r"torch\.", r"transformers\.", r"modelopt", r"nvidia_resiliency_ext")
"""Modules whose warnings a quiet spawned rank drops (Apex / TE / absl fallbacks, deprecations:
the same lines once per rank). Warnings of megatron_refit and conversion still show."""

QUIET_ENV = "REFIT_QUIET_LOGS"
"""Set to ``1`` inside a rank spawned with ``quiet=True``: model builders (``conversion.testing``)
read it to silence third-party chatter without importing this module."""


@contextlib.contextmanager
def quiet_imports(*modules: str):
    """Imports (a forkserver's preload) with third-party warnings and log lines below ERROR
    dropped: :data:`THIRD_PARTY_WARNINGS` and the modules named."""
    import logging
    import warnings

    with warnings.catch_warnings():
        for module in (*THIRD_PARTY_WARNINGS, *modules):
            warnings.filterwarnings("ignore", module=module)
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(logging.NOTSET)


CORES_ENV = "REFIT_CORES"
"""The cores this run may use (``make test`` sets it to the machine's cores divided by its lanes,
``scripts/run_suites.sh``); unset, all of the machine's."""


def cores() -> int:
    """The cores a group of ranks shares (:data:`CORES_ENV`, else the machine's)."""
    return max(1, int(os.environ.get(CORES_ENV) or os.cpu_count() or 1))


def quiet() -> bool:
    """True inside a rank spawned with ``quiet=True`` (helpers silence third-party chatter)."""
    return os.environ.get(QUIET_ENV) == "1"


def _entry(fn, rank, world_size, port, args, results, env):
    if env.get(QUIET_ENV, "0") == "1":
        import logging
        import warnings

        logging.disable(logging.WARNING)  # Megatron/Bridge import chatter, once per rank
        for module in THIRD_PARTY_WARNINGS:  # PYTHONWARNINGS in env would come too late: set here
            warnings.filterwarnings("ignore", module=module)
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
    import torch

    # the ranks share this run's cores: more intra-op threads than cores per rank only spin
    torch.set_num_threads(max(1, cores() // world_size))
    try:
        profile_dir = os.environ.get("REFIT_CPROFILE_DIR")  # debugging: one cProfile dump per rank
        if profile_dir:
            import cProfile

            profiler = cProfile.Profile()
            out = profiler.runcall(fn, rank, world_size, port, *args)
            profiler.dump_stats(os.path.join(profile_dir, f"rank{rank}.prof"))
        else:
            out = fn(rank, world_size, port, *args)
        results.put((rank, True, _to_bytes(out)))
    except BaseException:  # noqa: BLE001 -- reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


PRELOAD_ENV = "REFIT_SPAWN_PRELOAD"
"""Comma-separated modules: when set, ranks fork from a forkserver that imported them once
(the tests' :mod:`megatron_refit.testing.preload`); unset, every rank is a fresh interpreter."""


def preload_env(*modules: str) -> dict[str, str]:
    """This environment with the ranks of a program it starts forked from a forkserver that
    imported ``modules`` (a script whose ranks need torch alone need not import Megatron once
    more: 18 against 27 CPU-s for ``scripts/bench_fanout.py`` at its test's size on 2 cores)."""
    return {**os.environ, PRELOAD_ENV: ",".join(modules)}


def _context():
    modules = [m for m in os.environ.get(PRELOAD_ENV, "").split(",") if m]
    if not modules:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(modules)
    return ctx


def _others(first: int, procs, results, out: dict, may_die: frozenset[int], grace_s: float = 1.0) -> str:
    """What the other ranks did within ``grace_s`` of rank ``first``'s failure: their own
    failures' last lines and deaths, so a rank that fails because a peer crashed does not hide
    the peer's cause (a rank's report can arrive after its peer's)."""
    notes: dict[int, str] = {}
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            rank, ok, value = results.get(timeout=0.05)
        except queue.Empty:
            if all(p.exitcode is not None for r, p in enumerate(procs) if r != first and r not in out):
                break  # every other rank has ended, and what they sent is read
            continue
        if not ok and rank != first:
            notes[rank] = f"failed: {[line for line in str(value).splitlines() if line.strip()][-1][:300]}"
    for r, p in enumerate(procs):
        if r not in notes and r != first and r not in out and r not in may_die and p.exitcode not in (None, 0):
            notes[r] = f"died with exit code {p.exitcode}"
    return f" (meanwhile {'; '.join(f'rank {r} {n}' for r, n in sorted(notes.items()))})" if notes else ""


def run_spawned(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
    quiet: bool = True,
    may_die: frozenset[int] = frozenset(),
    port: int | None = None,
) -> list[Any]:
    """Call ``fn(rank, world_size, port, *args)`` in ``world_size`` fresh processes (forked
from a warm forkserver with ``REFIT_SPAWN_PRELOAD``, see :data:`PRELOAD_ENV`).

    ``fn`` must be importable (module-level). Returns the ranks' results in rank order.
    Ranks in ``may_die`` (failure tests kill them on purpose) may exit without a result;
    theirs is None. ``port`` (default: a free one) is passed to every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    port = port or free_port()
    base_env = {"OMP_NUM_THREADS": "1", "REFIT_QUIET_LOGS": "1" if quiet else "0", **(env or {})}
    if quiet:
        base_env.setdefault("PYTHONWARNINGS", "ignore")  # for processes a rank starts in turn
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results, base_env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            for r in may_die:
                if r not in out and procs[r].exitcode not in (None, 0):
                    out[r] = None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SpawnError(f"ranks {sorted(set(range(world_size)) - set(out))} ran past {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in out and r not in may_die and p.exitcode not in (None, 0)]
                if dead:
                    # Give a crashing rank's report a moment to arrive before blaming it.
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except queue.Empty:
                        raise SpawnError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                else:
                    continue
            if not ok:
                raise SpawnError(f"rank {rank} failed{_others(rank, procs, results, out, may_die)}:\n{value}")
            out[rank] = _from_bytes(value)
    finally:
        for p in procs:
            p.join(timeout=5.0 if len(out) == world_size else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    return [out.get(r) for r in range(world_size)]
