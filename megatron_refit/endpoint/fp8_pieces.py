"""Trainer-side FP8: turn a rank's high-precision pieces into FP8 weight + ``scale_inv`` pieces.

Each quantized weight piece (by role, :func:`megatron_refit.endpoint.fp8.is_quantized`) becomes two
pieces, quantized once per refit on first use and dropped when the endpoint releases them
(after their last bucket left), so at most the in-flight window of FP8 copies exists at a
time. Every other piece passes through unchanged. The 128 rule is checked here, when the
pieces are built, before ``prepare()`` starts any collective.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from megatron_refit.endpoint.fp8 import quantize_blockwise
from megatron_refit.plan.fp8_layout import fp8_specs, is_quantized
from megatron_refit.plan.spec import ShardSpec


class _Quantized:
    """One weight piece, quantized lazily; shared by its weight and scale pieces. Thread-safe:
    a trainer refits its engine replicas from one thread each, over the same pieces."""

    def __init__(self, piece, pow2_scales: bool):
        self.piece = piece
        self.pow2_scales = pow2_scales
        self._parts: list[torch.Tensor | None] | None = None
        self._lock = threading.Lock()

    def part(self, index: int) -> torch.Tensor:
        with self._lock:
            if self._parts is None or self._parts[index] is None:
                with torch.no_grad():
                    self._parts = list(quantize_blockwise(self.piece.tensor().detach(),
                                                          pow2_scales=self.pow2_scales))
            return self._parts[index]

    def drop(self, index: int) -> None:
        with self._lock:
            if self._parts is None:
                return
            self._parts[index] = None
            if any(p is not None for p in self._parts):
                return
            self._parts = None
        self.piece.release()


@dataclass
class Fp8Piece:
    """The FP8 data (``index`` 0) or ``scale_inv`` (``index`` 1) of a quantized weight."""

    spec: ShardSpec
    source: _Quantized
    index: int
    follows: str | None = None
    """Its own buffer: it follows no piece."""
    optional: str | None = None
    """Its weight's (an MTP layer's, quantized for an engine's draft: :func:`quantize_pieces`)."""

    def tensor(self) -> torch.Tensor:
        return self.source.part(self.index)

    def release(self) -> None:
        self.source.drop(self.index)


def quantize_pieces(pieces: list, *, pow2_scales: bool = False, draft: bool = False) -> list:
    """``pieces`` with every quantized weight replaced by its FP8 weight and scale pieces. An optional
    piece (an MTP layer's, which no engine's main model holds: skipped by name) passes unchanged,
    unless ``draft`` (``refit.gen_draft``: the engine's speculative draft holds the MTP layers, in
    FP8 where its main model is: their weights are quantized by the same roles, ``eh_proj`` not).

    Raises ``ValueError`` (naming parameter, dim and boundary) for a piece whose box edge is
    not on the 128-element block grid.
    """
    out = []
    for piece in pieces:
        spec = piece.spec
        if (piece.optional and not draft) or not is_quantized(spec.name, spec.global_shape):
            out.append(piece)
            continue
        if spec.dtype == "float8_e4m3fn":
            raise ValueError(f"{spec.name}: already FP8 (Transformer Engine params): use pass-through, "
                             "not trainer-side quantization")
        weight, scale = fp8_specs(spec)
        source = _Quantized(piece, pow2_scales)
        out += [Fp8Piece(weight, source, 0, optional=piece.optional),
                Fp8Piece(scale, source, 1, optional=piece.optional)]
    return out
