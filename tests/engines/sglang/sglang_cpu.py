"""SGLang 0.5.23's real model classes on CPU, in one rank of a gloo group (``.venv-sglang``).

SGLang's CPU engine needs an ``sgl_kernel`` built from source against a CPU torch, so no
``Engine`` starts here; what a TP worker does before it serves runs as SGLang runs it:
:func:`init_sglang` sets up its distributed state over gloo (the per-process setup of
``sglang.test.layer_ut_utils``, which itself needs ``datasets``), :func:`build_model` builds
the model through SGLang's own ``ModelConfig`` and dummy loader (``get_model_loader`` →
``DummyModelLoader.load_model``: the model class from its registry, random weights,
post-load), and :mod:`.engine_standins` drive SGLang's weight-update path in the worker as
an ``Engine`` or HTTP server would, with megatron_refit's custom weight loader
(:data:`~megatron_refit.engines.sglang.worker.loader.LOADER`).
"""

from __future__ import annotations

import json
import os

import torch

from megatron_refit.engines.sglang.messages import LOADER


def init_sglang(tp: int, tp_rank: int, port: int, model_dir: str, *, attention_dp: int = 1, ep_size: int = 1,
                dp_lm_head: bool = True, speculative_algorithm: str | None = None, **server_args) -> None:
    """This process as rank ``tp_rank`` of an SGLang engine at TP ``tp`` on CPU: its world
    and model-parallel groups over gloo (rendezvous on ``port``) and the published server
    args (``device="cpu"``, float32, dummy weights, :data:`LOADER` as custom weight loader).
    ``attention_dp > 1``: ``--dp attention_dp --enable-dp-attention`` (and ``--enable-dp-lm-head``
    unless ``dp_lm_head`` is false), attention TP ``tp // attention_dp``; ``ep_size``: ``--ep-size``;
    ``speculative_algorithm``: ``--speculative-algorithm`` (``NEXTN``: the model's MTP layer as its draft,
    :func:`build_draft`); ``server_args``: more of ``ServerArgs`` (e.g. ``ep_num_redundant_experts``,
    ``enable_eplb``)."""
    # TP >= 2 would build PyNccl ("Expected a cuda device"): no NCCL library, no PyNccl
    os.environ["SGLANG_NCCL_SO_PATH"] = os.path.join(model_dir, "no-libnccl.so")
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        set_custom_all_reduce,
    )
    from sglang.srt.layers.dp_attention import initialize_dp_attention
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    set_custom_all_reduce(False)
    init_distributed_environment(world_size=tp, rank=tp_rank, local_rank=tp_rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    reset_context()  # as sglang.test.test_utils.publish_build_topology, with the server args of a CPU engine
    dp_attention = dict(dp_size=attention_dp, enable_dp_attention=True, enable_dp_lm_head=dp_lm_head) \
        if attention_dp > 1 else {}
    server_args = ServerArgs(model_path=model_dir, device="cpu", tp_size=tp, ep_size=ep_size, dtype="float32",
                             load_format="dummy", skip_tokenizer_init=True, custom_weight_loader=[LOADER],
                             speculative_algorithm=speculative_algorithm, **dp_attention, **server_args)
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=tp_rank))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    initialize_model_parallel(backend="gloo")
    initialize_dp_attention(server_args)  # as distributed.bootstrap after the groups: DP attention's flags
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


