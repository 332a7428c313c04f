"""Megatron-Bridge's real local shards and export, for the vLLM tests (run in ``.venv``).

vLLM 0.33 and Megatron-Bridge 0.6.2 pin transformers ranges that do not overlap, so the
engine tests (``.venv-vllm``) cannot build a Megatron model themselves. This script runs in
the Megatron environment: two train ranks build a tiny model through Bridge at train TP2
(:data:`VARIANTS`: their own layout) and,
per version, save their HF-named local shards (``enumerate_local_shards``: the pieces and
boxes a trainer sends, QKV splits and vocab padding included), their LoRA adapter shards,
and rank 0 Bridge's ``export_hf_weights`` (the reference; LoRA merged), and the model's own
log-probs on the default serving probe (``conversion.serving.trainer_forward``: what an engine
scoring the probe must serve). Version 1 is the initial model, every later version follows one
real optimizer step.

    .venv/bin/python tests/engines/vllm/bridge_shards.py OUT_DIR MODEL [MODEL ...] [--versions N] [--lora RANK]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:  # run as a script: the repository's packages
    sys.path.insert(0, ROOT)

TRAIN_TP = 2
LORA_ALPHA = 8
VARIANTS = {"qwen3-kv1": ("qwen3", {"kv_heads": 1}, dict(tp=1, dp=2)),
            "qwen3-moe-e8": ("qwen3-moe", {"experts": 8, "num_experts_per_tok": 2}, dict(tp=2, ep=2)),
            "qwen3-moe-e64": ("qwen3-moe", {"experts": 64, "num_experts_per_tok": 8}, dict(tp=2, ep=2)),
            "deepseek-v3-mtp": ("deepseek-v3", {"num_nextn_predict_layers": 1},
                                dict(tp=2, pp=2, sequence_parallel=True, mtp_layers=1,
                                     layout=[["embedding", "decoder", "decoder"], ["decoder", "mtp", "loss"]])),
            "deepseek-v3-mtp-fp8": ("deepseek-v3", dict(
                num_nextn_predict_layers=1, hidden_size=256, num_attention_heads=8, num_key_value_heads=8,
                qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, head_dim=32, q_lora_rank=128,
                kv_lora_rank=128, intermediate_size=256, moe_intermediate_size=256),
                dict(tp=2, pp=2, sequence_parallel=True, mtp_layers=1,
                     layout=[["embedding", "decoder", "decoder"], ["decoder", "mtp", "loss"]]))}
"""Models that are a preset with overrides and their own train layout: one KV head (every
vLLM TP rank then holds a replica of it), trained at TP1 x DP2 (TP2 cannot split one head);
8 experts top-2 and 64 experts top-8 trained at TP2 x EP2 (the wide expert-parallel tests);
DeepSeek-V3 with one MTP layer at TP2 with sequence parallelism and PP2 under the recipe's pipeline
layout, the MTP layer on the last stage (the engine's draft, #67: 4 ranks, made on its own), and the
same with every shard of a quantized weight on the 128-element FP8 grid at train TP2 and engine TP2
(the FP8 draft)."""
DTYPES = {"deepseek-v3-mtp-fp8": torch.bfloat16}
"""Models trained in another dtype than float32 (an FP8 engine serves bf16 beside its FP8 weights)."""


def train_layout(name: str):
    """The train layout ``name`` (a preset, or a :data:`VARIANTS` entry) is made at."""
    from megatron_refit.plan.layout import TrainLayout

    return TrainLayout(**VARIANTS[name][2]) if name in VARIANTS else TrainLayout(tp=TRAIN_TP)


def model_config(name: str):
    """The HF config of ``name`` (a preset, or a :data:`VARIANTS` entry)."""
    from conversion.presets import hf_config

    base, overrides, _ = VARIANTS.get(name, (name, {}, None))
    return hf_config(base, **overrides)


def _rank(rank: int, world: int, port: int, out_dir: str, models: list[str], versions: int, lora: int):
    from conversion.testing.build import build_model, destroy_model_parallel, init_gloo, init_model_parallel
    from conversion.lora import apply_lora
    from conversion.testing.train_step import train_step
    from megatron_refit.local.harness import tokens_for
    from conversion.refit import local_pieces
    from conversion.serving import trainer_forward
    from megatron_refit.plan.probe import make_probe

    init_gloo(rank, world, port)
    for name in models:
        model_name, _, kind = name.partition("+")
        layout = train_layout(model_name)
        init_model_parallel(layout)
        cfg = model_config(model_name)
        built = build_model(cfg, layout, dtype=DTYPES.get(model_name, torch.float32))
        if kind == "lora":
            built = replace(built, model=apply_lora(built.model, dim=lora, alpha=LORA_ALPHA))
        params = [p for chunk in built.model for p in chunk.parameters() if p.requires_grad]
        optimizer = torch.optim.Adam(params, lr=1e-2)
        for version in range(1, versions + 1):
            if version > 1:
                train_step(built, optimizer, tokens_for(version, cfg.vocab_size))
            weights, adapters = local_pieces(built.bridge, built.model, cfg)
            probe = make_probe(None, cfg.vocab_size).sequences
            saved = {
                "weights": [(p.spec, p.tensor().detach().clone()) for p in weights],
                "adapters": [(p.spec, p.tensor().detach().clone()) for p in adapters],
                "lora": (lora, LORA_ALPHA) if adapters else None,
                "probe": [list(q) for q in probe],
                "probe_logprobs": trainer_forward(built.model, cfg, lora=bool(adapters))(probe),
            }
            export = {n: t.detach().clone() for n, t in built.bridge.export_hf_weights(
                built.model, cpu=True, show_progress=False)}
            if rank == 0:
                saved["export"] = export
            torch.save(saved, os.path.join(out_dir, f"{name}.v{version}.rank{rank}.pt"))
        destroy_model_parallel()
    torch.distributed.destroy_process_group()


def load(out_dir: str, name: str, version: int, rank: int) -> dict:
    return torch.load(os.path.join(out_dir, f"{name}.v{version}.rank{rank}.pt"), weights_only=False)


def make(out_dir, *models: str, timeout_s: float = 600) -> str:
    """Run this script for ``models`` into ``out_dir`` in the Megatron environment
    (``$MEGATRON_PYTHON``, else ``.venv``: an engine's own venv cannot build the models);
    ``out_dir``, or ``RuntimeError`` with its stderr's tail."""
    import subprocess

    python = os.environ.get("MEGATRON_PYTHON", os.path.join(ROOT, ".venv", "bin", "python"))
    proc = subprocess.run([python, os.path.abspath(__file__), str(out_dir), *models], capture_output=True, text=True,
                          timeout=timeout_s)
    if proc.returncode:
        raise RuntimeError(f"bridge_shards.py {' '.join(models)} failed:\n{proc.stderr[-4000:]}")
    return str(out_dir)


def next_version(pieces: list, out_dir: str, name: str, version: int, rank: int) -> None:
    """Each piece's data replaced by ``version``'s (a live model's weights after its step)."""
    for piece, (_, tensor) in zip(pieces, load(out_dir, name, version, rank)["weights"], strict=True):
        piece.data = tensor


def main(argv=None) -> int:
    from megatron_refit.local.launch import PRELOAD_ENV, run_spawned

    # the ranks fork from a forkserver that imported Megatron once (the engine suite that starts
    # this script names its own environment's modules, which this one lacks)
    os.environ[PRELOAD_ENV] = "megatron_refit.testing.preload"
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # Megatron's torch.compile off, as in tests/conftest.py

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("models", nargs="+", help="presets; 'qwen3+lora' adds Bridge LoRA adapters")
    parser.add_argument("--versions", type=int, default=2)
    parser.add_argument("--lora", type=int, default=4, help="LoRA rank of the '+lora' models")
    args = parser.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    worlds = {train_layout(name.partition("+")[0]).world_size for name in args.models}
    if len(worlds) != 1:
        raise ValueError(f"bridge_shards: the models {args.models} are made at train worlds {sorted(worlds)}: make "
                         "each world's models in a run of their own")
    run_spawned(_rank, worlds.pop(), args.out_dir, args.models, args.versions, args.lora, timeout_s=600,
                env={"REFIT_QUIET_LOGS": "1"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
