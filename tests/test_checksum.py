"""Bucket digests (pure): bound to their place, independent of alignment, what each mode catches."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.checksum import FULL_BELOW, bucket_seed, check_mode, digest, extra_bytes

SEED = bucket_seed(3, 0, 2, 5, 1 << 20, 11)


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("mode", ["sampled", "full"])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1001, FULL_BELOW - 1, FULL_BELOW, FULL_BELOW + 13, (5 << 20) + 3])
def test_digest_depends_on_the_bytes_not_on_their_address(mode, n):
    x = _bytes(n)
    shifted = torch.empty(n + 3, dtype=torch.uint8)
    shifted[3:] = x  # the same bytes at an address that is not 8-byte aligned
    assert digest(x, SEED, mode) == digest(shifted[3:], SEED, mode)


@pytest.mark.parametrize("mode", ["sampled", "full"])
def test_digest_catches_zeroed_stale_and_misrouted_buckets(mode):
    x = _bytes(4 << 20)
    want = digest(x, SEED, mode)
    assert digest(torch.zeros_like(x), SEED, mode) != want
    assert digest(torch.zeros_like(x), SEED, mode) != 0  # a zeroed digest message does not match zeros either
    assert digest(x[: -4096], SEED, mode) != want  # truncated
    assert digest(_bytes(4 << 20, seed=1), SEED, mode) != want  # other bytes (another bucket's)
    for other in ((4, 0, 2, 5), (3, 1, 2, 5), (3, 0, 3, 5), (3, 0, 2, 6)):  # version, sender, receiver, index
        assert digest(x, bucket_seed(*other, 1 << 20, 11), mode) != want
    swapped = x.clone()
    swapped[: 1 << 20], swapped[1 << 20: 2 << 20] = x[1 << 20: 2 << 20], x[: 1 << 20]
    assert digest(swapped, SEED, mode) != want  # two chunks in each other's place


def test_full_mode_catches_any_flipped_byte_sampled_mode_the_bytes_it_reads():
    x = _bytes(2 << 20)
    for position in (0, 4095, 4096, 524287, 500_000, (2 << 20) - 1):
        assert digest(_flip(x, position), SEED, "full") != digest(x, SEED, "full"), position
    sampled = {position: digest(_flip(x, position), SEED, "sampled") != digest(x, SEED, "sampled")
               for position in (0, 4095, 4096, 524287, 524288)}
    assert sampled == {0: True, 4095: True, 4096: False, 524287: False, 524288: True}  # 4 KiB of every 512 KiB
    small = _bytes(FULL_BELOW - 8)
    assert digest(_flip(small, 100_000), SEED, "sampled") != digest(small, SEED, "sampled")  # small: every byte


def _flip(x: torch.Tensor, position: int) -> torch.Tensor:
    out = x.clone()
    out[position] ^= 0x40
    return out


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
    from megatron_refit.checksum import BLOCK_WORDS, SAMPLE_WORDS, chunk_sums

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
