"""The per-bucket stages the bucket loops chain (:mod:`megatron_refit.endpoint.sender`,
:mod:`megatron_refit.endpoint.receiver`), each one concern with its own state for one refit:

- :class:`Sources` (sender): each local piece read once per refit, its copies released after
  the last bucket that needs it left (release);
- :class:`SendDigests` / :class:`ReceiveDigests`: each bucket's chunk sums, the digest message
  to a receiver after its last bucket, the comparison on arrival (digest);
- :class:`Drain` (receiver): after this rank's first own failure every bucket is still taken,
  and dropped, so that every sender's messages are matched and the group stays intact (drain).

Delta encoding and application are :mod:`megatron_refit.endpoint.delta`'s.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import torch

from megatron_refit.endpoint.bytes import repack_bucket
from megatron_refit.endpoint.integrity import chunk_sums, position_sums
from megatron_refit.errors import RefitCorruptionError, RefitTransportError

DIGEST_TAG = 1 << 30
"""Message tag of a pair's bucket digests (bucket messages use the bucket's index)."""


class Sources:
    """The sender's local tensors for one refit: each piece read once (its shape and dtype
    checked against its spec), kept until the last bucket that reads it has left, then released
    (copies ``tensor()`` made: a QKV split, an FP8 quantization)."""

    def __init__(self, pieces: dict, buckets):
        self.pieces = pieces
        self.cache: dict[str, torch.Tensor] = {}
        self.last_use = {item.transfer.name: bucket.index for bucket in buckets for item in bucket.items}

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            tensor = self.pieces[name].tensor().detach()
            spec = self.pieces[name].spec
            if tuple(tensor.shape) != spec.shape or str(tensor.dtype).removeprefix("torch.") != spec.dtype:
                raise ValueError(f"{name}: the local piece is {tuple(tensor.shape)} {tensor.dtype}, its spec says "
                                 f"{spec.shape} {spec.dtype}")
            self.cache[name] = tensor
        return self.cache[name]

    def after(self, bucket) -> None:
        """``bucket`` has left: release the pieces it was the last to read."""
        for item in bucket.items:
            name = item.transfer.name
            if self.last_use.get(name) == bucket.index:
                self.cache.pop(name, None)
                release(self.pieces[name])

    def release_all(self) -> None:
        """The refit ended (or failed): every piece's copies go, read or not."""
        self.cache.clear()
        for piece in self.pieces.values():
            release(piece)


def release(piece) -> None:
    piece.release()


class SendDigests:
    """The sender's digest stage: each posted bucket's chunk sums (the pass overlaps the bytes in
    flight); after a receiver's last bucket its digests go at once, waited for at the end."""

    def __init__(self, group, digesters: dict, verify: str, version: int, buckets, dst_of: Callable, report):
        self.group, self.digesters, self.verify, self.version = group, digesters, verify, version
        self.dst_of, self.report = dst_of, report
        self.sums: dict[int, list] = {}
        self.left = Counter(dst_of(b) for b in buckets)
        self.sends: list = []

    def add(self, bucket, data: torch.Tensor) -> None:
        if self.verify == "off":
            return
        t0 = time.perf_counter()
        dst = self.dst_of(bucket)
        self.sums.setdefault(dst, []).append(chunk_sums(data, self.verify))
        self.left[dst] -= 1
        if not self.left[dst]:
            values = self.digesters[dst](self.sums[dst], self.version)
            self.sends.append(self.group.send_small(values, dst, DIGEST_TAG))
        self.report.seconds["verify"] += time.perf_counter() - t0

    def wait(self) -> None:
        """Every small message posted (digests, delta headers) has left."""
        t0 = time.perf_counter()
        for pending in self.sends:
            self.group.wait(pending)
        self.report.seconds["verify"] += time.perf_counter() - t0


