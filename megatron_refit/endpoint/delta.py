"""Delta refits: send only the elements of a bucket that changed since the last refit.

A bucket's bytes are compared word by word (the bucket's smallest element size: 2 bytes for
bf16, 1 for FP8 data) with the copy of what this sender sent last time, and the bucket goes
in the smallest of three encodings:

- ``RAW``: the bucket's bytes, as a full refit sends them;
- ``INDICES``: the changed words' indices (int32) then their new values;
- ``BITMASK``: one bit per word (padded to 8 bytes) then the changed words' new values.

The receiver holds the previous version in the engine's storage and writes the new values
in place. Which encoding each bucket uses and its size travel first, in one small manifest
per (sender, receiver) pair, so every receive is posted with its exact size. Pure torch
(no process group): :mod:`megatron_refit.endpoint.sender` moves the bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_refit.config import DELTA as MODES  # noqa: F401  (``refit.delta``: off, on, auto; see RefitConfig.delta)
from megatron_refit.plan.cost import encoding_sizes, mask_bytes

RAW, INDICES, BITMASK = 0, 1, 2
ENCODINGS = ("raw", "indices", "bitmask")

AUTO_MARGIN = 0.95
"""``auto`` sends deltas while a delta refit is measured (or predicted) to take at most this
share of a full one (:class:`DeltaSender`)."""
AUTO_RETRY = 32
"""``auto``, sending full refits because the last delta did not pay: after this many it tries
a delta again (the change may have become sparser)."""
AUTO_REMEASURE = 16
"""``auto``, sending deltas: every this many refits one goes full, without copies, so the full
refit's cost stays measured (the link may have become faster); the next keeps its copies again."""

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NP_WORD = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
_popcount = getattr(np, "bitwise_count", None) or np.array([bin(b).count("1") for b in range(256)], np.uint8).take
"""Set bits per byte of a uint8 array: numpy's (2.0 on) or a table's."""


DELTA_TAG = 1 << 29
"""Delta refits: ``DELTA_TAG + bucket index`` tags the header (encoding, size) before a bucket."""


def delta_tag(index: int) -> int:
    if not 0 <= index < DELTA_TAG:
        raise ValueError(f"bucket index {index} outside the message tags (0 .. {DELTA_TAG - 1})")
    return DELTA_TAG + index


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"refit.delta: {mode!r} is not one of {list(MODES)}")
    return mode


def word_size(nbytes: int, itemsizes) -> int:
    """The comparison unit of a bucket: its smallest element size, if it divides the bucket."""
    smallest = min(itemsizes, default=1)
    return next(w for w in (8, 4, 2, 1) if w <= smallest and nbytes % w == 0)


sizes = encoding_sizes
"""Bytes of the RAW, INDICES and BITMASK encodings of a bucket."""


def encode(new: torch.Tensor, old: torch.Tensor, word: int) -> tuple[int, torch.Tensor | None, int]:
    """``(encoding, payload, changed words)`` of the flat uint8 ``new`` against ``old``, and
    ``old`` updated to ``new`` (only the changed words are written). The payload is None for
    ``RAW`` (the caller sends ``new`` itself)."""
    if new.numel() != old.numel() or new.numel() % word:
        raise ValueError(f"delta: buckets of {new.numel()} and {old.numel()} bytes, word {word}")
    if new.device.type == "cpu" and old.device.type == "cpu":
        return _encode_host(new.numpy(), old.numpy(), word)
    return _encode_torch(new, old, word)


def _encode_torch(new: torch.Tensor, old: torch.Tensor, word: int) -> tuple[int, torch.Tensor | None, int]:
    # on the device that holds the bucket (a GPU trainer's copies would live there too)
    a, b = new.view(_WORD[word]), old.view(_WORD[word])
    mask = a != b
    changed = int(mask.sum())
    raw, indices, bitmask = sizes(a.numel(), changed, word)
    if min(indices, bitmask) >= raw:
        b.copy_(a)
        return RAW, None, changed
    where = mask.nonzero().flatten()
    values = a[where]
    b[where] = values
    if indices <= bitmask:
        return INDICES, torch.cat([where.to(torch.int32).view(torch.uint8), values.view(torch.uint8)]), changed
    return BITMASK, torch.cat([pack_bits(mask), values.view(torch.uint8)]), changed


def _encode_host(new: np.ndarray, old: np.ndarray, word: int) -> tuple[int, torch.Tensor | None, int]:
    # numpy: on CPU its compare, count, nonzero and packbits are 3-10x torch's
    a, b = new.view(_NP_WORD[word]), old.view(_NP_WORD[word])
    mask = np.not_equal(a, b)
    changed = int(np.count_nonzero(mask))
    raw, indices, bitmask = sizes(a.size, changed, word)
    if min(indices, bitmask) >= raw:
        np.copyto(b, a)
        return RAW, None, changed
    where = np.flatnonzero(mask)
    values = a[where]
    b[where] = values
    if indices <= bitmask:
        head = where.astype(np.int32).view(np.uint8)
    else:
        head = np.packbits(mask, bitorder="little")
    start = head.size if indices <= bitmask else mask_bytes(a.size)  # the mask is padded to 8 bytes
    payload = np.empty(start + values.nbytes, dtype=np.uint8)  # one copy of each part, the padding zeroed
    payload[: head.size] = head
    payload[head.size: start] = 0
    payload[start:] = values.view(np.uint8)
    return (INDICES if indices <= bitmask else BITMASK), torch.from_numpy(payload), changed


