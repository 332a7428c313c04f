"""Byte transport between train and generation ranks over torch.distributed.

One process group holds every train and generation rank. It is created from its own
TCPStore rendezvous, independent of the trainer's and the engine's default groups
(Megatron and vLLM each keep theirs). NCCL on GPU, gloo on CPU: the same calls, only the
backend and the buffers' device differ. Every wait has a timeout; a dead or silent peer
surfaces as :class:`RefitTimeoutError` / :class:`RefitTransportError` naming the peer.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class RefitTransportError(RuntimeError):
    """A transfer failed: the peer closed the connection, crashed or misbehaved."""


class RefitTimeoutError(RefitTransportError):
    """A wait ran past ``timeout_s``."""


BACKENDS = ("gloo", "nccl")


@dataclass
class Pending:
    """An outstanding send or receive."""

    work: object
    peer: int
    what: str
    buffer: torch.Tensor = field(repr=False)
    direct: bool = False
    """The buffer is the tensor itself (no packing / unpacking)."""


class RefitGroup:
    """The refit process group: ranks ``0..num_train-1`` train, then generation ranks."""

    def __init__(self, pg, *, rank: int, world_size: int, backend: str, timeout_s: float, store=None):
        self._pg = pg
        self._store = store  # keep the rendezvous alive as long as the group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    @classmethod
    def connect(
        cls,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 120.0,
    ) -> "RefitGroup":
        """Rendezvous at ``host:port`` (rank 0 hosts the store) and build the group."""
        if backend not in BACKENDS:
            raise ValueError(f"transport backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"refit rank {rank} outside world of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        except RuntimeError as exc:  # e.g. the store host never came up
            raise RefitTimeoutError(f"refit rendezvous at {host}:{port} failed for rank {rank}: {exc}") from exc
        prefixed = dist.PrefixStore("megatron_refit", store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        return cls(pg, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s, store=store)

    # -- point to point -------------------------------------------------------------------
    def isend(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        return Pending(self._pg.send([buffer], peer, tag), peer, f"send to rank {peer}", buffer)

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        return Pending(self._pg.recv([buffer], peer, tag), peer, f"receive from rank {peer}", buffer)

    def send_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        """A small control message (digests), on the group's own device, also in colocated mode."""
        return self.isend(tensor.to(self.device), peer, tag)

    def recv_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.irecv(tensor.to(self.device), peer, tag)

    def wait(self, pending: Pending) -> None:
        self._wait(pending.work, pending.what, pending.peer)

    def _wait(self, work, what: str, peer: int | None) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            msg = str(exc)
            who = f" (peer: refit rank {peer})" if peer is not None else ""
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                raise RefitTimeoutError(
                    f"refit rank {self.rank}: {what} timed out after {self.timeout_s:.0f} s{who}"
                ) from exc
            raise RefitTransportError(f"refit rank {self.rank}: {what} failed{who}: {msg.splitlines()[0]}") from exc

    # -- small collectives (prepare / per-refit handshake only) ---------------------------
    def all_gather_tensor(self, value: torch.Tensor) -> list[torch.Tensor]:
        value = value.to(self.device)
        out = [torch.empty_like(value) for _ in range(self.world_size)]
        self._wait(self._pg.allgather([out], [value]), "all_gather", None)
        return [t.cpu() for t in out]

    def all_gather_object(self, obj) -> list:
        """Pickled all-gather (sizes first, then padded payloads)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.all_gather_tensor(torch.tensor([payload.numel()], dtype=torch.int64))
        width = int(max(int(s) for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = self.all_gather_tensor(padded)
        return [pickle.loads(g[: int(n)].numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def all_gather_unique(self, obj) -> list:
        """:meth:`all_gather_object` for objects that many ranks share (DP replicas hold the
        same pieces): ranks compare digests first, then one holder of each distinct object
        broadcasts it; equal objects come back as one object. At full scale this moves
        (distinct objects) x (size) instead of (world size) x (largest size)."""
        blob = pickle.dumps(obj)
        mine = hashlib.sha256(blob).digest()
        digests = self.all_gather_object(mine)
        holder: dict[bytes, int] = {}
        for rank, digest in enumerate(digests):
            holder.setdefault(digest, rank)
        objects: dict[bytes, object] = {}
        for digest, src in holder.items():
            size = torch.tensor([len(blob) if src == self.rank else 0], dtype=torch.int64, device=self.device)
            self._broadcast(size, src)
            payload = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device) if src == self.rank
                       else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
            self._broadcast(payload, src)
            objects[digest] = obj if digest == mine else pickle.loads(payload.cpu().numpy().tobytes())
        return [objects[digest] for digest in digests]

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(self._pg.broadcast([tensor], opts), f"broadcast from rank {src}", src)

    def close(self) -> None:
        self._pg = None
        self._store = None
