"""SGLang 0.5.23's real model classes on CPU, in one rank of a gloo group (``.venv-sglang``).

SGLang's CPU engine needs an ``sgl_kernel`` built from source against a CPU torch, so no
``Engine`` starts here; what a TP worker does before it serves runs as SGLang runs it:
:func:`init_sglang` sets up its distributed state over gloo (the per-process setup of
``sglang.test.layer_ut_utils``, which itself needs ``datasets``), :func:`build_model` builds
the model through SGLang's own ``ModelConfig`` and dummy loader (``get_model_loader`` →
``DummyModelLoader.load_model``: the model class from its registry, random weights,
post-load), and :func:`refit_loader` is a custom weight loader (``--custom-weight-loader``)
that runs megatron_refit's receiver inside the worker, driven through SGLang's
``update_weights_from_tensor``.
"""

from __future__ import annotations

import json
import logging
import os

import torch

LOADER = "tests.sglang.sglang_cpu.refit_loader"
"""Import path of :func:`refit_loader`: the ``custom_weight_loader`` server argument and the
``load_format`` of ``update_weights_from_tensor`` calls."""
PREFIX = "megatron_refit."
"""Names of the control messages :func:`refit_loader` takes: ``PREFIX + op + ":" + JSON``."""


def init_sglang(tp: int, tp_rank: int, port: int, model_dir: str) -> None:
    """This process as rank ``tp_rank`` of an SGLang engine at TP ``tp`` on CPU: its world
    and model-parallel groups over gloo (rendezvous on ``port``) and the published server
    args (``device="cpu"``, float32, dummy weights, :data:`LOADER` as custom weight loader)."""
    # TP >= 2 would build PyNccl ("Expected a cuda device"): no NCCL library, no PyNccl
    os.environ["SGLANG_NCCL_SO_PATH"] = os.path.join(model_dir, "no-libnccl.so")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        set_custom_all_reduce,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    set_custom_all_reduce(False)
    init_distributed_environment(world_size=tp, rank=tp_rank, local_rank=tp_rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()  # as sglang.test.test_utils.publish_build_topology, with the server args of a CPU engine
    publish(ServerArgs(model_path=model_dir, device="cpu", tp_size=tp, dtype="float32", load_format="dummy",
                       skip_tokenizer_init=True, custom_weight_loader=[LOADER]),
            role="test", ranks=SpawnRanks(world_rank=tp_rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    # the rotary embedding takes its CPU path only where SGLang's CPU kernels are built;
    # elsewhere it imports vLLM's rotary op
    import sglang.srt.layers.rotary_embedding.base as rotary

    rotary._is_cpu = True


def write_model_dir(hf_config, model_dir: str) -> str:
    """A model directory SGLang's ``ModelConfig`` reads: ``config.json`` only."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(hf_config.to_dict(), f)
    return model_dir


def build_model(model_dir: str) -> torch.nn.Module:
    """SGLang's model for ``model_dir`` (its registry's class for the architecture, e.g.
    ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``) on this TP rank, float32, built by
    SGLang's dummy loader (random weights, then SGLang's post-load steps)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(model_dir, dtype="float32")
    loader = get_model_loader(LoadConfig(load_format="dummy"), model_config)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def weight_updater(model: torch.nn.Module, model_dir: str):
    """SGLang's ``WeightUpdater`` over ``model``, as ``ModelRunner.init_weight_updater`` makes
    it (custom weight loaders from the published server args)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.runtime_context import get_model, get_parallel

    def absent(*args, **kwargs):
        raise AssertionError("not called by update_weights_from_tensor")

    return WeightUpdater(tp_rank=get_parallel().tp_rank, device="cpu", gpu_id=0,
                         model_config=ModelConfig(model_dir, dtype="float32"),
                         custom_weight_loaders=get_model().custom_weight_loader, get_model=lambda: model,
                         update_model_fields=absent, recapture_cuda_graph=absent, get_model_runner=absent)


# -- megatron_refit in the TP worker ---------------------------------------------------------


def engine_refit_for(model: torch.nn.Module, refit: dict, *, num_train: int, replica: int = 0):
    """Join the refit group as this TP rank of engine ``replica`` and build the plan: an
    :class:`~megatron_refit.receivers.engine.EngineReceiver` over ``model``'s own
    parameters (in place), SGLang's post-load hook after every refit."""
    from sglang.srt.runtime_context import get_parallel

    from megatron_refit.config import RefitConfig
    from megatron_refit.hf_model import hf_param_table, model_shape
    from megatron_refit.integration import engine_refit
    from megatron_refit.receivers.engine import EngineReceiver, sglang_post_load

    cfg = RefitConfig.from_dict({"enabled": True, "backend": "sglang", **refit})
    hf_config = model.config
    dtype = next(model.parameters()).dtype
    gen_index = replica * cfg.gen_tp + get_parallel().tp_rank
    backend = EngineReceiver.for_model(model, hf_param_table(hf_config, dtype), cfg.gen_layout(),
                                       model_shape(hf_config), gen_index=gen_index,
                                       post_load=sglang_post_load(model))
    return engine_refit(cfg, backend, gen_index=gen_index, num_train=num_train)


def _control(op: str, **args) -> list[tuple[str, torch.Tensor]]:
    # the message is the name; the tensor is empty: it pickles without shared memory (no file
    # descriptor to pass), so the payload also travels base64 in an HTTP request
    return [(f"{PREFIX}{op}:{json.dumps(args)}", torch.empty(0, dtype=torch.uint8))]


def connect_tensors(refit: dict, *, num_train: int, replica: int = 0) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of the ``update_weights_from_tensor`` call that makes every TP
    worker of engine ``replica`` join the refit group (``refit``: the refit section)."""
    return _control("connect", refit=refit, num_train=num_train, replica=replica)


def refit_tensors(version: int, full: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of the ``update_weights_from_tensor`` call for refit ``version``."""
    return _control("refit", version=version, full=full)


def close_tensors() -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of the call that leaves the refit group."""
    return _control("close")


def refit_loader(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang custom weight loader: ``WeightUpdater.update_weights_from_tensor`` calls it in
    every TP worker with the model and the (deserialised) named tensors. These are control
    messages (:func:`connect_tensors`, :func:`refit_tensors`, :func:`close_tensors`); the
    weights themselves come over the refit group, straight into the model's parameters.

    It never raises: an exception out of a weight loader ends SGLang's scheduler process
    (``run_scheduler_process``: "Scheduler hit an exception", SIGQUIT to the server), and a
    TP worker that left the call early would leave the others in its closing barrier. A
    failed refit is logged and kept in ``model.megatron_refit_error`` (None after a call that
    succeeded); the weights' state is the receiver's (``stale`` once bytes moved), and every
    train rank's ``refit`` raises."""
    model.megatron_refit_error = None
    for name, _ in named_tensors:
        op, _, args = name.removeprefix(PREFIX).partition(":")
        try:
            if not name.startswith(PREFIX) or op not in ("connect", "refit", "close"):
                raise ValueError(f"{name!r} is no megatron_refit control message ({PREFIX}connect / refit / close)")
            args = json.loads(args)
            if op == "connect":
                model._megatron_refit = engine_refit_for(model, args["refit"], num_train=args["num_train"],
                                                         replica=args["replica"])
            elif op == "refit":
                model._megatron_refit.receive(args["version"], full=args["full"])
            else:
                model._megatron_refit.close()
                del model._megatron_refit
        except Exception as exc:  # noqa: BLE001 -- see the docstring: raising would end the engine
            logging.getLogger(__name__).exception("megatron_refit %s failed", op)
            model.megatron_refit_error = f"{type(exc).__name__}: {exc}"
