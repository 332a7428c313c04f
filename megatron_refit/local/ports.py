"""Free TCP ports for the rendezvous of spawned ranks and for test servers, unique across the
processes of this machine.

A port is chosen free, then bound seconds later by a rank or a server that is still starting.
Two test processes running at once (``make test`` runs its suites in lanes) could choose the
same port in that window: one rendezvous then fails with ``EADDRINUSE`` and the other group's
ranks join the wrong one. So every choice is recorded in a shared file under a lock, and a port
chosen in the last :data:`RESERVE_S` seconds is not chosen again by anyone.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import socket
import tempfile
import time

RESERVE_S = 600.0
"""How long a chosen port stays reserved for its chooser (longer than any start-up to its bind)."""

_RNG = random.SystemRandom()  # not the random module's state: tests seed that


def _registry() -> str:
    """The registry file: ``REFIT_PORTS_FILE``, else one per user in the temp dir (another user's
    would not be writable; their ports are still skipped when taken, by the bind)."""
    return os.environ.get("REFIT_PORTS_FILE") or os.path.join(tempfile.gettempdir(),
                                                              f"megatron-refit-ports-{os.getuid()}.json")


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, below the kernel's ephemeral range where it is known (a
    port from that range, free when chosen, can be taken by an outgoing connection, e.g. one of
    gloo's pair connections, before the rendezvous binds it), none chosen by any process of
    this machine in the last :data:`RESERVE_S` seconds. Every socket is held until all are
    chosen (ports picked one at a time could repeat)."""
    path = _registry()
    with open(path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        lock.seek(0)
        now = time.time()
        try:
            taken = {int(p): t for p, t in json.loads(lock.read() or "{}").items() if now - t < RESERVE_S}
        except (ValueError, AttributeError):  # a torn or foreign file: start it again
            taken = {}
        ports = _bind_free(count, set(taken))
        taken.update({p: now for p in ports})
        lock.seek(0)
        lock.truncate()
        lock.write(json.dumps({str(p): t for p, t in taken.items()}))
    return ports


def _bind_free(count: int, avoid: set[int]) -> list[int]:
    low = _ephemeral_low()
    socks, tries = [], 0
    try:
        while len(socks) < count:
            tries += 1
            port = _RNG.randrange(max(1024, low - 10000), low) if low and tries <= 100 else 0  # then the kernel's
            if port in avoid:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in avoid:
                s.close()
                continue
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int | None:
    """The first port of the kernel's ephemeral range (Linux), if it leaves room below."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return low if low > 2048 else None


def free_port() -> int:
    return free_ports(1)[0]
