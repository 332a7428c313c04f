"""Byte transport between train and generation ranks over torch.distributed.

One process group holds every train and generation rank. It is created from its own
TCPStore rendezvous, independent of the trainer's and the engine's default groups
(Megatron and vLLM each keep theirs). NCCL on GPU, gloo on CPU: the same calls, only the
backend and the buffers' device differ. Every wait has a timeout; a dead or silent peer
surfaces as :class:`RefitTimeoutError` / :class:`RefitTransportError` naming the peer, and
the rank that reported the first failure in the group; after one, the group is broken and
says so at every later call until the ranks reconnect.

Every control collective (``prepare()``'s metadata, the per-refit handshake and summary,
colocated handles, ``close``) starts with :meth:`ProcessGroupTransport.exchange`: a fixed-size header carrying
the call it belongs to and its sequence number, so ranks in different calls (one side in
``prepare()``, the other in ``refit()``) stop with :class:`RefitProtocolError` naming both
sides' calls instead of reading one message's bytes as another's. Metadata travels as JSON
(:mod:`megatron_refit.wire`), never as pickles.
"""

from __future__ import annotations

import datetime
import hashlib
import struct

import torch
import torch.distributed as dist

from megatron_refit.errors import RefitProtocolError, RefitTimeoutError, RefitTransportError
from megatron_refit import wire
from megatron_refit.transport.abort import GlooSockets, gloo_device, publish
from megatron_refit.transport.base import Pending, Transport
from megatron_refit.transport.rendezvous import join, open_store

REFITS, NEXT_REFIT = "megatron_refit/refits", "megatron_refit/next_refit"
"""Store keys: the number of refits rank 0 began on the group, and ``NEXT_REFIT/<n>``, set
when refit ``n`` begins (engine ranks between refits wait for it)."""

MAGIC = 0x52_46_49_54_0006
"""First word of every control header: "RFIT" and the protocol version (6: prepare()'s digests, sizes and
agreement in the header rows, kind indices narrowed: plan.pieces.narrow)."""

CALLS = {"prepare": 1, "refit": 2, "close": 3, "message": 4, "report": 5, "fleet": 6, "overlap": 7, "probe": 8,
         "served": 9, "fanout": 10, "verdict": 11}
"""The calls control messages belong to (the header's second word)."""

HEADER_VALUES = 20
"""Values a control header carries after (magic, call, sequence)."""

DIGEST_WORDS = struct.Struct(">8I")
"""A sha256 as 8 words of 32 bits: how a digest travels in the control header."""

FIRST_FAILURE = "megatron_refit_first_failure"
"""Store key: the first failure any rank of the group reported."""

ABORTED = "aborted the refit group"
"""How a group that :meth:`ProcessGroupTransport.abort` ended says so."""

ABORT_NOTE_S = 1.0
"""How long an abort tries to leave its note (the first failure) in the store: at exit the store's
host (train rank 0) may be ending too, and an abort must not wait on it."""


BACKENDS = ("gloo", "nccl")