def build_model(model_dir: str, *, expert_location: bool = False) -> torch.nn.Module:
    """SGLang's model for ``model_dir`` (its registry's class for the architecture, e.g.
    ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``) on this TP rank, float32, built by
    SGLang's dummy loader (random weights, then SGLang's post-load steps). ``expert_location``:
    first the server's expert location for this model, as ``ModelRunner.maybe_init_expert_location_metadata``
    sets it (``--init-expert-location``, trivial by default; its weight loader follows it)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    model_config = ModelConfig(model_dir, dtype="float32")
    if expert_location:
        from sglang.srt.eplb.expert_location import (
            compute_initial_expert_location_metadata,
            set_global_expert_location_metadata,
        )
        from sglang.srt.runtime_context import get_parallel

        metadata = compute_initial_expert_location_metadata(model_config=model_config,
                                                            moe_ep_rank=get_parallel().moe_ep_rank)
        set_global_expert_location_metadata(metadata, allow_overwrite=True)
    loader = get_model_loader(LoadConfig(load_format="dummy"), model_config)
    return loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))


def build_draft(model_dir: str, target: torch.nn.Module, *, dtype: str = "float32") -> torch.nn.Module:
    """SGLang's speculative draft for ``model_dir`` on this TP rank, as SGLang's EAGLE worker makes
    it: built from the draft model config SGLang derives from the model's own checkpoint
    (``ModelConfig(is_draft_model=True)``: a DeepSeek-V3 becomes ``DeepseekV3ForCausalLMNextN``) by
    the dummy loader, then ``target``'s embedding and LM head shared into it by SGLang's own
    ``resolve_draft_embed_and_head`` and the draft's ``set_embed_and_head`` (its
    ``torch.cuda.synchronize`` skipped: there is no CUDA device here). ``dtype``: the target's
    (an FP8 checkpoint's model computes in bfloat16)."""
    from unittest import mock

    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader
    from sglang.srt.speculative.pp_draft_embedding import resolve_draft_embed_and_head

    model_config = ModelConfig(model_dir, dtype=dtype, is_draft_model=True)
    load_config = LoadConfig(load_format="dummy")
    draft = get_model_loader(load_config, model_config).load_model(model_config=model_config,
                                                                   device_config=DeviceConfig("cpu"))
    embed, head = resolve_draft_embed_and_head(target_model=target, draft_model=draft, model_path=model_dir,
                                               revision=None, load_config=load_config)
    with mock.patch("torch.cuda.synchronize"):
        draft.set_embed_and_head(embed, head)
    return draft


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


def prefill_logprobs(model: torch.nn.Module, model_dir: str, sequences: list[list[int]]) -> list[list[tuple]]:
    """What ``Engine.generate(input_ids=sequences, return_logprob=True, logprob_start_len=0)``
    answers in ``meta_info["input_token_logprobs"]`` for each sequence (``(logprob, token id,
    None)`` per prompt token, the first one's logprob None), computed by SGLang's own code on this
    TP rank: one prefill (EXTEND) batch through the model's forward with SGLang's real memory pools
    and its torch-native attention backend, and its ``LogitsProcessor``'s input log-probs. The
    scheduler's part (slots, the batch's fields, the log-prob token ids) is done here as
    ``ScheduleBatch.prepare_for_extend`` / ``ForwardBatch.init_new`` would."""
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.runtime_context import get_parallel

    config = ModelConfig(model_dir, dtype="float32")
    seqs = [torch.tensor(s, dtype=torch.int64) for s in sequences]
    lens = [len(s) for s in seqs]
    total = sum(lens)
    req_pool = ReqToTokenPool(size=len(seqs), max_context_len=config.context_len, device="cpu",
                              enable_memory_saver=False)
    kv_pool = MHATokenToKVPool(size=total, page_size=1, dtype=torch.float32,
                               head_num=config.get_num_kv_heads(get_parallel().tp_size), head_dim=config.head_dim,
                               layer_num=config.num_hidden_layers, device="cpu", enable_memory_saver=False)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_pool,
                                                     token_to_kv_pool=kv_pool))
    extend = torch.tensor(lens, dtype=torch.int32)
    slots = torch.arange(1, total + 1, dtype=torch.int64)  # slot 0 is SGLang's padding row
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(seqs), input_ids=torch.cat(seqs),
        req_pool_indices=torch.arange(1, len(seqs) + 1, dtype=torch.int64), seq_lens=extend.long(),
        seq_lens_cpu=extend.long(), seq_lens_sum=total, out_cache_loc=slots,
        positions=torch.cat([torch.arange(n) for n in lens]), extend_num_tokens=total, extend_seq_lens=extend,
        extend_prefix_lens=torch.zeros_like(extend), extend_start_loc=torch.cumsum(extend, 0) - extend,
        extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=[0] * len(seqs), return_logprob=True,
        extend_logprob_start_lens_cpu=[0] * len(seqs), top_logprobs_nums=[0] * len(seqs),
        token_ids_logprobs=[None] * len(seqs),
        # the scheduler's extend_input_logprob_token_ids: each prompt shifted by one, a 0 after its last token
        extend_input_logprob_token_ids_gpu=torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s in seqs]),
        capture_hidden_mode=CaptureHiddenMode.NULL)
    start = 0
    for i, n in enumerate(lens):
        req_pool.write((i + 1, slice(0, n)), slots[start:start + n].int())
        start += n
    backend.init_forward_metadata(batch)
    with torch.inference_mode(), forward_context(ForwardContext(attn_backend=backend), forward_batch=batch):
        logprobs = model.forward(batch.input_ids, batch.positions, batch).input_token_logprobs.tolist()
    out, start = [], 0
    for seq in sequences:  # per sequence: len(seq) values, the last for the placeholder token
        values = logprobs[start:start + len(seq)]
        out.append([(None, seq[0], None)] + [(values[i - 1], seq[i], None) for i in range(1, len(seq))])
        start += len(seq)
    return out


def saved_bridge_shards(tmp_path_factory, *names: str) -> str:
    """Bridge's real local shards and exports of ``names`` (``tests/engines/vllm/bridge_shards.py``,
    run in ``.venv``: Megatron is not in SGLang's venv), saved in a fresh directory (returned)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    bridge = tmp_path_factory.mktemp("bridge")
    python = os.environ.get("MEGATRON_PYTHON", str(root / ".venv" / "bin" / "python"))
    script = root / "tests" / "engines" / "vllm" / "bridge_shards.py"
    proc = subprocess.run([python, str(script), str(bridge), *names], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(bridge)
