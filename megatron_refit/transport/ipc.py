"""Colocated refit: trainer and engine share devices; bucket bytes go through shared buffers.

``IpcTransport`` wraps a :class:`~megatron_refit.transport.ProcessGroupTransport` for the endpoint. Each train
rank's two staging buffers (the endpoint's double buffer) live in memory the other processes
map: CUDA IPC handles (``torch.multiprocessing``'s ``reduce_tensor``) on a GPU, POSIX shared
memory on CPU. A sender packs a bucket into its buffer and sends a 24-byte control message
(bucket, buffer, length) over the refit group; the receiver unpacks straight from the mapped
buffer into engine storage and acknowledges, which frees the buffer for the sender's next
bucket. No weight byte crosses a socket or NCCL; control messages carry timeouts like every
other wait. Every item is packed (no direct sends: only the staging buffers are shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import torch

from megatron_refit.transport.base import Pending, Transport
from megatron_refit.transport.process_group import ProcessGroupTransport


@dataclass
class _SharedBuffer:
    tensor: torch.Tensor
    handle: tuple
    shm: shared_memory.SharedMemory | None = None


def _create(nbytes: int, device: torch.device) -> _SharedBuffer:
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return _SharedBuffer(t, ("cuda", cuda_handle(reduce_tensor(t))))
    shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
    t = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return _SharedBuffer(t, ("cpu", shm.name, nbytes), shm)


_STORAGES = ("TypedStorage", "UntypedStorage")


def cuda_handle(reduced: tuple) -> list:
    """``reduce_tensor``'s output for one of our uint8 staging buffers as plain data (what
    travels to the peers: no classes, no functions; see :mod:`megatron_refit.wire`)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    rebuild, (tensor_cls, size, stride, offset, storage_cls, dtype, *rest) = reduced
    if rebuild is not rebuild_cuda_tensor or tensor_cls is not torch.Tensor or dtype != torch.uint8:
        raise TypeError(f"not a plain uint8 CUDA tensor handle: {rebuild.__name__}, {tensor_cls}, {dtype}")
    if storage_cls.__name__ not in _STORAGES:
        raise TypeError(f"unexpected storage class {storage_cls} in a CUDA IPC handle")
    return [list(size), list(stride), offset, storage_cls.__name__, *rest]


def cuda_rebuild_args(plain: list) -> tuple:
    """The arguments of ``rebuild_cuda_tensor`` from :func:`cuda_handle`'s plain data."""
    size, stride, offset, storage, *rest = plain
    if storage not in _STORAGES:
        raise ValueError(f"unexpected storage class {storage!r} in a CUDA IPC handle from a peer")
    storage_cls = torch.storage.TypedStorage if storage == "TypedStorage" else torch.UntypedStorage
    return (torch.Tensor, torch.Size(size), tuple(stride), offset, storage_cls, torch.uint8, *rest)


def _open(handle: tuple) -> _SharedBuffer:
    if handle[0] == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return _SharedBuffer(rebuild_cuda_tensor(*cuda_rebuild_args(handle[1])), handle)
    _, name, nbytes = handle
    # Python 3.12 registers segments opened by name with the resource tracker too (3.13 has
    # track=False), which would unlink the owner's segment when this process exits, and
    # unregistering afterwards removes the owner's entry from the tracker the spawned ranks
    # share. The owner alone manages the lifetime: attach without registering.
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        shm = shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register
    t = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
    return _SharedBuffer(t, handle, shm)


class _Both:
    """Waits on the control send and the acknowledgement receive of one bucket."""

    def __init__(self, *works):
        self.works = works

    def wait(self, timeout):
        for work in self.works:
            work.wait(timeout)


