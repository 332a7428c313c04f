"""The refit group's rendezvous: a TCPStore that listens only on the configured address,
and a join check that names a duplicate rank or a world-size mismatch instead of leaving
torch's process-group rendezvous to fail on them with a raw store error or a hang.

Rank 0 hosts the store. Every rank then adds itself under ``join/<rank>`` (a second process
with the same rank sees a count of 2 and stops), writes the world size it was started with
under ``world/<rank>``, compares it with rank 0's, and waits, up to the timeout, for every
rank of its world to do the same. Any rank whose world size differs, any rank that never
came and any rank that came twice is named in the error, on every rank that can see it.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

from megatron_refit.errors import RefitTransportError

PREFIX = "megatron_refit_join/"


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` only (the store's own would bind every interface)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(infos[0][4])
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(host: str, port: int, *, rank: int, world_size: int, timeout: datetime.timedelta):
    """The TCPStore; rank 0 hosts it, bound to ``host`` only (the store owns the socket)."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    sock = listening_socket(host, port)
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes the descriptor
    return store


def join(store, *, rank: int, world_size: int, where: str, timeout: datetime.timedelta) -> None:
    """Check in, wait for the others, and compare world sizes (see the module docs)."""
    if store.add(f"{PREFIX}join/{rank}", 1) > 1:
        raise RefitTransportError(f"refit rank {rank} joined the refit group at {where} twice: another process "
                                  f"already holds rank {rank} (two generation ranks with the same gen_index / "
                                  f"replica?)")
    store.set(f"{PREFIX}world/{rank}", str(world_size))
    keys = [f"{PREFIX}world/{r}" for r in range(world_size)]
    if rank != 0:  # the host's world size is there already: a mismatch with it stops this rank at once
        try:
            store.wait([keys[0]], timeout)
            host_world = _worlds(store, [0])[0]
        except RuntimeError as exc:
            raise RefitTransportError(f"refit rendezvous at {where}: the store is gone (refit rank 0, its host, "
                                      f"exited: its own error says why)") from exc
        if host_world != world_size:
            _done_reading(store, rank, [])
            raise RefitTransportError(f"refit rendezvous at {where}: refit rank {rank} was started with world size "
                                      f"{world_size}{_mismatch({0: host_world}, world_size)} (num_train + num_gen "
                                      f"must be the same on every rank)")
    # the host waits a little longer: the others read the store to name who is missing
    grace = datetime.timedelta(seconds=2.0 if rank == 0 else 0.0)
    try:
        store.wait(keys, timeout + grace)
    except RuntimeError as exc:  # DistStoreError: a timeout
        waited = f"within {timeout.total_seconds():g} s (refit rank {rank} waited)"
        try:
            present = [r for r in range(world_size) if store.check([keys[r]])]
            twice = [r for r in range(world_size) if store.check([f"{PREFIX}join/{r}"])
                     and store.add(f"{PREFIX}join/{r}", 0) > 1]
            worlds = _worlds(store, present)
        except RuntimeError:
            raise RefitTransportError(f"refit rendezvous at {where}: not every rank of {world_size} joined "
                                      f"{waited}, and the store is gone (refit rank 0, its host, exited)") from exc
        missing = [r for r in range(world_size) if r not in present]
        detail = f"; refit rank(s) {twice} joined twice" if twice else ""
        detail += _mismatch(worlds, world_size)
        _done_reading(store, rank, present)
        raise RefitTransportError(f"refit rendezvous at {where}: refit rank(s) {missing} of {world_size} never "
                                  f"joined {waited}{detail}") from exc
    try:
        worlds = _worlds(store, range(world_size))
    except RuntimeError as exc:
        raise RefitTransportError(f"refit rendezvous at {where}: the store is gone (refit rank 0, its host, "
                                  f"exited: its own error says why)") from exc
    if any(w != world_size for w in worlds.values()):
        _done_reading(store, rank, range(world_size))
        raise RefitTransportError(f"refit rendezvous at {where}: refit rank {rank} was started with world size "
                                  f"{world_size}{_mismatch(worlds, world_size)} (num_train + num_gen must be the "
                                  f"same on every rank)")


def _worlds(store, ranks) -> dict[int, int]:
    ranks = list(ranks)
    values = store.multi_get([f"{PREFIX}world/{r}" for r in ranks]) if ranks else []
    return {r: int(v) for r, v in zip(ranks, values)}


def _done_reading(store, rank: int, present) -> None:
    """Before a failed join returns: the others say they have read the store, and its host
    (rank 0) waits a few seconds for them, so that they can name what went wrong too."""
    try:
        if rank != 0:
            store.set(f"{PREFIX}read/{rank}", "1")
        else:
            store.wait([f"{PREFIX}read/{r}" for r in present if r != 0], datetime.timedelta(seconds=5))
    except RuntimeError:
        pass  # best effort: the error is raised regardless


def _mismatch(worlds: dict[int, int], mine: int) -> str:
    other = {r: w for r, w in worlds.items() if w != mine}
    return f"; refit rank(s) {sorted(other)} were started with world size(s) {sorted(set(other.values()))}" if other \
        else ""
