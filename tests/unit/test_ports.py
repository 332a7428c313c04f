"""Ports chosen for rendezvous and test servers are never handed out twice on one machine within
their reservation, whichever process asks (``make test`` runs suites at once)."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

from megatron_refit.testing import ports


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


def test_a_reserved_port_is_skipped_until_its_reservation_ends(tmp_path, monkeypatch):
    path = tmp_path / "ports.json"
    monkeypatch.setenv("REFIT_PORTS_FILE", str(path))
    first = ports.free_ports(50)
    later = [port for _ in range(20) for port in ports.free_ports(50)]  # 1,000 more: unreserved, some would repeat
    assert len(set(later)) == len(later) and not set(first) & set(later)
    # reservations older than RESERVE_S are dropped; a torn file starts again
    stale = {str(p): time.time() - ports.RESERVE_S - 1 for p in first}
    path.write_text(json.dumps(stale))
    ports.free_ports(1)
    assert not set(json.loads(path.read_text())) & {str(p) for p in first}
    path.write_text('{"1234": ')
    assert len(ports.free_ports(2)) == 2 and len(json.loads(path.read_text())) == 2
