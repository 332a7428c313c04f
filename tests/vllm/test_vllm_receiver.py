"""The vLLM receiver against vLLM's real model classes and weight loaders (CPU, gloo).

Runs in ``.venv-vllm`` (``make test`` creates it and runs this directory there). Two train
ranks hold dim-0 halves of a tiny model's HF tensors; vLLM ranks (gen TP 4 over 2 KV heads:
each KV head on two ranks) receive them in place into vLLM's fused parameters. The reference is vLLM's own
``load_weights`` fed the full HF tensors on a second model instance: every parameter must
be equal bit for bit, also after a second refit.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megatron_refit.driver import TensorPiece
from megatron_refit.launch import free_ports, run_spawned

pytest.importorskip("vllm")

# Gen TP2 (Qwen3, Qwen3-MoE, DeepSeek-V3) runs through the weight-transfer backend in
# test_weight_transfer.py, from Bridge's real shards; here: TP4 over 2 KV heads.
CASES = [("qwen3", 4)]


def _full_tensors(model_name: str, seed: int, **overrides) -> tuple[dict, object]:
    from transformers import AutoModelForCausalLM

    from conversion.hf_configs import hf_config
    from megatron_refit.receivers.hf import HFReceiver

    cfg = hf_config(model_name, **overrides)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return HFReceiver(hf).state_dict_hf(), cfg


def _vllm_model(cfg, tp: int, rank: int, port: int, workdir: str, quant: dict | None = None,
                dtype: str = "float32"):
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401  (registers loaders)
    from vllm.model_executor.models import ModelRegistry

    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(dict(cfg.to_dict(), **({"quantization_config": quant} if quant else {})), f)
    vcfg = VllmConfig(
        model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                                 dtype=dtype),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():  # once per process: several models share the TP group
        with set_current_vllm_config(vcfg):
            init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(tp, 1, backend="gloo")
    model_cls, _ = ModelRegistry.resolve_model_cls(cfg.architectures, vcfg.model_config)

    def build():
        # attention layers register by name; a second instance (the reference) needs a clean slate
        vcfg.compilation_config.static_forward_context.clear()
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_current_vllm_config(vcfg), set_default_torch_dtype(vcfg.model_config.dtype), torch.device("cpu"):
            return model_cls(vllm_config=vcfg).eval()

    return vcfg, build


def _rank(rank, world, port, model_names, gen_tp, vllm_port, workdir):
    """Every model of ``model_names`` in turn, in the same processes (vLLM's import and
    distributed set-up are paid once)."""
    from megatron_refit.transport import RefitGroup

    group = RefitGroup.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=120)
    return {name: _case(group, rank, name, gen_tp, vllm_port, os.path.join(workdir, name)) for name in model_names}


def _case(group, rank, model_name, gen_tp, vllm_port, workdir):
    from megatron_refit.driver import Receiver, Refitter
    from megatron_refit.gen_layout import GenLayout
    from megatron_refit.hf_model import model_shape
    from megatron_refit.spec import ShardSpec, box_along, full_box

    num_train = 2
    versions = {1: 11, 2: 22}  # refit version -> seed of the "trained" weights
    if rank < num_train:
        out = []
        for version, seed in versions.items():
            full, _ = _full_tensors(model_name, seed)
            pieces = []
            for name, t in full.items():
                shape = tuple(t.shape)
                if t.ndim >= 2 and shape[0] % num_train == 0:
                    n = shape[0] // num_train
                    spec = ShardSpec(name=name, global_shape=shape, dtype="float32",
                                     box=box_along(shape, 0, rank * n, (rank + 1) * n))
                    pieces.append(TensorPiece(spec, t[rank * n:(rank + 1) * n]))
                else:
                    pieces.append(TensorPiece(ShardSpec(name=name, global_shape=shape, dtype="float32",
                                                   box=full_box(shape)), t))
            if version == 1:
                refitter = Refitter(group, pieces, num_train=num_train, num_gen=gen_tp, bucket_bytes=256 << 10)
                refitter.prepare()
            else:
                refitter.pieces = {p.spec.name: p for p in pieces}
            out.append(refitter.refit(version).as_dict())
        return out

    from megatron_refit.receivers.engine import EngineReceiver, vllm_post_load

    gen_index = rank - num_train
    full, cfg = _full_tensors(model_name, versions[1])
    vcfg, build = _vllm_model(cfg, gen_tp, gen_index, vllm_port, workdir)
    model = build()
    shape = model_shape(cfg)
    params = {n: (tuple(t.shape), "float32") for n, t in full.items()}
    is_moe = "moe" in model_name or model_name.startswith("deepseek")
    # process_weights_after_loading needs a CUDA-only op for MoE on CPU: checked on a GPU only
    post = None if is_moe else _under(vcfg, vllm_post_load(model, vcfg.model_config, torch.device("cpu")))
    backend = EngineReceiver.for_model(model, params, GenLayout(tp=gen_tp), shape, gen_index=gen_index,
                                       post_load=post)
    receiver = Receiver(group, backend, num_train=num_train, num_gen=gen_tp, bucket_bytes=256 << 10)
    receiver.prepare()
    results = []
    for version, seed in versions.items():
        report = receiver.receive(version)
        full, _ = _full_tensors(model_name, seed)
        ref = build()
        _under(vcfg, lambda: ref.load_weights(iter(full.items())))()
        if post is not None:
            _under(vcfg, vllm_post_load(ref, vcfg.model_config, torch.device("cpu")))()
        mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
        assert set(mine) == set(theirs)
        diff = [n for n in mine if not torch.equal(mine[n].data, theirs[n].data)]
        results.append(dict(report=report.as_dict(), diff=diff, num_params=len(mine)))
    return results


def _under(vcfg, fn):
    """``fn`` run inside vLLM's current-config context (its layers look it up)."""
    from vllm.config import set_current_vllm_config

    def run():
        with set_current_vllm_config(vcfg):
            return fn()

    return run


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """{gen_tp: {model: per-rank results}}: one spawned group per gen TP, run on first use."""
    cache = {}

    def get(gen_tp):
        if gen_tp not in cache:
            # MoE first: vLLM creates its expert-parallel group only when the first config has experts
            names = sorted((m for m, tp in CASES if tp == gen_tp), key=lambda m: m == "qwen3")
            vllm_port, refit_port = free_ports(2)
            out = run_spawned(_rank, 2 + gen_tp, names, gen_tp, vllm_port, str(tmp_path_factory.mktemp("vllm")),
                              timeout_s=600, env={"VLLM_TARGET_DEVICE": "cpu"}, port=refit_port)
            cache[gen_tp] = {name: [rank_out[name] for rank_out in out] for name in names}
        return cache[gen_tp]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("model_name,gen_tp", CASES, ids=[f"{m}-genTP{t}" for m, t in CASES])
def test_vllm_receiver_matches_vllm_load_weights(model_name, gen_tp, spawned):
    out = spawned(gen_tp)[model_name]
    for gen in out[2:]:
        for item in gen:
            assert item["diff"] == [], item["diff"][:5]
            assert item["num_params"] > 0
            assert item["report"]["bytes_received"] > 0
    for train_reports in zip(*out[:2]):
        assert sum(r["bytes_sent"] for r in train_reports) == train_reports[0]["bytes_minimal"]
