"""Engines by name (``refit.engine``), one control protocol for all of them, and a toy engine
registered from one module (megatron_refit/testing/toy_engine.py) that a refit lands in end to end."""

from __future__ import annotations

import zlib

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.control import EngineControl, engine_control
from megatron_refit.registry import Engine, engine_named, engine_names, register_engine
from megatron_refit.local.launch import run_spawned

SHAPES = {"w": ((8, 6), "float32"), "n": ((6,), "bfloat16")}


def test_builtin_engines_and_their_rules():
    assert {"vllm", "sglang", "hf"} <= set(engine_names())
    assert engine_named("hf").layout == "full" and engine_named("vllm").layout == "vllm"
    with pytest.raises(ValueError, match=r"refit.engine: 'tgi' is not one of \["):
        RefitConfig(engine="tgi")
    with pytest.raises(ValueError, match="'vllm' is already registered"):
        register_engine(Engine(name="vllm"))
    with pytest.raises(ValueError, match="layout must be one of"):
        Engine(name="odd", layout="rows")


def test_the_old_backend_key_is_refused_naming_engine():
    with pytest.raises(ValueError, match=r"refit.backend is now refit.engine: write engine: sglang"):
        RefitConfig.from_dict({"enabled": True, "backend": "sglang"})


def test_engine_control_by_name():
    assert engine_control(RefitConfig(engine="vllm")) is None
    assert engine_control(RefitConfig(engine="sglang"), []) is None  # train ranks other than 0
    with pytest.raises(ValueError, match="control clients were given for refit.engine 'hf'"):
        engine_control(RefitConfig(engine="hf"), [object()])
    from megatron_refit.engines.sglang.trainer.control import SglangControl
    from megatron_refit.engines.vllm.trainer.control import VllmControl

    control = engine_control(RefitConfig(engine="sglang"), [object()])
    assert isinstance(control, SglangControl) and isinstance(control, EngineControl)
    control = engine_control(RefitConfig(engine="vllm", gen_dp=2), [object(), object()])  # one client per replica
    assert isinstance(control, VllmControl) and isinstance(control, EngineControl)
    # the refit: section is parsed once where it is read: the entry points take only a RefitConfig
    with pytest.raises(TypeError, match=r"engine_control takes the refit: section as a RefitConfig, parsed once where "
                                        r"it is read \(RefitConfig.from_dict\(mapping\), load_training_yaml\(path\)\), "
                                        r"got dict"):
        engine_control({"engine": "vllm"})
    with pytest.raises(TypeError, match=r"VllmControl takes the refit: section as a RefitConfig"):
        VllmControl([object()], {"gen_dp": 1})
    with pytest.raises(ValueError, match=r"SglangControl drives SGLang engines, but refit.engine is 'vllm': set "
                                         r"engine: sglang"):
        SglangControl([object()], RefitConfig(engine="vllm"))


def _full(name):
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def _toy_rank(rank, world, port, refit):
    import megatron_refit.testing.toy_engine  # noqa: F401 -- registers engine "toy" in this process
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.plan.spec import ShardSpec, box_along, full_box
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces

    cfg = RefitConfig.from_dict({**refit, "port": port})
    num_train = world - 1
    if rank < num_train:  # train TP2: row halves of w, the norm replicated
        w = _full("w")
        pieces = [TensorPiece(ShardSpec(name="w", global_shape=(8, 6), dtype="float32",
                                        box=box_along((8, 6), 0, 4 * rank, 4 * rank + 4)), w[4 * rank:4 * rank + 4]),
                  TensorPiece(ShardSpec(name="n", global_shape=(6,), dtype="bfloat16", box=full_box((6,))),
                              _full("n"))]
        calls = []  # the toy engine's one replica: rank 0 logs its control calls here
        control = engine_control(cfg, [calls] if rank == 0 else [])
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=num_train, control=control)
        for version in (1, 2):
            fleet.refit(version)
        fleet.close()
        return calls
    from megatron_refit.testing.toy_engine import ToyStorage

    storage = ToyStorage(SHAPES)
    member = engine_refit(cfg, storage, gen_index=0, num_train=num_train)
    for version in (1, 2):
        member.receive(version)
    member.close()
    return dict(exact=all(torch.equal(storage.tensors[n], _full(n)) for n in SHAPES),
                finalized=storage.finalized, state=member.state)


@pytest.mark.slow
def test_a_toy_engine_registered_from_one_module_receives_a_refit():
    refit = {"enabled": True, "engine": "toy", "gen_tp": 1, "gen_dp": 1, "timeout_s": 60}
    train0, train1, gen = run_spawned(_toy_rank, 3, refit, timeout_s=180)
    assert gen == dict(exact=True, finalized=2, state="ready")
    assert train0 == ["connect toy 2", "start 1", "land 1", "start 2", "land 2", "close"] and train1 == []


def test_a_toy_engine_config_is_checked_by_its_own_rules():
    import megatron_refit.testing.toy_engine  # noqa: F401

    assert RefitConfig(engine="toy").gen_style == "full"
    with pytest.raises(ValueError, match="refit.engine 'toy' holds whole tensors and needs gen_tp 1, got 2"):
        RefitConfig(engine="toy", gen_tp=2)


def test_engine_load_auto_is_the_default_and_resolves_per_engine():
    from megatron_refit.config import RefitConfig
    from megatron_refit.registry import resolved_load

    assert RefitConfig().engine_load == "auto"
    assert RefitConfig(engine="vllm", swap="staged").engine_load == "auto"  # a staged swap takes auto
    assert resolved_load(engine_named("vllm"), "auto", "staged") == "load_weights"
    assert resolved_load(engine_named("vllm"), "auto", "in_place") is None  # the engine decides from its parameters
    assert resolved_load(engine_named("sglang"), "auto", "in_place") == "in_place"  # its only mode
    assert resolved_load(engine_named("vllm"), "in_place", "in_place") == "in_place"
    with pytest.raises(ValueError, match="needs engine_load 'load_weights'"):
        RefitConfig(engine="vllm", swap="staged", engine_load="in_place")