class ReceiveDigests:
    """The receiver's digest stage: the senders' digest messages posted before the first bucket;
    each bucket's chunk sums once it is in place (after the next bucket is posted, so the pass
    overlaps the transfer); at the end, the comparison naming the corrupted buckets."""

    def __init__(self, group, digesters: dict, verify: str, version: int, buckets, src_of: Callable, report, *,
                 post: bool = True, readback: bool = False):
        self.group, self.digesters, self.verify, self.version = group, digesters, verify, version
        self.readback = readback and verify != "off"
        """Keep :func:`~megatron_refit.endpoint.integrity.position_sums` of what landed (every byte,
        per bucket) for :meth:`stale_in`: the refit's version is checked and the engine's weights
        are read back."""
        self.landed: dict[int, list[torch.Tensor]] = {}  # sender -> full sums of its buckets, in plan order
        self.src_of, self.report = src_of, report
        self.left = Counter(src_of(b) for b in buckets)
        self.counts = dict(self.left)
        self.received: dict[int, list] = {}  # sender -> [(bucket, chunk sums)] in plan order
        self.computed: dict[int, torch.Tensor] = {}
        self.unchecked: list = []
        self.sent = {}
        self._arrived: set[int] = set()
        if post:
            self.post(group)

    def post(self, group) -> None:
        """Receive the senders' digest messages over ``group`` (the refit group, or a relayed
        rank's upstream link: :class:`~megatron_refit.endpoint.relay.UpstreamView`)."""
        self.group = group
        self._arrived: set[int] = set()
        if self.verify != "off":
            self.sent = {src: group.recv_small(torch.zeros(n, dtype=torch.int64), src, DIGEST_TAG)
                         for src, n in self.counts.items()}

    def queue(self, bucket, data: torch.Tensor) -> None:
        if self.verify != "off":
            self.unchecked.append((bucket, data))

    def drop_queued(self) -> None:
        self.unchecked.clear()

    def flush(self) -> None:
        """The chunk sums of the buckets queued (their memory is about to be reused or read)."""
        t0 = time.perf_counter()
        for bucket, data in self.unchecked:
            src = self.src_of(bucket)
            self.received.setdefault(src, []).append((bucket, chunk_sums(data, self.verify)))
            if self.readback:
                self.landed.setdefault(src, []).append(position_sums(data))
            self.left[src] -= 1
            if not self.left[src]:
                self.computed[src] = self.digesters[src]([s for _, s in self.received[src]], self.version).cpu()
        self.unchecked.clear()
        self.report.seconds["verify"] += time.perf_counter() - t0

    def wait_sent(self) -> None:
        """Every sender's digest message is in (each waited for once: a gloo receive waited for
        again blocks)."""
        for src, pending in self.sent.items():
            if src not in self._arrived:
                self.group.wait(pending)
                self._arrived.add(src)

    def first_mismatch(self) -> dict[int, int]:
        """Every sender's digests in (:meth:`wait_sent`) and its buckets' sums computed: per sender
        whose digests differ, the place of its first bad bucket in its order (a relayed rank takes
        them again from the train ranks)."""
        self.wait_sent()
        out = {}
        for src, pending in self.sent.items():
            bad = (self.computed[src] != pending.buffer.cpu()).nonzero().flatten().tolist()
            if bad:
                out[src] = bad[0]
        return out

    def rewind(self, keep: dict[int, int]) -> None:
        """Forget the sums of sender ``src``'s buckets from place ``keep[src]`` on (they come again)."""
        for src, count in keep.items():
            self.received[src] = self.received.get(src, [])[:count]
            self.landed[src] = self.landed.get(src, [])[:count]
            self.left[src] = self.counts[src] - count
            self.computed.pop(src, None)

    def stale_in(self, get_dst: Callable[[str], torch.Tensor]) -> list[str]:
        """After :meth:`compare` passed and the engine's post-load step ran: the parameters of
        every bucket (all of them: digests are per bucket) whose bytes, read back from the
        engine's storage now (``get_dst``: where the refit wrote each parameter;
        :func:`~megatron_refit.endpoint.bytes.repack_bucket`), no longer give the senders'
        digest (a tensor left stale or changed after the load). Reads what ``verify`` reads, or
        every byte under :attr:`readback`, compared with the position sums of what landed (two
        experts swapped inside one large bucket: outside what ``sampled`` reads, and invisible to
        any plain sum); one bucket of scratch memory; [] under ``verify: off``."""
        if self.verify == "off" or not self.received:
            return []
        changed = []
        size = max(b.nbytes for entries in self.received.values() for b, _ in entries)
        scratch = None
        for src, entries in self.received.items():
            sums = []
            for bucket, _ in entries:
                if scratch is None:
                    scratch = torch.empty(size, dtype=torch.uint8, device=get_dst(bucket.items[0].transfer.name).device)
                packed = repack_bucket(bucket, get_dst, scratch)
                sums.append(position_sums(packed) if self.readback else chunk_sums(packed, self.verify))
            if self.readback:
                changed += [entries[i][0] for i, (now, then) in enumerate(zip(sums, self.landed[src], strict=True))
                            if not torch.equal(now.cpu(), then.cpu())]  # a sum per 8 MiB: any device either side
                continue
            live = self.digesters[src](sums, self.version).cpu()
            changed += [entries[i][0] for i in (live != self.sent[src].buffer.cpu()).nonzero().flatten().tolist()]
        return sorted({item.transfer.name for bucket in changed for item in bucket.items})

    def compare(self) -> None:
        """``RefitCorruptionError`` naming the parameters of every bucket whose digest differs."""
        if self.verify == "off":
            return
        t0 = time.perf_counter()
        corrupted = []
        self.wait_sent()
        for src, pending in self.sent.items():
            mismatch = (self.computed[src] != pending.buffer.cpu()).nonzero().flatten().tolist()
            corrupted += [self.received[src][i][0] for i in mismatch]
        self.report.seconds["verify"] += time.perf_counter() - t0
        if corrupted:
            names = sorted({item.transfer.name for b in corrupted for item in b.items})
            sources = sorted({self.src_of(b) for b in corrupted})
            raise RefitCorruptionError(
                f"refit {self.version}: digest mismatch in {len(corrupted)} bucket(s) from refit rank(s) "
                f"{sources} (bytes changed in flight, or misrouted); parameters "
                f"{names[:8]}{' ...' if len(names) > 8 else ''}")


class Drain:
    """The receiver's drain stage: its first own failure (its storage, a payload) is kept, and
    from then on every bucket is still received (into staging) and dropped. A failure of the group
    itself (a transport error) is raised at once: there is nothing left to drain."""

    def __init__(self):
        self.failure: Exception | None = None

    @property
    def draining(self) -> bool:
        return self.failure is not None

    def fail(self, exc: Exception) -> None:
        if isinstance(exc, RefitTransportError):
            raise exc
        if self.failure is None:
            self.failure = exc
