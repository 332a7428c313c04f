"""Per-bucket digests: the integrity check every refit runs (``verify``, on by default).

A bucket's digest is bound to where it belongs: its seed hashes the sending and receiving
refit ranks, the bucket's index in the pair's plan, its length and the plan itself; the
refit version enters through ``t(v)``. Over the bucket's bytes, read as little-endian
64-bit words (bytes ``[8i, 8i+8)``; a last partial word zero-padded) and cut into at most
:data:`MAX_CHUNKS` chunks::

    digest = h(seed) + c(seed) * t(version) + sum_k m_k(seed) * S_k        (mod 2**64)

where ``S_k`` is the wrapping sum of chunk ``k``'s words, ``m_k`` an odd multiplier drawn
from the seed, ``c`` odd and ``t`` a bijection of the version (splitmix64). A changed word
changes its chunk's sum; chunks out of order, or a bucket delivered to the wrong place,
change the multipliers; a bucket of another version that is consistent with its own
digest differs by ``c * (t(v) - t(v'))``, never 0 mod 2**64 (``c`` is odd); all-zero bytes
leave ``h + c * t``, so a zeroed bucket with a zeroed digest is caught too. Everything but
``t`` is computed once per plan (:class:`Digester`). Integer sums wrap identically in any
order, so a GPU sender and a CPU receiver agree, whatever the buffers' alignment.

Modes (``verify``):

- ``"sampled"`` (default): ``S_k`` sums the first :data:`SAMPLE_WORDS` words (4 KiB, one
  page) of every :data:`BLOCK_WORDS`-word block (512 KiB), the whole of a block that ends the
  chunk short, and every word of buckets under :data:`FULL_BELOW` bytes. It reads 1/128 of
  a large bucket, a page at a time (shorter strided samples cost a page walk each all the
  same): a zeroed, truncated, stale, swapped or misrouted bucket is caught; a corruption
  confined to unsampled bytes is not. On the project's 2-core CPU benchmark the check
  costs 1.5–4 % of a refit (1/32 cost 7–10 %); see BENCHMARKS.md.
- ``"full"``: every word; one reading pass per side (a reduction, ~3x faster than a copy on
  a CPU, but on gloo the wire itself runs at copy speed: ~40 % longer refits on the
  project's CPU benchmark; on GPUs a small fraction of an NCCL transfer).
- ``"off"``: none.

Extra memory per bucket: ``2 * MAX_CHUNKS`` int64 (the chunk sums and multipliers), plus
one chunk of scratch for a bucket whose start is not 8-byte aligned.
"""

from __future__ import annotations

import torch

VERIFY_MODES = ("off", "sampled", "full")
MAX_CHUNKS = 256
"""Chunks per bucket at most: bounds the extra memory of a digest."""
BLOCK_WORDS = 65536
"""Sampled mode: a block of 512 KiB ..."""
SAMPLE_WORDS = 512
"""... of which the first 4 KiB is read."""
FULL_BELOW = 512 << 10
"""Buckets smaller than this (one block) are read entirely in sampled mode too."""
_MASK = (1 << 64) - 1


def check_mode(verify) -> str:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {list(VERIFY_MODES)}, got {verify!r}")
    return verify


def in_force(verify: str, fanout: str) -> str:
    """The check every bucket gets: ``verify``, except that ``sampled`` reads every byte
    (``full``) where replicas may relay (``refit.fanout`` other than ``off``, ``auto`` included):
    a relay link is a hop no train rank reads, a corruption there can be anywhere in a bucket,
    and the 1/128 that ``sampled`` reads of a large one would let it land in the next replica
    and every one after it. The train ranks send one replica's bytes then, so reading them all
    costs them no more than ``sampled`` costs ``off`` direct."""
    check_mode(verify)
    return "full" if verify == "sampled" and fanout != "off" else verify


def bucket_seed(*parts: int) -> int:
    """A 64-bit seed from ints (a bucket's sender, receiver, index, length and plan id, then
    the version): each part folded in through a splitmix64 round."""
    seed = 0x243F6A8885A308D3
    for part in parts:
        seed = _splitmix(seed ^ (int(part) & _MASK))
    return seed


def _signed(value: int) -> int:
    value &= _MASK
    return value - (1 << 64) if value >= 1 << 63 else value


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _sampled(nbytes: int, mode: str) -> bool:
    return mode == "sampled" and nbytes >= FULL_BELOW