def check_header(encoding: int, size: int, nbytes: int) -> str | None:
    """What is wrong with a bucket's delta header ``(encoding, size)`` for a bucket of
    ``nbytes`` (None: nothing): an encoding that does not exist, or a payload that is not
    smaller than the bucket (the encoder sends ``RAW`` then) or, for ``RAW``, not its size."""
    if encoding not in (RAW, INDICES, BITMASK):
        return f"encoding {encoding} is none of {list(ENCODINGS)}"
    if encoding == RAW and size != nbytes:
        return f"a raw payload of {size} bytes for a bucket of {nbytes}"
    if encoding != RAW and not 0 <= size < nbytes:
        return f"a {ENCODINGS[encoding]} payload of {size} bytes for a bucket of {nbytes}"
    return None


def check_payload(encoding: int, payload: torch.Tensor, nbytes: int, word: int) -> str | None:
    """What is wrong with a delta ``payload`` of a bucket of ``nbytes`` (None: nothing), before
    anything is written: its length, and every index or mask bit in range (``INDICES``: int32
    word indices below ``nbytes / word``, strictly increasing, as :func:`encode` writes them;
    ``BITMASK``: as many new values as set bits, the padding bits clear)."""
    count = nbytes // word
    p = payload.cpu().numpy()
    if encoding == INDICES:
        if p.size % (4 + word):
            return f"{p.size} bytes are not a whole number of (int32 index, {word}-byte value) entries"
        changed = p.size // (4 + word)
        where = p[: 4 * changed].view(np.int32)
        in_range = changed <= count and (not changed or (where[0] >= 0 and where[-1] < count))
        if not in_range or (changed > 1 and not (np.diff(where) > 0).all()):
            return f"its {changed} indices are not increasing word indices below {count}"
        return None
    head = mask_bytes(count)
    if p.size < head or (p.size - head) % word:
        return f"{p.size} bytes are not a {head}-byte mask then {word}-byte values"
    # on the packed bytes (no unpacked copy): the bits past the last word, then a popcount
    if (count % 8 and p[count // 8] >> (count % 8)) or p[-(-count // 8): head].any():
        return f"mask bits past the bucket's {count} words are set"
    ones = int(_popcount(p[:head]).sum(dtype=np.int64))
    if ones != (p.size - head) // word:
        return f"the mask sets {ones} words but {(p.size - head) // word} values follow"
    return None


def apply(target: torch.Tensor, encoding: int, payload: torch.Tensor, word: int) -> None:
    """Write a payload of :func:`encode` into the flat uint8 ``target`` (the previous
    version's bytes), in place (check it first: :func:`check_payload`)."""
    if encoding not in (INDICES, BITMASK):
        raise ValueError(f"delta: cannot apply encoding {encoding!r}")
    if target.device.type != "cpu":
        _apply_torch(target, encoding, payload, word)
        return
    t, p = target.numpy().view(_NP_WORD[word]), payload.cpu().numpy()
    if encoding == INDICES:
        count = p.size // (4 + word)
        t[p[: 4 * count].view(np.int32)] = p[4 * count:].view(_NP_WORD[word])
    else:
        head = mask_bytes(t.size)  # indices, then a scatter: 3x a boolean-mask assignment at 25 % changed
        changed = np.flatnonzero(np.unpackbits(p[:head], count=t.size, bitorder="little").view(bool))
        t[changed] = p[head:].view(_NP_WORD[word])


def _apply_torch(target: torch.Tensor, encoding: int, payload: torch.Tensor, word: int) -> None:
    t = target.view(_WORD[word])
    payload = payload.to(t.device)
    if encoding == INDICES:
        count = payload.numel() // (4 + word)
        t[payload[: 4 * count].view(torch.int32).long()] = payload[4 * count:].view(_WORD[word])
    else:
        head = mask_bytes(t.numel())
        t[unpack_bits(payload[:head], t.numel())] = payload[head:].view(_WORD[word])


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool vector as bits, little-endian within each byte, padded to a multiple of 8 bytes."""
    padded = torch.zeros(mask_bytes(mask.numel()) * 8, dtype=torch.uint8, device=mask.device)
    padded[: mask.numel()] = mask
    return (padded.view(-1, 8) * _BITS.to(mask.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int) -> torch.Tensor:
    bits = (packed.unsqueeze(1) & _BITS.to(packed.device)) != 0
    return bits.flatten()[:count]


def encode_cost_per_byte(device: str | torch.device = "cpu", nbytes: int = 32 << 20) -> float:
    """Seconds per byte the delta comparison takes on ``device``, measured on a sample bucket
    larger than the caches with 5 % of its words changed (the best of 3): ``auto``'s
    prediction before its first delta."""
    import time

    g = torch.Generator().manual_seed(0)
    new = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, generator=g).to(device)
    best = float("inf")
    for _ in range(3):
        old = new.clone()
        old[::40] ^= 1
        t0 = time.perf_counter()
        encode(new, old, 2)
        if new.is_cuda:
            torch.cuda.synchronize(new.device)
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


class DeltaSender:
    """One sender's side of delta refits: the copy of what it last sent, per bucket (host
    memory: as many bytes as this rank sends in a full refit), and the ``auto`` decision.

    ``auto`` decides before every refit from what it measured: the group's wall time of the
    last full refit and of the last delta refit (whatever the transport and the engines cost).
    While a delta refit takes at most :data:`AUTO_MARGIN` of a full one it sends deltas (the
    refit before the first keeps its copies), otherwise full refits, without comparing and
    without copies. Before its first delta it predicts one: the comparison on this rank's
    bytes (:func:`encode_cost_per_byte`), twice (the receiver writes the changed words), as if
    nothing changed; where even that does not pay (a link faster than the comparison) it never
    compares. A full refit that got slower (a slower link) makes the last delta pay again;
    after :data:`AUTO_RETRY` full refits it tries a delta anyway. Only plain full refits are
    measured: the one that keeps its copies before a delta also allocates and writes them
    (on this CPU it took 3x a plain one, which made deltas look cheaper than they were)."""

    def __init__(self, mode: str, *, encode_s_per_byte: float | None = None):
        self.mode = check_mode(mode)
        self.previous: dict[int, torch.Tensor] = {}
        """Bucket index -> the bytes sent in the last complete refit (CPU)."""
        self.base: int = -1
        """Version of those copies, once every rank applied it; -1: none (the next refit is full)."""
        self._keep = mode == "on"
        self.full_s: float | None = None
        """``auto``: the group's wall seconds of the last full refit."""
        self.delta_s: float | None = None
        """``auto``: the group's wall seconds of the last delta refit (None: not tried, or forgotten)."""
        self.encode_s_per_byte = encode_s_per_byte
        """``auto``: the comparison's seconds per byte on this rank (predicted before the first delta)."""
        self.rank_bytes = 0
        """``auto``: the bytes this rank sends in a full refit."""
        self._since = 0  # full refits since the last delta (sending full), or deltas since the last full

    @property
    def keeps_copies(self) -> bool:
        """Whether this refit compares and keeps copies (``off``, and ``auto`` sending full, do not)."""
        return self.mode != "off" and self._keep

    def held_bytes(self) -> int:
        return sum(t.numel() for t in self.previous.values())

    def encode(self, index, data: torch.Tensor, word: int, use_delta: bool):
        """``(encoding, payload, changed words)`` of bucket ``index`` whose full bytes are
        ``data``; the copy becomes ``data`` for the next refit."""
        flat = data.reshape(-1)
        old = self.previous.get(index)
        if old is None or old.numel() != flat.numel():
            old = self.previous[index] = torch.empty(flat.numel(), dtype=torch.uint8)
            use_delta = False
        if use_delta:
            return encode(flat.cpu(), old, word)
        old.copy_(flat)
        return RAW, None, flat.numel() // word

    def predicted(self) -> tuple[float, float] | None:
        """``auto``: the (delta, full) seconds of the next refit; None before a full refit was
        measured."""
        if self.full_s is None:
            return None
        if self.delta_s is not None:
            return self.delta_s, self.full_s
        if self.encode_s_per_byte is None:
            self.encode_s_per_byte = encode_cost_per_byte()
        return 2 * self.encode_s_per_byte * self.rank_bytes, self.full_s

    def finish(self, version: int, ok: bool, bytes_full: int, was_delta: bool, seconds: float = 0.0,
               rank_bytes: int = 0) -> None:
        """After a refit (``seconds``: the group's wall time; ``rank_bytes``: this rank's bytes of
        a full refit): its version becomes the base if every rank applied it and its copies were
        kept; ``auto`` decides whether the next refits send deltas."""
        if self.mode == "off":
            return
        kept = self._keep
        self.base = version if ok and kept else -1
        if self.mode == "on" or not bytes_full or seconds <= 0:
            return
        if was_delta:
            self.delta_s = seconds
            self._since += 1
        elif not kept:  # a plain full refit: what sending full costs
            self.full_s, self.rank_bytes = seconds, rank_bytes or self.rank_bytes
            self._since += 1
            if self.delta_s is not None and self._since >= AUTO_RETRY:
                self.delta_s = None  # try again: the change may have become sparse
        # a full refit that kept its copies is not measured: it also allocated and wrote them
        costs = self.predicted()
        pays = costs is not None and costs[0] <= AUTO_MARGIN * costs[1]
        if not pays:
            self._keep = False  # full refits from now on
            self.previous.clear()
            self.base = -1
            if kept:
                self._since = 0
        elif not kept:
            self._keep = True  # the next refit keeps its copies; deltas from the one after
            self._since = 0
        elif was_delta and self._since >= AUTO_REMEASURE:
            self._keep = False  # one plain full refit to measure the link again (the copies stay allocated)
            self.base = -1
            self._since = 0