class ProcessGroupTransport(Transport):
    """The refit process group over torch.distributed P2P: ranks ``0..num_train-1`` train,
    then generation ranks; gloo on CPU, NCCL between GPUs."""

    HOST_DIRECT_BYTES = 1 << 20
    """``direct_bytes="auto"`` where the bytes are in host memory (gloo): a packing copy costs
    about as much as moving the bytes, so every transfer of at least 1 MiB skips it."""

    def auto_direct_bytes(self, bucket_bytes: int) -> int | None:
        """1 MiB in host memory (gloo), one bucket between GPUs (NCCL: see the base class)."""
        return self.HOST_DIRECT_BYTES if self.device.type == "cpu" else bucket_bytes

    def __init__(self, pg, *, rank: int, world_size: int, backend: str, timeout_s: float, store=None):
        self._pg = pg
        self._store = store  # keep the rendezvous alive as long as the group
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.phase = ""
        """What the group is doing (set by the endpoints), for failure messages."""
        self.broken: str | None = None
        """Set by the first timeout or transport failure: the group refuses every later call."""
        self._seq = 0

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
        namespace: str | None = None,
    ) -> ProcessGroupTransport:
        """Rendezvous at ``host:port`` (rank 0 hosts the store) and build the group.
        ``namespace``: a group of its own in a store another group's rank 0 already hosts
        there (every rank is its client; the keys live under the namespace), as each engine
        replica's group lives in the train ranks' control group's store."""
        if backend not in BACKENDS:
            raise ValueError(f"transport backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"refit rank {rank} outside world of {world_size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            if namespace is None:
                store = open_store(host, port, rank=rank, world_size=world_size, timeout=timeout)
            else:
                store = dist.PrefixStore(namespace, dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                                  timeout=timeout))
        except (RuntimeError, OSError) as exc:  # e.g. the store host never came up, the port is taken
            raise RefitTimeoutError(f"refit rendezvous at {host}:{port} failed for rank {rank}: "
                                    f"{str(exc).splitlines()[0]}") from exc
        try:
            join(store, rank=rank, world_size=world_size, where=f"{host}:{port}", timeout=timeout)
        except RefitTransportError:
            raise
        except RuntimeError as exc:  # the store itself failed (its host, rank 0, went away)
            raise RefitTransportError(f"refit rendezvous at {host}:{port} failed for rank {rank}: "
                                      f"{_first_line(exc)}") from exc
        prefixed = dist.PrefixStore("megatron_refit", store)
        sockets = GlooSockets()
        if backend == "gloo":
            device, listener = gloo_device()
            publish(store, rank, listener)  # every rank's, before any builds the group: see transport.abort
            options = dist.ProcessGroupGloo._Options()
            options._devices, options._timeout = [device], timeout
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, options)
            sockets.find(store, rank, world_size, listener)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        group = cls(pg, rank=rank, world_size=world_size, backend=backend, timeout_s=timeout_s, store=store)
        group.namespace = namespace
        group._sockets = sockets
        return group

    _sockets: GlooSockets | None = None

    def abort(self, reason: str) -> None:
        """Fail every wait on this group now, in whatever thread it blocks, here and at its peers
        mid-call (gloo: its pairs' sockets shut down, :mod:`~megatron_refit.transport.abort`;
        NCCL: the communicator aborted). The group is broken (``reason``); close it after."""
        if self.broken is None:
            self.broken = f"{ABORTED} ({reason})"
            # what its peers will name; briefly: at exit the store's host may be ending too
            self._first_failure(f"refit rank {self.rank}: {ABORTED} ({reason})", wait_s=ABORT_NOTE_S)
        if self._sockets is not None:
            self._sockets.shutdown()
        pg = self._pg
        if pg is not None and self.backend == "nccl" and hasattr(pg, "abort"):
            pg.abort()

    # -- point to point -------------------------------------------------------------------
    namespace: str | None = None
    """The keys' namespace in a store hosted by another group (None: this group hosts its own)."""

    @property
    def store(self):
        """The rendezvous store (hosted by rank 0; None once closed): others may leave small
        notes in it, as engine replicas announce joins and leaves to the train ranks' group."""
        return self._store

    refits = 0
    """The refits begun on this group as this rank last saw them (:meth:`open_refit`,
    :meth:`await_refit`)."""

    def open_refit(self) -> None:
        store = self._store
        if store is None:
            return
        self.refits = count = store.add(REFITS, 1)
        store.set(f"{NEXT_REFIT}/{count}", "1")
        if count > 1:  # the engine ranks waiting for it have read the count past it already
            store.delete_key(f"{NEXT_REFIT}/{count - 1}")

    def await_refit(self, timeout_s: float) -> None:
        store = self._store
        if store is None:
            return
        try:
            begun = store.add(REFITS, 0)
            if begun <= self.refits:  # none begun since this rank's last: wait for the next
                store.wait([f"{NEXT_REFIT}/{self.refits + 1}"], datetime.timedelta(seconds=timeout_s))
                begun = self.refits + 1
        except RuntimeError as exc:
            msg = _first_line(exc)
            if "timeout" in msg.lower() or "timed out" in msg.lower():
                raise RefitTimeoutError(f"refit rank {self.rank}: the train ranks began no refit within "
                                        f"{timeout_s:g} s (waiting for this group's refit {self.refits + 1})") from exc
            raise RefitTransportError(f"refit rank {self.rank}: the train ranks' store is gone while waiting for "
                                      f"this group's refit {self.refits + 1} (train rank 0 exited): {msg}") from exc
        self.refits = begun  # a refit this rank missed (it was elsewhere) is not waited for again

    def isend(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        what = f"send to rank {peer}"
        return Pending(self._post(self._usable().send, buffer, peer, tag, what), peer, what, buffer)

    def irecv(self, buffer: torch.Tensor, peer: int, tag: int) -> Pending:
        what = f"receive from rank {peer}"
        return Pending(self._post(self._usable().recv, buffer, peer, tag, what), peer, what, buffer)

    def _post(self, op, buffer, peer, tag, what):
        try:
            return op([buffer], peer, tag)
        except RuntimeError as exc:  # gloo refuses to post on a pair it already saw fail
            note = self._broke(f"{what} failed")
            raise RefitTransportError(f"refit rank {self.rank}: {what} failed (peer: refit rank {peer}): "
                                      f"{_first_line(exc)}{note}") from exc

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
            msg = _first_line(exc)
            who = f" (peer: refit rank {peer})" if peer is not None else ""
            if self.broken is not None and self.broken.startswith(ABORTED):  # this rank's own abort ended it
                raise RefitTransportError(f"refit rank {self.rank}: {what} ended: this rank {self.broken}") from exc
            if "timed out" in msg.lower() or "timeout" in msg.lower():
                note = self._broke(f"{what} timed out after {self.timeout_s:g} s")
                raise RefitTimeoutError(f"refit rank {self.rank}: {what} timed out after {self.timeout_s:g} s{who}"
                                        f"{note}") from exc
            note = self._broke(f"{what} failed")
            raise RefitTransportError(f"refit rank {self.rank}: {what} failed{who}: {msg}{note}") from exc

    # -- failure ----------------------------------------------------------------------------
    def begin(self, phase: str) -> None:
        """Name what the group is doing (``"prepare"``, ``"refit 7"``) for its failure messages."""
        self._usable()
        self.phase = phase

    def _usable(self):
        if self._pg is None:
            raise RefitTransportError(f"refit rank {self.rank}: the refit group is closed")
        if self.broken is not None:
            raise RefitTransportError(f"refit rank {self.rank}: the refit group is broken ({self.broken}); "
                                      f"every rank must reconnect (ProcessGroupTransport.connect) before the "
                                      "next refit")
        return self._pg

    def _broke(self, what: str) -> str:
        """Mark the group broken by ``what``; the end of the error message: where it happened
        and, if another rank reported a failure first, that one."""
        where = f" at {self.phase}" if self.phase else ""
        self.broken = f"{what}{where}"
        mine = f"refit rank {self.rank}: {what}{where}"
        first = self._first_failure(mine)
        return where if first in (None, mine) else f"{where}; the first failure in the group: {first}"

    def _first_failure(self, mine: str, wait_s: float = 5.0) -> str | None:
        store = self._store
        if store is None:
            return None
        try:  # the store lives in rank 0's process: it may be the one that died
            store.set_timeout(datetime.timedelta(seconds=min(self.timeout_s, wait_s)))
            return store.compare_set(FIRST_FAILURE, "", mine).decode(errors="replace")
        except Exception:  # noqa: BLE001 -- best effort: the error itself is raised regardless
            return None

    # -- control collectives (prepare, the per-refit handshake and summary) -------------------------
    def exchange(self, call: str, values=()) -> list[list[int]]:
        """A control collective: every rank shows ``[magic, call, sequence, *values]`` (up to
        :data:`HEADER_VALUES` int64 values) and gets every rank's values. Ranks in different
        calls or at different points of one raise :class:`RefitProtocolError` on every rank
        (then the sequence resynchronises, so the group stays usable)."""
        if call not in CALLS or len(values) > HEADER_VALUES:
            raise ValueError(f"control call must be one of {sorted(CALLS)} with <= {HEADER_VALUES} values, "
                             f"got {call!r} with {len(values)}")
        self._seq += 1
        header = torch.zeros(3 + HEADER_VALUES, dtype=torch.int64)
        header[:3] = torch.tensor([MAGIC, CALLS[call], self._seq])
        header[3:3 + len(values)] = torch.tensor([int(v) for v in values], dtype=torch.int64)
        rows = [row.tolist() for row in self._all_gather(header)]
        if any(row[:3] != rows[0][:3] for row in rows):
            self._seq = max(row[2] for row in rows)
            raise RefitProtocolError(f"refit ranks are in different calls: {_sides(rows)}. Every rank calls prepare() "
                                     f"once, then refit() / receive() with the same versions: do both sides read "
                                     f"the same refit config?")
        return [row[3:] for row in rows]

    def _all_gather(self, value: torch.Tensor) -> list[torch.Tensor]:
        value = value.to(self.device)
        out = [torch.empty_like(value) for _ in range(self.world_size)]
        self._wait(self._usable().allgather([out], [value]), "all_gather", None)
        return [t.cpu() for t in out]

    def all_gather_object(self, obj, call: str = "message") -> list:
        """Every rank's ``obj`` (plain data: see :mod:`megatron_refit.wire`), sizes in the header."""
        blob = wire.dumps(obj)
        sizes = [row[0] for row in self.exchange(call, [len(blob)])]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else padded[:0]
        gathered = self._all_gather(padded)
        return [wire.loads(g[:n].numpy().tobytes()) for g, n in zip(gathered, sizes)]

    def all_gather_unique(self, obj, call: str = "message", *, digests: bool = False,
                          known: dict | None = None) -> list:
        """:meth:`all_gather_object` for objects that many ranks share (DP replicas hold the
        same pieces): ranks compare digests first, then one holder of each distinct object
        broadcasts it; equal objects come back as one object. At full scale this moves
        (distinct objects) x (size) instead of (world size) x (largest size). ``digests``:
        ``(objects, each rank's object's sha256)``. ``known``: objects this rank decoded in an
        earlier gather, by digest (a replica rejoining): still broadcast, not decoded again."""
        blob = wire.dumps(obj)
        raw = hashlib.sha256(blob).digest()
        mine = raw.hex()
        # each rank's digest and size in the control header (9 numbers): nothing to decode per rank
        rows = self.exchange(call, [*DIGEST_WORDS.unpack(raw), len(blob)])
        announced = [(DIGEST_WORDS.pack(*row[:8]).hex(), row[8]) for row in rows]
        holder: dict[str, int] = {}
        for rank, (digest, _) in enumerate(announced):
            holder.setdefault(digest, rank)
        objects: dict[str, object] = {}
        for digest, src in holder.items():
            size = announced[src][1]
            payload = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device) if src == self.rank
                       else torch.empty(size, dtype=torch.uint8, device=self.device))
            self._broadcast(payload, src)
            if digest == mine:
                objects[digest] = obj
            elif known is not None and digest in known:
                objects[digest] = known[digest]
            else:
                data = payload.cpu().numpy().tobytes()
                if hashlib.sha256(data).hexdigest() != digest:
                    raise RefitProtocolError(f"refit rank {self.rank}: metadata broadcast by refit rank {src} "
                                             f"does not match the digest it announced")
                objects[digest] = wire.loads(data)
        gathered = [objects[digest] for digest, _ in announced]
        return (gathered, [digest for digest, _ in announced]) if digests else gathered

    def _broadcast(self, tensor: torch.Tensor, src: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait(self._usable().broadcast([tensor], opts), f"broadcast from rank {src}", src)

    def close(self) -> None:
        self._pg = None
        self._store = None
        self._sockets = None


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _sides(rows: list[list[int]]) -> str:
    names = {code: name for name, code in CALLS.items()}
    sides: dict[tuple, list[int]] = {}
    for rank, row in enumerate(rows):
        sides.setdefault(tuple(row[:3]), []).append(rank)
    parts = []
    for (magic, call, seq), ranks in sides.items():
        if magic != MAGIC:
            parts.append(f"refit rank(s) {ranks} sent a control header of another protocol or version "
                         f"({magic:#x}, not {MAGIC:#x}: another megatron-refit version?)")
            continue
        name = names.get(call, f"call {call}")
        version = f" version {rows[ranks[0]][3]}," if name == "refit" else ""
        parts.append(f"refit rank(s) {ranks} are in {name}({version} control message {seq})")
    return "; ".join(parts)
