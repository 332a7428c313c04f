"""Ports chosen for rendezvous and test servers are never handed out twice on one machine within
their reservation (processes choosing at once: tests/mp/test_ports.py)."""

from __future__ import annotations

import json
import time

from megatron_refit.local import ports


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
