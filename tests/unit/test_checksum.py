"""Bucket digests (pure): bound to their place, independent of alignment, what each mode catches."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.endpoint.integrity import (FULL_BELOW, POSITION_WORDS, Digester, bucket_seed, check_mode,
                                               chunk_sums, digest, extra_bytes, position_sums)

SEED = bucket_seed(0, 2, 5, 1 << 20, 11)  # sender, receiver, index, length, plan
V = 3  # the refit version


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1001, FULL_BELOW - 1, FULL_BELOW, FULL_BELOW + 13, (5 << 20) + 3])
def test_digest_depends_on_the_bytes_not_on_their_address(mode, n):
    x = _bytes(n)
    shifted = torch.empty(n + 3, dtype=torch.uint8)
    shifted[3:] = x  # the same bytes at an address that is not 8-byte aligned
    assert digest(x, SEED, V, mode) == digest(shifted[3:], SEED, V, mode)


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_digest_catches_zeroed_stale_and_misrouted_buckets(mode):
    x = _bytes(4 << 20)
    want = digest(x, SEED, V, mode)
    assert digest(torch.zeros_like(x), SEED, V, mode) != want
    assert digest(torch.zeros_like(x), SEED, V, mode) != 0  # a zeroed digest message does not match zeros either
    assert digest(x[: -4096], SEED, V, mode) != want  # truncated
    assert digest(_bytes(4 << 20, seed=1), SEED, V, mode) != want  # other bytes (another bucket's)
    for other in ((1, 2, 5), (0, 3, 5), (0, 2, 6)):  # sender, receiver, index
        assert digest(x, bucket_seed(*other, 1 << 20, 11), V, mode) != want
    assert digest(x, bucket_seed(0, 2, 5, 1 << 20, 12), V, mode) != want  # another plan
    assert all(digest(x, SEED, v, mode) != want for v in (0, 1, 2, 4, 5, 1 << 40))  # another version
    swapped = x.clone()
    swapped[: 1 << 20], swapped[1 << 20: 2 << 20] = x[1 << 20: 2 << 20], x[: 1 << 20]
    assert digest(swapped, SEED, V, mode) != want  # two chunks in each other's place


def test_a_stale_bucket_that_matches_its_own_digest_never_passes():
    """A bucket and digest both of another version differ from this version's digest of
    the same bytes by c * (t(v) - t(v')): an odd c times a non-zero difference, non-zero
    mod 2**64 whatever the bytes and seeds (no probability involved)."""
    for seed in (SEED, 0, 1, (1 << 64) - 1):
        for v in range(8):
            bucket = Digester([seed], [0], "sampled")
            empty = [torch.zeros(1, dtype=torch.int64)]
            assert len({int(bucket(empty, w)[0]) - int(bucket(empty, v)[0]) for w in range(8) if w != v}) == 7
            assert 0 not in {int(bucket(empty, w)[0]) - int(bucket(empty, v)[0]) for w in range(8) if w != v}


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_a_digester_of_several_buckets_gives_each_its_own_digest(mode):
    """One digester per sender-receiver pair: its digests are those of each bucket alone,
    and it refuses sums that do not fit its buckets."""
    sizes = [0, 5, FULL_BELOW + 13, (3 << 20) + 8, 1001]
    bufs = [_bytes(n, seed=i) for i, n in enumerate(sizes)]
    seeds = [bucket_seed(0, 2, i, n, 11) for i, n in enumerate(sizes)]
    pair = Digester(seeds, sizes, mode)
    got = pair([chunk_sums(b, mode) for b in bufs], V).tolist()
    assert got == [digest(b, s, V, mode) for b, s in zip(bufs, seeds)]
    with pytest.raises(ValueError, match="digests of 4 buckets asked of a digester of 5"):
        pair([chunk_sums(b, mode) for b in bufs[:4]], V)
    with pytest.raises(ValueError, match="chunk sums for buckets of"):
        pair([chunk_sums(b, mode) for b in bufs[:4]] + [chunk_sums(bufs[2], mode)], V)
    assert Digester([], [], mode)([], V).numel() == 0


def test_full_mode_catches_any_flipped_byte_sampled_mode_the_bytes_it_reads():
    x = _bytes(2 << 20)
    for position in (0, 4095, 4096, 524287, 500_000, (2 << 20) - 1):
        assert digest(_flip(x, position), SEED, V, "full") != digest(x, SEED, V, "full"), position
    sampled = {position: digest(_flip(x, position), SEED, V, "sampled") != digest(x, SEED, V, "sampled")
               for position in (0, 4095, 4096, 524287, 524288)}
    assert sampled == {0: True, 4095: True, 4096: False, 524287: False, 524288: True}  # 4 KiB of every 512 KiB
    small = _bytes(FULL_BELOW - 8)
    assert digest(_flip(small, 100_000), SEED, V, "sampled") != digest(small, SEED, V, "sampled")  # small: every byte


def _flip(x: torch.Tensor, position: int) -> torch.Tensor:
    out = x.clone()
    out[position] ^= 0x40
    return out


@pytest.mark.parametrize("offset", [0, 3])
def test_position_sums_see_two_rows_swapped_that_every_plain_sum_misses(offset):
    """An engine's read-back (``stale_in``) must see two experts' rows swapped in one bucket: the
    plain chunk sums, even in ``full`` mode, add the same words in another order; the position
    sums do not. Equal bytes give equal sums at any alignment, over several pieces and a partial
    last word."""
    gen = torch.Generator().manual_seed(5)
    n = POSITION_WORDS * 8 + 4096 + 5  # two pieces, the second ending in a partial word
    base = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=gen)[offset:]
    swapped = base.clone()
    swapped[64:128], swapped[1024:1088] = base[1024:1088].clone(), base[64:128].clone()  # two 64-byte rows
    assert torch.equal(chunk_sums(swapped, "full"), chunk_sums(base, "full"))  # blind to it
    assert not torch.equal(position_sums(swapped), position_sums(base))
    assert position_sums(base).shape == (2,) and torch.equal(position_sums(base), position_sums(base.clone()))
    tail = base.clone()
    tail[-1] ^= 1  # the partial last word counts too
    assert not torch.equal(position_sums(tail), position_sums(base))


@pytest.mark.parametrize("size", [1, 8, 8 * 1023 + 5, 8 * 4096, 8 * 5000 + 3, POSITION_WORDS * 8 + 8 * 1500 + 5])
def test_position_sums_are_the_weighted_sum_of_every_piece(size):
    """The row-and-column form gives ``sum_i (i + 1) * word_i`` per piece to the bit (words
    short of a row, a partial last word, a second piece), wrapping mod 2**64 as the product does."""
    gen = torch.Generator().manual_seed(size)
    buf = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    buf[: min(size, 64)] = 0xFF  # words near 2**64: the products and sums wrap
    padded = torch.zeros(-(-size // 8) * 8, dtype=torch.uint8)
    padded[:size] = buf
    words = padded.view(torch.int64)
    expected = [(torch.arange(1, part.numel() + 1, dtype=torch.int64) * part).sum()
                for part in words.split(POSITION_WORDS)]
    assert position_sums(buf).tolist() == [int(e) for e in expected]


def test_extra_memory_per_bucket_is_bounded():
    assert extra_bytes(1 << 30) == extra_bytes(256 << 20) <= 16 * 258  # at most MAX_CHUNKS (+1) sums and multipliers
    assert extra_bytes(1 << 30, aligned=False) > extra_bytes(1 << 30)  # one chunk of scratch
    assert extra_bytes(1 << 30, "off") == 0
    with pytest.raises(ValueError, match=r"verify must be one of \['off', 'sampled', 'full'\], got True"):
        check_mode(True)


def test_sampled_sums_follow_the_definition_on_views_with_offsets():
    """Each chunk sums the first SAMPLE_WORDS words of each of its whole blocks, a trailing
    partial block entirely, and the partial last word on its own (zero-padded), also for
    a view that starts inside its storage (a direct bucket of a larger tensor)."""
    from megatron_refit.endpoint.integrity import BLOCK_WORDS, SAMPLE_WORDS

    g = torch.Generator().manual_seed(5)
    x = torch.randint(-(1 << 63), (1 << 63) - 1, (5 * BLOCK_WORDS,), dtype=torch.int64, generator=g).view(torch.uint8)
    for start, n in ((0, 2 * BLOCK_WORDS * 8), (8 * 1000, 3 * BLOCK_WORDS * 8 + 8 * 777 + 5)):
        buf = x[start:start + n]
        words = buf[: n // 8 * 8].view(torch.int64)
        blocks = words.numel() // BLOCK_WORDS
        want = [words[b * BLOCK_WORDS: b * BLOCK_WORDS + SAMPLE_WORDS].sum() for b in range(blocks)]
        if words.numel() > blocks * BLOCK_WORDS:
            want.append(words[blocks * BLOCK_WORDS:].sum())
        if n % 8:
            tail = torch.zeros(8, dtype=torch.uint8)
            tail[: n % 8] = buf[n // 8 * 8:]
            want.append(tail.view(torch.int64)[0])
        assert torch.equal(chunk_sums(buf, "sampled"), torch.stack(want)), (start, n)


def test_digest_follows_the_formula_in_python_integers():
    """digest = h + c * t(v) + sum_k m_k * S_k (mod 2**64), recomputed with Python ints from
    the module's definition of each constant (see the module docstring)."""
    from megatron_refit.endpoint.integrity import _splitmix

    mask = (1 << 64) - 1
    x = _bytes((3 << 20) + 5)
    sums = [int(s) & mask for s in chunk_sums(x, "sampled").tolist()]
    a, b = _splitmix(SEED ^ 0xA5A5A5A5A5A5A5A5), _splitmix(SEED ^ 0x5A5A5A5A5A5A5A5A)
    c = _splitmix(SEED ^ 0x3C3C3C3C3C3C3C3C) | 1
    want = _splitmix(SEED) + c * _splitmix(V ^ 0xC3C3C3C3C3C3C3C3)
    want += sum(((k * a + b) | 1) * s for k, s in enumerate(sums))
    assert digest(x, SEED, V, "sampled") & mask == want & mask
