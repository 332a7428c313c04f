"""Per-bucket checksum for ``verify`` mode (pure torch; any device).

A position-weighted sum of the buffer's 32-bit words: any single flipped byte changes it.
Computed on the packed buffer by the sender, appended as an 8-byte trailer, recomputed by
the receiver before unpacking.
"""

from __future__ import annotations

import torch

TRAILER_BYTES = 8


def bucket_checksum(buf: torch.Tensor) -> torch.Tensor:
    """int64 checksum (1 element, on ``buf``'s device) of a flat uint8 buffer."""
    n = buf.numel()
    words = torch.zeros((n + 3) // 4 * 4, dtype=torch.uint8, device=buf.device)
    words[:n] = buf
    words = words.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=buf.device) % 65521 + 1
    return (words * weights).sum().reshape(1)


def write_trailer(buf: torch.Tensor, nbytes: int) -> None:
    buf[nbytes:nbytes + TRAILER_BYTES].copy_(bucket_checksum(buf[:nbytes]).view(torch.uint8))


def trailer_ok(buf: torch.Tensor, nbytes: int) -> bool:
    sent = buf[nbytes:nbytes + TRAILER_BYTES].clone().view(torch.int64)
    return bool(torch.equal(sent, bucket_checksum(buf[:nbytes])))
