"""Aborting a gloo process group: failing every wait on it now, in whatever thread it blocks.

gloo has no abort of its own that releases a blocked ``work.wait``: ``ProcessGroupGloo.abort()``
and ``shutdown()`` leave it waiting until its timeout, and destroying the group joins gloo's
loop thread, which is inside that same wait. What does release it is shutting down the group's
connected sockets (its pairs): each pending send, recv or collective then raises "Connection
closed by peer" within one poll of gloo's loop, here and at the peers of those pairs, so a
peer mid-refit learns of it at once too. gloo's listening socket is left alone (shutting it
down kills gloo's listener thread, and the process with it).

Which sockets are a group's: every gloo group has a device of its own, whose listener (one
address per rank) accepts or makes every pair. :func:`gloo_device` creates the device (its
listener appears among the process's sockets: Linux's ``/proc/self/fd``, under a short lock),
every rank leaves its listener's address in the group's store before building the group, and
:meth:`GlooSockets.find` takes, once it is built, the sockets either accepted on this rank's
listener or connected to a peer's. Each is kept by its inode, so a descriptor number closed and
reused meanwhile is never touched. Groups built at once in several threads (each replica's join
in its lane) never take each other's sockets. Lazily connected pairs (``TORCH_GLOO_LAZY_INIT``)
are not seen.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

logger = logging.getLogger(__name__)

LISTENER = "megatron_refit_gloo_listener"
"""Store key ``LISTENER/<rank>``: that rank's gloo listener address (``host port``)."""

_CREATING = threading.Lock()
"""One device created at a time (its listener is told from the others' by the difference)."""


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: ``{fd: "socket:[inode]"}`` (empty off Linux)."""
    out = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, or one closed meanwhile
            continue
        if link.startswith("socket:"):
            out[int(name)] = link
    return out


def _addresses(fd: int):
    """``(listening, local (host, port), peer (host, port) or None)`` of a TCP/IP socket; None else."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
        local = _host_port(sock.getsockname())
        try:
            peer = _host_port(sock.getpeername())
        except OSError:
            peer = None
        return listening, local, peer
    except OSError:
        return None
    finally:
        sock.close()


def _host_port(address) -> tuple[str, int]:
    return address[0].removeprefix("::ffff:"), int(address[1])


def gloo_device():
    """A gloo device for one group, and its listener's ``(host, port)`` (None off Linux)."""
    import torch.distributed as dist

    with _CREATING:
        before = _sockets()
        device = dist.ProcessGroupGloo.create_default_device()
        new = [fd for fd, link in _sockets().items() if before.get(fd) != link]
    listeners = [a[1] for a in map(_addresses, new) if a is not None and a[0]]
    return device, (listeners[0] if len(listeners) == 1 else None)


def publish(store, rank: int, listener) -> None:
    """Leave this rank's listener address in the group's store (before the group is built)."""
    store.set(f"{LISTENER}/{rank}", "" if listener is None else f"{listener[0]} {listener[1]}")


class GlooSockets:
    """The connected sockets of one gloo group (see the module docstring)."""

    def __init__(self):
        self._owned: dict[int, str] = {}

    def find(self, store, rank: int, world_size: int, listener) -> None:
        """Once the group is built: its sockets, from every rank's listener address in ``store``."""
        if listener is None:
            return
        peers = set()
        for other in range(world_size):
            if other != rank:
                host, _, port = store.get(f"{LISTENER}/{other}").decode().partition(" ")
                if port:
                    peers.add((host, int(port)))
        for fd, link in _sockets().items():
            found = _addresses(fd)
            if found is None or found[0] or found[2] is None:
                continue
            if found[1] == listener or found[2] in peers:
                self._owned[fd] = link

    def __len__(self) -> int:
        return len(self._owned)

    def shutdown(self) -> int:
        """Shut down every socket still this group's (``SHUT_RDWR``: the peer sees it closed);
        the descriptors stay gloo's to close. Returns how many were shut down."""
        owned, self._owned = self._owned, {}
        done = 0
        for fd, link in owned.items():
            try:
                if os.readlink(f"/proc/self/fd/{fd}") != link:  # closed, and the number reused
                    continue
                sock = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
            except OSError:  # not connected (any more)
                pass
            finally:
                sock.close()  # the duplicate only
        return done
