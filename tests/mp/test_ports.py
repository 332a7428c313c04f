"""Processes choosing ports at once never share one (``make test`` runs suites at once; the
reservation itself: tests/unit/test_ports.py)."""

from __future__ import annotations

import json
import multiprocessing as mp

from megatron_refit.local import ports


def _choose(path: str, count: int, out) -> None:
    import os

    os.environ["REFIT_PORTS_FILE"] = path
    out.put(ports.free_ports(count))


def test_processes_choosing_at_once_never_share_a_port(tmp_path):
    path = str(tmp_path / "ports.json")
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_choose, args=(path, 60, out)) for _ in range(4)]
    for p in procs:
        p.start()
    chosen = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    every = [port for batch in chosen for port in batch]
    assert len(every) == 240 and len(set(every)) == 240
    assert set(json.loads((tmp_path / "ports.json").read_text())) == {str(p) for p in every}
