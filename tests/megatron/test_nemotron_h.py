"""Nemotron-H at mapping level: Bridge's registry maps every Mamba, attention and ReLU^2-MoE
parameter; the local split rules hold at TP1 and TP2 (fake process group), Mamba's in_proj /
conv1d as one box per segment ([z, x, B, C, dt] / [x, B, C]). The build, forward and refits
are tested in test_nemotron_h_build.py and test_e2e_refit.py."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.local.launch import run_spawned
from megatron_refit.plan.layout import TrainLayout

NEMOTRON_MAPPINGS = {  # Megatron name -> (Bridge mapping type, HF checkpoint name)
    "decoder.layers.0.mixer.in_proj.weight": ("MambaInProjMapping", "backbone.layers.0.mixer.in_proj.weight"),
    "decoder.layers.0.mixer.conv1d.weight": ("MambaConv1dMapping", "backbone.layers.0.mixer.conv1d.weight"),
    "decoder.layers.0.mixer.conv1d.bias": ("MambaConv1dMapping", "backbone.layers.0.mixer.conv1d.bias"),
    "decoder.layers.0.mixer.A_log": ("ColumnParallelMapping", "backbone.layers.0.mixer.A_log"),
    "decoder.layers.0.mixer.D": ("ColumnParallelMapping", "backbone.layers.0.mixer.D"),
    "decoder.layers.0.mixer.dt_bias": ("ColumnParallelMapping", "backbone.layers.0.mixer.dt_bias"),
    "decoder.layers.0.mixer.norm.weight": ("ColumnParallelMapping", "backbone.layers.0.mixer.norm.weight"),
    "decoder.layers.0.mixer.out_proj.weight": ("RowParallelMapping", "backbone.layers.0.mixer.out_proj.weight"),
    "decoder.layers.0.mixer.in_proj.layer_norm_weight": ("AutoMapping", "backbone.layers.0.norm.weight"),
    "decoder.layers.1.self_attention.linear_qkv.weight": ("QKVMapping", {
        "q": "backbone.layers.1.mixer.q_proj.weight", "k": "backbone.layers.1.mixer.k_proj.weight",
        "v": "backbone.layers.1.mixer.v_proj.weight"}),
    "decoder.layers.1.self_attention.linear_proj.weight": ("AutoMapping", "backbone.layers.1.mixer.o_proj.weight"),
    "decoder.layers.2.mlp.router.weight": ("AutoMapping", "backbone.layers.2.mixer.gate.weight"),
    "decoder.layers.2.mlp.router.expert_bias": ("AutoMapping", "backbone.layers.2.mixer.gate.e_score_correction_bias"),
    # non-gated (ReLU^2) experts: fc1 is the up projection alone (no GatedMLPMapping)
    "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight": (
        "AutoMapping", "backbone.layers.2.mixer.experts.3.up_proj.weight"),
    "decoder.layers.2.mlp.experts.local_experts.3.linear_fc2.weight": (
        "AutoMapping", "backbone.layers.2.mixer.experts.3.down_proj.weight"),
    "decoder.layers.2.mlp.shared_experts.linear_fc1.weight": (
        "AutoMapping", "backbone.layers.2.mixer.shared_experts.up_proj.weight"),
    "decoder.layers.3.mlp.linear_fc1.weight": ("AutoMapping", "backbone.layers.3.mixer.up_proj.weight"),
    "decoder.layers.3.mlp.linear_fc2.weight": ("AutoMapping", "backbone.layers.3.mixer.down_proj.weight"),
    "embedding.word_embeddings.weight": ("AutoMapping", "backbone.embeddings.weight"),
    "decoder.final_norm.weight": ("AutoMapping", "backbone.norm_f.weight"),
}
# (Megatron name, local shape at TP2) for the explicit-parallelism Mamba mappings
NEMOTRON_LOCAL = [
    ("decoder.layers.0.mixer.A_log", (4,)),
    ("decoder.layers.0.mixer.dt_bias", (4,)),
    ("decoder.layers.0.mixer.norm.weight", (32,)),
    ("decoder.layers.0.mixer.out_proj.weight", (64, 32)),
    ("decoder.layers.0.mixer.in_proj.weight", (100, 64)),
    ("decoder.layers.0.mixer.conv1d.weight", (64, 1, 4)),
]


def _nemotron_mapping_level(rank, world_size, port):
    from types import SimpleNamespace

    from conversion.testing.build import destroy_model_parallel, init_model_parallel
    from conversion.presets import hf_config
    from conversion.local_shards import LocalSplitError, task_shards
    from conversion.testing.meta import fake_world
    from conversion.te_shim import import_bridge

    import_bridge()
    from megatron.bridge import AutoBridge

    cfg = hf_config("nemotron-h")
    registry = AutoBridge.from_hf_config(cfg)._model_bridge.mapping_registry()
    table = {}
    for name in NEMOTRON_MAPPINGS:
        m = registry.megatron_to_hf_lookup(name)
        table[name] = (type(m).__name__, m.hf_param)
    splits = {}
    for tp, tp_rank in ((1, 0), (2, 0), (2, 1)):
        with fake_world(tp_rank, tp):
            init_model_parallel(TrainLayout(tp=tp), create_gloo_process_groups=False)
            try:
                for name, local_shape in NEMOTRON_LOCAL:
                    shape = local_shape if tp == 2 else tuple(
                        s * 2 if d == (1 if "out_proj" in name else 0) else s for d, s in enumerate(local_shape))
                    task = SimpleNamespace(mapping=registry.megatron_to_hf_lookup(name), megatron_module=None,
                                           param_weight=torch.zeros(shape), global_param_name=name)
                    try:
                        splits[(tp, tp_rank, name)] = [s.spec for s in task_shards(task, vocab_size=cfg.vocab_size,
                                                                                 hf_config=cfg)]
                    except LocalSplitError as exc:
                        splits[(tp, tp_rank, name)] = str(exc)
            finally:
                destroy_model_parallel()
    return table, splits


@pytest.mark.slow
def test_nemotron_h_mapping_level():
    """Bridge's Nemotron-H registry maps every Mamba / attention / ReLU^2-MoE parameter, and
    the local split rules hold at TP1 and TP2."""
    table, splits = run_spawned(_nemotron_mapping_level, 1, timeout_s=300)[0]
    assert table == NEMOTRON_MAPPINGS
    for name, local_shape in NEMOTRON_LOCAL:
        full = splits[(1, 0, name)]
        assert all(s.box == tuple((0, n) for n in s.global_shape) for s in full), name
        if "in_proj" in name or "conv1d" in name:  # [z, x, B, C, dt] per rank: one box per segment
            segments = ["z", "x", "B", "C", "dt"] if "in_proj" in name else ["x", "B", "C"]
            assert [s.name.split("#")[1] for s in full] == segments, name
            assert sum(s.global_shape[0] for s in full) == 2 * local_shape[0], name
            for r in (0, 1):
                halves = splits[(2, r, name)]
                assert [s.global_shape for s in halves] == [s.global_shape for s in full], (name, r)
                assert [s.box[0] for s in halves] == [(r * s.global_shape[0] // 2, (r + 1) * s.global_shape[0] // 2)
                                                      for s in full], (name, r)
            continue
        dim = 1 if "out_proj" in name else 0
        for r in (0, 1):
            (spec,) = splits[(2, r, name)]
            assert spec.global_shape == full[0].global_shape
            n = local_shape[dim]
            assert spec.box[dim] == (r * n, (r + 1) * n), (name, r)
