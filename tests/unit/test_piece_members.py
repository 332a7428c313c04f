"""What a trainer's piece declares (megatron_refit.endpoint.sender.HasPiece): every piece class
the refit hands the endpoints declares spec, tensor(), release(), follows and optional (None
where they do not apply), so nothing probes for them; a piece that lacks one is refused at the
edge, naming its type and what it lacks."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.endpoint.fp8_pieces import quantize_pieces
from megatron_refit.endpoint.sender import PIECE_MEMBERS, TensorPiece, check_pieces
from megatron_refit.fleet.overlap import Snapshot
from megatron_refit.plan.spec import ShardSpec, full_box

SPEC = ShardSpec("model.layers.0.mlp.down_proj.weight", (256, 256), "bfloat16", full_box((256, 256)))


def test_every_piece_class_declares_every_member():
    plain = TensorPiece(SPEC, torch.zeros(256, 256, dtype=torch.bfloat16))
    mtp = TensorPiece(SPEC, torch.zeros(256, 256, dtype=torch.bfloat16), optional="mtp")
    fp8 = quantize_pieces([plain])
    snapshot = Snapshot([plain, mtp]).pieces
    pieces = [plain, *fp8, *snapshot]
    assert len(fp8) == 2 and {type(p).__name__ for p in pieces} == {"TensorPiece", "Fp8Piece", "SnapshotPiece"}
    check_pieces(pieces)
    for piece in pieces:
        assert all(hasattr(piece, m) for m in PIECE_MEMBERS)
        piece.release()  # callable on every piece: nothing to drop, or the FP8 part
    assert [p.optional for p in snapshot] == [None, "mtp"]  # a snapshot stands for its live piece


def test_conversion_local_shards_declare_every_member():
    from conversion.local_shards import LocalShard

    dropped = []
    shard = LocalShard(spec=SPEC, megatron_name="decoder.layers.0.mlp.linear_fc2.weight",
                       get=lambda: torch.zeros(256, 256), drop=lambda: dropped.append(1))
    check_pieces([shard])
    shard.release()
    assert dropped == [1] and shard.follows is None and shard.optional is None
    LocalShard(spec=SPEC, megatron_name="x", get=lambda: torch.zeros(1)).release()  # made no copy: nothing


def test_a_piece_that_declares_too_little_is_refused_by_name():
    class Bare:
        spec = SPEC

        def tensor(self):
            return torch.zeros(1)

    with pytest.raises(ValueError, match=r"a refit piece of type Bare does not declare \['release', 'follows', "
                                         r"'optional'\]"):
        check_pieces([TensorPiece(SPEC, torch.zeros(1)), Bare()])
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource

    from megatron_refit.config import RefitConfig
    from megatron_refit.refit import trainer_refit_from_pieces

    for hand in (lambda: LocalShardSource([Bare()]),  # where users hand them, before any member is read
                 lambda: trainer_refit_from_pieces(RefitConfig.from_dict({"enabled": True, "overlap": "on"}), [Bare()],
                                                   [], rank=0, num_train=1)):
        with pytest.raises(ValueError, match=r"a refit piece of type Bare does not declare"):
            hand()


def test_an_mtp_piece_is_quantized_only_for_an_engines_draft():
    """``quantize_pieces``: an optional (MTP) piece passes unchanged where no engine holds it, and
    is quantized by its role, keeping ``optional``, where the engine's draft takes it (``refit.gen_draft``)."""
    mtp = TensorPiece(SPEC, torch.ones(256, 256, dtype=torch.bfloat16), optional="mtp")
    assert quantize_pieces([mtp]) == [mtp]
    weight, scale = quantize_pieces([mtp], draft=True)
    assert (weight.spec.dtype, scale.spec.name) == ("float8_e4m3fn", f"{SPEC.name}_scale_inv")
    assert weight.optional == scale.optional == "mtp" and weight.tensor().dtype == torch.float8_e4m3fn
