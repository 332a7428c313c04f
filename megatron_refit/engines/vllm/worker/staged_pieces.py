"""The storage of ``engine_load: load_weights`` in vLLM's worker: the refit lands in staging
buffers, one per piece, which vLLM's own ``load_weights`` then takes, inside its layerwise reload
(of the live model, a shadow of it under ``swap: staged``, or vLLM's speculative draft)."""

from __future__ import annotations

import torch

from megatron_refit import families
from megatron_refit.engines.segments import join_segments
from megatron_refit.plan.spec import ShardSpec


class StagedPiecesStorage:
    """Storage of ``load_weights`` mode: one staging tensor per piece; :meth:`load` feeds each
    piece to the model's own ``load_weights`` as its HF tensor (the piece in its box, zeros
    elsewhere: vLLM's loaders read only this rank's part, which is the box). The worker engine
    calls it inside vLLM's layerwise reload, when the refit is to become live."""

    holds_sent_bytes = True
    """The staging tensors keep what the last refit wrote: delta refits start from them."""

    def __init__(self, model: torch.nn.Module, pieces: list[ShardSpec], device: torch.device):
        self.model = model
        self._pieces = pieces
        self._staged = {p.name: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device=device) for p in pieces}

    def target_specs(self) -> list[ShardSpec]:
        return list(self._pieces)

    @property
    def nbytes(self) -> int:
        """The staging buffers' bytes (on the engine's device)."""
        return sum(t.nbytes for t in self._staged.values())

    def buffer(self, name: str) -> torch.Tensor:
        return self._staged[name]

    def finalize(self) -> None:
        """The refit is complete in staging (the worker engine loads it)."""

    @torch.no_grad()
    def load(self, model: torch.nn.Module | None = None, only=None) -> None:
        """Into ``model``'s ``load_weights`` (None: the live model; a shadow of it under ``swap:
        staged``: :mod:`~megatron_refit.engines.vllm.worker.prepare`), the pieces whose names
        ``only`` takes (None: all; vLLM's draft takes its MTP layer's). Segments of one HF tensor
        (Mamba's ``in_proj`` = [z, x, B, C, dt]) go in as that tensor, at once: vLLM's loaders for
        it write every segment of this rank's rows."""
        tensors: dict[str, list[ShardSpec]] = {}  # HF tensor -> its pieces (segments: several)
        for piece in (p for p in self._pieces if only is None or only(p.name)):
            tensors.setdefault(families.split_segment(piece.name)[0], []).append(piece)
        def weights():  # unsegmented tensors first, then each segmented one as a whole
            for _, pieces in sorted(tensors.items(), key=lambda item: families.segment_order(item[0]) is not None):
                (name, whole), = join_segments({piece.name: self._whole(piece) for piece in pieces}).items()
                yield name, whole

        # one call: vLLM's loaders index the parameters once per call
        (self.model if model is None else model).load_weights(weights())

    def _whole(self, piece: ShardSpec) -> torch.Tensor:
        """This rank's box of ``piece`` in a zero tensor of its global shape (the staging tensor
        itself where the box is the whole tensor: vLLM's loaders copy from it, never into it)."""
        staged = self._staged[piece.name]
        if tuple(staged.shape) == tuple(piece.global_shape):
            return staged
        whole = torch.zeros(piece.global_shape, dtype=staged.dtype, device=staged.device)
        whole[tuple(slice(a, b) for a, b in piece.box)] = staged
        return whole
