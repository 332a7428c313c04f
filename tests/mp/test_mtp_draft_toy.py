"""#67 at the refit's start, through the real trainer and engine entry points (``trainer_refit_from_pieces``,
``engine_refit``) into a toy engine: the trainer's MTP layer (pieces it marks ``optional="mtp"``) is
skipped by name and counted where no engine rank holds it, and under ``refit.gen_draft`` (the engine
decodes with its MTP draft) the same deployment fails on every rank at start, naming the draft,
instead of serving a draft that stays the first version's."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.local.launch import run_spawned

pytestmark = pytest.mark.slow

MAIN = "model.layers.0.mlp.down_proj.weight"
MTP = "model.layers.1.eh_proj.weight"
SHAPES = {MAIN: ((4, 6), "float32"), MTP: ((4, 8), "float32")}


def _rank(rank, world, port, draft):
    import megatron_refit.testing.toy_engine  # noqa: F401 -- registers engine "toy" in this process
    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.engines.control import engine_control
    from megatron_refit.plan.spec import ShardSpec, full_box
    from megatron_refit.refit import trainer_refit_from_pieces
    from megatron_refit.testing.toy_engine import ToyStorage

    cfg = RefitConfig(enabled=True, engine="toy", port=port, timeout_s=30.0, gen_draft=draft)
    try:
        if rank == 0:  # one train rank: the main model's weight and its MTP layer's projection
            pieces = [TensorPiece(ShardSpec(name=n, global_shape=shape, dtype=dtype, box=full_box(shape)),
                                  torch.ones(shape), optional="mtp" if n == MTP else None)
                      for n, (shape, dtype) in SHAPES.items()]
            control = engine_control(cfg, [[]])
            fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=0, num_train=1, control=control)
            report = fleet.refit(1)
            skipped = list(fleet.plan.skipped_params)
            fleet.close()
            return dict(skipped=skipped, metric=report.summary["refit/skipped_params"])
        storage = ToyStorage({MAIN: SHAPES[MAIN]})  # an engine without a draft
        member = engine_refit(cfg, storage, gen_index=0, num_train=1)
        member.receive(1)
        member.close()
        return dict(landed=bool(storage.tensors[MAIN].eq(1).all()))
    except Exception as exc:  # noqa: BLE001 -- what each rank raised, asserted by the test
        return dict(error=f"{type(exc).__name__}: {exc}")


def test_the_mtp_layer_is_skipped_without_a_draft_and_required_under_gen_draft():
    train, gen = run_spawned(_rank, 2, False, timeout_s=120)
    assert train == dict(skipped=[MTP], metric=1) and gen == dict(landed=True)
    train, gen = run_spawned(_rank, 2, True, timeout_s=120)
    # every rank refuses the same plan, at start, before any byte moves: the engine rank by the plan's
    # ValueError, the train rank's start by it (the engines did not start)
    assert gen["error"].startswith("ValueError: the trainer produces 1 HF parameters"), gen
    assert train["error"].startswith("RefitTransportError: refit: the engines did not start: replica 0: joining "
                                     "failed: ValueError: the trainer produces 1 HF parameters"), train
    for side in (train, gen):
        assert "1 of them are the trainer's MTP layers (the decoder layers with an eh_proj), which refit.gen_draft " \
               "requires the engine's speculative draft to hold" in side["error"], side["error"]
