"""``refit.check_finite``: a trainer rank reads its pieces for NaN / Inf before a refit.

Run as the trainer's preflight in the per-refit handshake, so one rank's finding ends the
refit on every rank before any byte moves. Opt-in: one pass over this rank's weights (and
a piece whose ``tensor()`` derives a copy, e.g. the QKV split or FP8 quantization, derives it
here once more).
"""

from __future__ import annotations

import torch

from megatron_refit.errors import NonFiniteWeightsError


def nonfinite_counts(tensor: torch.Tensor, rows: int = 1 << 26) -> tuple[int, int]:
    """(NaN count, Inf count) of ``tensor``, read in slices of about ``rows`` elements (the
    masks stay small on a large weight). Integer tensors have neither."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return 0, 0
    flat = tensor.reshape(1, -1) if tensor.dim() < 2 else tensor
    step = max(1, rows // max(1, flat[0].numel()))
    nan = inf = 0
    for part in flat.split(step):
        if part.element_size() == 1:  # float8: isfinite is not implemented for it everywhere
            part = part.to(torch.float16)
        if not bool(torch.isfinite(part).all()):
            nan += int(torch.isnan(part).sum())
            inf += int(torch.isinf(part).sum())
    return nan, inf


def check_finite(pieces: dict, *, version: int, rank: int) -> None:
    """:class:`NonFiniteWeightsError` naming every piece (name -> object with ``tensor()``)
    that holds NaN or Inf, with the counts."""
    bad = []
    for name, piece in pieces.items():
        nan, inf = nonfinite_counts(piece.tensor().detach())
        if nan or inf:
            bad.append(f"{name} ({nan} NaN, {inf} Inf)")
    if bad:
        raise NonFiniteWeightsError(f"refit {version}: refit rank {rank} holds non-finite weights in "
                                    f"{len(bad)} parameter(s): {', '.join(bad[:5])}"
                                    f"{' ...' if len(bad) > 5 else ''}; nothing was sent (refit.check_finite)")