def chunk_words(nbytes: int, mode: str) -> int:
    """Words per chunk (sampled: a multiple of the block)."""
    words = nbytes // 8
    if _sampled(nbytes, mode):
        blocks = -(-words // BLOCK_WORDS)
        return -(-blocks // MAX_CHUNKS) * BLOCK_WORDS
    return max(FULL_BELOW // 8, -(-words // MAX_CHUNKS))


def extra_bytes(nbytes: int, mode: str = "sampled", aligned: bool = True) -> int:
    """Peak extra memory of one bucket's digest: chunk sums and multipliers (int64 each, one
    more chunk for a partial last word), plus one chunk of scratch if misaligned."""
    if mode == "off":
        return 0
    cw = chunk_words(nbytes, mode)
    chunks = -(-(nbytes // 8) // cw) + 1
    return 16 * chunks + (0 if aligned else 8 * cw)


def _sum(words: torch.Tensor, sampled: bool) -> torch.Tensor:
    """The sum of one (possibly short) chunk's words."""
    if not sampled:
        return words.sum()
    blocks = words.numel() // BLOCK_WORDS
    total = words[blocks * BLOCK_WORDS:].sum()  # a block that ends the chunk short: entirely
    if blocks:
        total = total + words[: blocks * BLOCK_WORDS].view(blocks, BLOCK_WORDS)[:, :SAMPLE_WORDS].sum()
    return total


def chunk_sums(buf: torch.Tensor, mode: str) -> torch.Tensor:
    """``S_k`` of every chunk of a flat uint8 buffer (on its device; the last entry covers a
    partial last word): the per-bucket pass. :func:`digests` turns them into digests."""
    n = buf.numel()
    sampled = _sampled(n, mode)
    cw = chunk_words(n, mode)
    nwords = n // 8
    whole = nwords // cw
    device = buf.device
    sums = []
    if nwords and buf.data_ptr() % 8 == 0:
        words = (buf if n == nwords * 8 else buf[: nwords * 8]).view(torch.int64)
        if sampled and cw == BLOCK_WORDS:  # one block per chunk (buckets up to 128 MiB): one strided sum
            sums.append(words.as_strided((whole, SAMPLE_WORDS), (BLOCK_WORDS, 1)).sum(dim=1))
        elif whole:
            main = words[: whole * cw]
            sums.append(main.view(whole, cw // BLOCK_WORDS, BLOCK_WORDS)[:, :, :SAMPLE_WORDS].sum(dim=(1, 2))
                        if sampled else main.view(whole, cw).sum(dim=1))
        if nwords > whole * cw:
            sums.append(_sum(words[whole * cw:], sampled).reshape(1))
    elif nwords:  # chunk by chunk through an aligned scratch: the same sums
        scratch = torch.empty(cw * 8, dtype=torch.uint8, device=device)
        for start in range(0, nwords * 8, cw * 8):
            size = min(cw * 8, nwords * 8 - start)
            scratch[:size] = buf[start:start + size]
            sums.append(_sum(scratch[:size].view(torch.int64), sampled).reshape(1))
    if n > nwords * 8 or not sums:  # the partial last word, zero-padded
        tail = torch.zeros(8, dtype=torch.uint8, device=device)
        tail[: n - nwords * 8] = buf[nwords * 8:]
        sums.append(tail.view(torch.int64))
    return sums[0] if len(sums) == 1 else torch.cat(sums)


def chunk_count(nbytes: int, mode: str) -> int:
    """How many chunk sums :func:`chunk_sums` returns for a bucket of ``nbytes``."""
    cw = chunk_words(nbytes, mode)
    words = nbytes // 8
    count = -(-words // cw)
    return count + 1 if nbytes > words * 8 or not count else count


class Digester:
    """The digest constants of a sequence of buckets (one sender-receiver pair's, in plan
    order) given their version-free seeds and sizes, computed once per plan. Per refit the
    digests of all of them take a few vectorised operations over their chunk sums, however
    many buckets there are."""

    def __init__(self, seeds: list[int], nbytes: list[int], mode: str):
        self.counts = [chunk_count(n, mode) for n in nbytes]
        multipliers = []
        for seed, count in zip(seeds, self.counts):
            a, b = _splitmix(seed ^ 0xA5A5A5A5A5A5A5A5), _splitmix(seed ^ 0x5A5A5A5A5A5A5A5A)
            multipliers += [_signed((k * a + b) | 1) for k in range(count)]  # odd, distinct per chunk
        self._constants = (multipliers, [_signed(_splitmix(seed)) for seed in seeds],
                           [_signed(_splitmix(seed ^ 0x3C3C3C3C3C3C3C3C) | 1) for seed in seeds])
        self._on: dict[str, tuple[torch.Tensor, ...]] = {}

    def _tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        key = str(device)
        if key not in self._on:
            multipliers, h, c = (torch.tensor(v, dtype=torch.int64, device=device) for v in self._constants)
            bucket = torch.arange(len(self.counts), device=device).repeat_interleave(
                torch.tensor(self.counts, dtype=torch.int64, device=device))
            self._on[key] = (multipliers, bucket, h, c)
        return self._on[key]

    def __call__(self, sums: list[torch.Tensor], version: int) -> torch.Tensor:
        """The digests (int64, one per bucket, on the sums' device) in refit ``version`` of
        the buckets whose :func:`chunk_sums` are ``sums``, in the order given at construction."""
        if len(sums) != len(self.counts):
            raise ValueError(f"digests of {len(sums)} buckets asked of a digester of {len(self.counts)}")
        device = sums[0].device if sums else torch.device("cpu")
        multipliers, bucket, h, c = self._tensors(device)
        out = h + c * _signed(_splitmix(version ^ 0xC3C3C3C3C3C3C3C3))  # wraps mod 2**64
        if not sums:
            return out
        flat = torch.cat(sums) if len(sums) > 1 else sums[0]
        if flat.numel() != multipliers.numel():
            raise ValueError(f"{flat.numel()} chunk sums for buckets of {multipliers.numel()} chunks")
        return out.index_add_(0, bucket, flat * multipliers)


def digest(buf: torch.Tensor, seed: int, version: int, mode: str = "sampled") -> int:
    """The digest of one flat uint8 buffer under ``seed`` in refit ``version``."""
    return int(Digester([seed], [buf.numel()], mode)([chunk_sums(buf, mode)], version)[0])


POSITION_WORDS = 1 << 20
"""Words per :func:`position_sums` term (8 MiB; one term's scratch where a piece is not
word-aligned)."""
POSITION_COLUMNS = 1024
"""A piece's words as rows of this many (:func:`_weighted_sum`)."""
_POSITION_WEIGHTS: dict[str, torch.Tensor] = {}
"""``0 .. POSITION_WORDS / POSITION_COLUMNS`` per device, made once (the row and column weights)."""


def position_sums(buf: torch.Tensor) -> torch.Tensor:
    """Sums of a flat uint8 buffer that words moved within it change too: per
    :data:`POSITION_WORDS`-word piece, ``sum_i (i + 1) * word_i`` (mod 2**64; the words
    little-endian, a last partial one zero-padded). The chunk sums of :func:`chunk_sums` are
    blind to two words (two experts' rows) swapped inside one chunk; these see it (the change is
    ``(i - j) * (w_j - w_i)``, 0 mod 2**64 only if the words are equal or their distance shares
    the difference's factors of two up to 2**64). For the engine's read-back of its own weights
    (:meth:`~megatron_refit.endpoint.stages.ReceiveDigests.stale_in`): two reading passes of
    plain sums, no product over the words (:func:`_weighted_sum`): 0.44 ms per 8 MiB on a 2-core
    AMD EPYC (AVX2 has no 64-bit vector multiply; a product per word took 2.6 ms)."""
    device, n = buf.device, buf.numel()
    piece = POSITION_WORDS * 8
    scratch = None
    sums = []
    for start in range(0, max(n, 1), piece):
        part = buf[start:start + piece]
        size = part.numel()
        if size % 8 or part.data_ptr() % 8:
            if scratch is None:
                scratch = torch.empty(piece, dtype=torch.uint8, device=device)
            padded = -(-size // 8) * 8
            scratch[:padded].zero_()
            scratch[:size] = part
            part = scratch[:padded]
        sums.append(_weighted_sum(part.view(torch.int64)))
    return torch.cat(sums)


def _weighted_sum(words: torch.Tensor) -> torch.Tensor:
    """``sum_i (i + 1) * words[i]`` (mod 2**64) as one-element int64, from plain sums: with the
    words as rows of ``C`` (:data:`POSITION_COLUMNS`) and ``i = r * C + c``, it is
    ``C * sum_r r * rowsum_r + sum_c (c + 1) * colsum_c`` (a tail short of a row by its own
    weights); the same value, to the bit, as the product per word."""
    columns = POSITION_COLUMNS
    weights = _POSITION_WEIGHTS.get(str(words.device))
    if weights is None:
        weights = _POSITION_WEIGHTS[str(words.device)] = torch.arange(
            max(columns + 1, POSITION_WORDS // columns), dtype=torch.int64, device=words.device)
    count = words.numel()
    rows = count // columns
    body = words[:rows * columns].view(rows, columns)
    total = (weights[:rows] * body.sum(dim=1)).sum() * columns + (weights[1:columns + 1] * body.sum(dim=0)).sum()
    tail = words[rows * columns:]
    if tail.numel():
        total += ((weights[1:tail.numel() + 1] + rows * columns) * tail).sum()
    return total.reshape(1)