class IpcTransport(Transport):
    """A refit group whose bucket bytes travel through shared staging buffers; control
    messages and collectives go over the :class:`ProcessGroupTransport` it wraps."""

    direct_ok = False
    """The endpoint packs every item (only the staging buffers are shared)."""
    shares_buffers = True

    def __init__(self, group: ProcessGroupTransport, *, num_train: int, device: torch.device | str | None = None):
        self.group = group
        self.num_train = num_train
        self.device = torch.device(device) if device is not None else group.device
        """Where the staging buffers live: the trainer's GPU (CUDA IPC; the control messages
        still travel over the group, gloo will do) or host memory (POSIX shared memory)."""
        self._own: list[_SharedBuffer] = []
        self._peers: dict[int, list[_SharedBuffer]] = {}
        self.bytes_shared = 0
        """Payload bytes handed over through shared buffers so far (this rank's side)."""

    # what the wrapped group does and knows
    rank = property(lambda self: self.group.rank)
    world_size = property(lambda self: self.group.world_size)
    backend = property(lambda self: self.group.backend)
    timeout_s = property(lambda self: self.group.timeout_s)
    broken = property(lambda self: self.group.broken)

    def send_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.group.send_small(tensor, peer, tag)

    def recv_small(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        return self.group.recv_small(tensor, peer, tag)

    def exchange(self, call: str, values=()) -> list[list[int]]:
        return self.group.exchange(call, values)

    def all_gather_object(self, obj, call: str = "message") -> list:
        return self.group.all_gather_object(obj, call)

    def open_refit(self) -> None:
        self.group.open_refit()

    def await_refit(self, timeout_s: float) -> None:
        self.group.await_refit(timeout_s)

    def all_gather_unique(self, obj, call: str = "message", *, digests: bool = False,
                          known: dict | None = None) -> list:
        return self.group.all_gather_unique(obj, call, digests=digests, known=known)

    def begin(self, phase: str) -> None:
        self.group.begin(phase)

    def staging(self, count: int, width: int) -> list[torch.Tensor]:
        """The endpoint's staging buffers; train ranks' are shared. Collective: every rank
        calls it once per refit (handles are exchanged when a train rank re-allocates)."""
        grown = self.rank < self.num_train and (len(self._own) < count or
                                                 any(b.tensor.numel() < width for b in self._own[:count]))
        if grown:
            self._close_own()
            self._own = [_create(width, self.device) for _ in range(2)]
        handles = self.group.all_gather_object([b.handle for b in self._own] if grown else None, "refit")
        for peer, peer_handles in enumerate(handles):
            if peer_handles is not None and peer != self.rank:
                for buf in self._peers.pop(peer, []):
                    if buf.shm is not None:
                        buf.shm.close()
                self._peers[peer] = [_open(h) for h in peer_handles]
        if self.rank < self.num_train:
            return [b.tensor[:width] for b in self._own[:count]]
        return [torch.empty(0, dtype=torch.uint8) for _ in range(count)]

    def isend(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        slot = next(i for i, b in enumerate(self._own) if b.tensor.data_ptr() == buffer.data_ptr())
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()  # the packed bytes are visible to the peer
        control = torch.tensor([tag, slot, buffer.numel()], dtype=torch.int64)
        ack = torch.zeros(1, dtype=torch.int64)
        work = _Both(self.group.isend(control, peer, tag).work, self.group.irecv(ack, peer, tag).work)
        self.bytes_shared += buffer.numel()
        return Pending(work, peer, f"shared-buffer send to rank {peer} (acknowledgement)", buffer)

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        control = torch.zeros(3, dtype=torch.int64)
        pending = self.group.irecv(control, peer, tag)
        pending.what = f"shared-buffer control from rank {peer}"
        pending.control = control
        return pending

    def wait(self, pending: Pending) -> None:
        self.group.wait(pending)
        control = pending.control
        if control is not None:  # receiver: the bytes are in the sender's buffer
            tag, slot, nbytes = (int(x) for x in control)
            pending.buffer = self._peers[pending.peer][slot].tensor[:nbytes]
            pending.tag = tag
            self.bytes_shared += nbytes

    def release(self, pending: Pending) -> None:
        """Receiver: the bucket is unpacked; the sender may reuse its buffer."""
        if pending.control is not None:
            if pending.buffer.is_cuda:
                torch.cuda.current_stream().synchronize()
            self.group.wait(self.group.isend(torch.ones(1, dtype=torch.int64), pending.peer, pending.tag))

    def abort(self, reason: str) -> None:
        """:meth:`ProcessGroupTransport.abort` of the group it wraps (every wait goes through it)."""
        self.group.abort(reason)

    def _close_own(self) -> None:
        for buf in self._own:
            if buf.shm is not None:
                buf.tensor = None
                buf.shm.close()
                buf.shm.unlink()
        self._own = []

    def close(self) -> None:
        """Collective (every rank, after its last refit): unmap the peers' buffers, wait until
        every rank has, then free this rank's own (a CUDA IPC producer must outlive the
        consumers' mappings)."""
        for bufs in self._peers.values():
            for buf in bufs:
                buf.tensor = None
                if buf.shm is not None:
                    buf.shm.close()
        self._peers = {}
        if self.device.type == "cuda":
            import gc

            gc.collect()  # mapped CUDA IPC memory is released when the last tensor on it is freed
            torch.cuda.synchronize()
        if self.group.broken is None:  # a broken group cannot meet: free this rank's buffers regardless
            self.group.barrier("close")
        self._close_own()
