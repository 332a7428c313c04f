"""Nemotron-H (Mamba, attention, ReLU² MoE, MLP) built on CPU through ``conversion.testing.build``:
gloo TP1 and TP2, and the meta device in a fake world (TP2, TP2xEP2).

One spawn of two gloo ranks: TP1 (x DP2) builds with seeded weights of realistic scale and
exports through Bridge; TP2 builds with other weights, loads that export as an HF checkpoint
(Bridge's ``load_hf_weights``) and exports it back bit for bit. Megatron's forward at TP1 and
TP2 (the pure-torch Mamba mixer on this rank's heads and groups) matches transformers'
``NemotronHForCausalLM`` on the same weights; one training step (backward through the scan,
SGD) runs at TP2. Then each rank builds meta-device ranks in a fake world.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_refit.local.launch import run_spawned

pytestmark = pytest.mark.slow

BATCH, SEQ = 2, 10
MIXER = "decoder.layers.0.mixer."
MAMBA_PARAMS = ("in_proj.weight", "conv1d_weight", "conv1d_bias", "A_log", "D", "dt_bias", "norm.weight",
                "out_proj.weight")


def _tokens(vocab):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


@torch.no_grad()
def _realistic_(model) -> None:
    """Weights of order-one activations (Megatron's init std 0.02 leaves tiny logits that
    would hide a wrong mixer): seeded by name, so DP replicas agree. TP1 only (local names
    are the global ones)."""
    import zlib

    for name, p in model.named_parameters():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if name.endswith(("A_log", "dt_bias", "conv1d_weight", "conv1d_bias")):
            continue  # Megatron's Mamba init has the right ranges already
        if p.dim() == 1:  # norms, D
            p.copy_(1.0 + 0.3 * noise)
        elif "embedding" in name:
            p.copy_(noise)
        else:
            p.copy_(noise / p.shape[1] ** 0.5)
    for name, b in model.named_buffers():
        if name.endswith("router.expert_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))


def _export(built):
    exported = built.bridge.export_hf_weights(built.model, cpu=True, show_progress=False)
    return {n: t.detach().clone() for n, t in exported}


def _shapes(built):
    return {n: (tuple(p.shape), p.device.type) for n, p in built.model[0].named_parameters()}


def _nemotron_h_worker(rank, world_size, port, ckpt_dir):
    import safetensors.torch

    from conversion.testing.build import (build_model, cpu_forward, destroy_model_parallel, init_gloo,
                                          init_model_parallel)
    from conversion.presets import hf_config
    from conversion.testing.meta import fake_world
    from conversion.testing.train_step import forward_logits, train_step
    from megatron_refit.plan.layout import TrainLayout

    cfg = hf_config("nemotron-h")
    tokens = _tokens(cfg.vocab_size)
    out = {}
    init_gloo(rank, world_size, port)
    # TP1 (x DP2): realistic weights, export, forward; rank 0 writes the export as a checkpoint
    init_model_parallel(TrainLayout(tp=1, dp=2))
    built = build_model(cfg, TrainLayout(tp=1, dp=2), seed=1)
    _realistic_(built.model[0])
    out["export_tp1"] = _export(built)
    out["logits_tp1"] = forward_logits(built, tokens)
    if rank == 0:
        cfg.save_pretrained(ckpt_dir)
        safetensors.torch.save_file(out["export_tp1"], f"{ckpt_dir}/model.safetensors")
    torch.distributed.barrier()
    destroy_model_parallel()
    # TP2: other weights, load the checkpoint, export back, forward, one training step
    layout = TrainLayout(tp=2)
    init_model_parallel(layout)
    built = build_model(cfg, layout, seed=2)
    out["shapes_tp2"] = _shapes(built)
    with cpu_forward():  # Bridge's replicated load asks torch.cuda.current_device()
        built.bridge.load_hf_weights(built.model, ckpt_dir)
    out["export_tp2"] = _export(built)
    out["logits_tp2"] = forward_logits(built, tokens)
    optimizer = torch.optim.SGD(built.model[0].parameters(), lr=0.05)
    out["loss"] = train_step(built, optimizer, tokens)
    out["mamba_grads"] = {k: float(built.model[0].get_parameter(MIXER + k).grad.abs().sum()) for k in MAMBA_PARAMS}
    out["export_stepped"] = _export(built)
    destroy_model_parallel()
    torch.distributed.destroy_process_group()
    # meta device, fake world: rank 0 builds both TP2 ranks, rank 1 the four TP2xEP2 ranks
    meta_layout = TrainLayout(tp=2) if rank == 0 else TrainLayout(tp=2, ep=2, dp=2)
    out["meta"] = {}
    for r in range(meta_layout.world_size):
        with fake_world(r, meta_layout.world_size):
            init_model_parallel(meta_layout, create_gloo_process_groups=False)
            try:
                out["meta"][r] = _shapes(build_model(cfg, meta_layout, meta=True))
            finally:
                destroy_model_parallel()
    return out


def _hf_logits(export, tokens, *, time_step_min=0.0):
    """transformers' NemotronHForCausalLM on Bridge's export; HF's dt clamp at
    ``time_step_min`` (Megatron has none) off by default."""
    import transformers

    from conversion.presets import hf_config

    model = transformers.NemotronHForCausalLM(hf_config("nemotron-h")).eval()
    state, experts = {}, {}
    for name, tensor in export.items():
        name = re.sub(r"^backbone\.", "model.", name)
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(up|down)_proj\.weight", name)
        if m:  # transformers stacks the routed experts: experts.{up,down}_proj [expert, out, in]
            experts.setdefault(f"{m[1]}.{m[3]}_proj", {})[int(m[2])] = tensor
        else:
            state[name] = tensor
    state.update({name: torch.stack([per[e] for e in sorted(per)]) for name, per in experts.items()})
    model.load_state_dict(state, strict=True)
    for module in model.modules():
        if hasattr(module, "time_step_min"):
            module.time_step_min = time_step_min
    with torch.no_grad():
        return model(tokens, use_cache=False).logits


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_spawned(_nemotron_h_worker, 2, str(tmp_path_factory.mktemp("nemotron_h_ckpt")), timeout_s=300)


def test_builds_tp1_tp2_and_meta(ranks):
    for out in ranks:
        shapes = out["shapes_tp2"]
        assert shapes[MIXER + "in_proj.weight"] == ((2 * 32 + 2 * 16 + 4, 64), "cpu")  # local [z x B C dt]
        assert shapes[MIXER + "conv1d_weight"] == ((32 + 2 * 16, 1, 4), "cpu")  # local [x B C]
        assert shapes[MIXER + "out_proj.weight"] == ((64, 32), "cpu")
        assert {MIXER + k for k in MAMBA_PARAMS} <= set(shapes)
    tp2 = ranks[0]["meta"]
    for r in (0, 1):  # a meta rank is the real rank, on the meta device
        assert {n: s for n, (s, _) in tp2[r].items()} == {n: s for n, (s, _) in ranks[r]["shapes_tp2"].items()}
        assert {d for _, d in tp2[r].values()} == {"meta"}
    tp2ep2 = ranks[1]["meta"]
    assert sorted(tp2ep2) == [0, 1, 2, 3]
    for shapes in tp2ep2.values():
        assert {d for _, d in shapes.values()} == {"meta"}
        experts = {n for n in shapes if ".local_experts." in n}
        assert len(experts) == 2 * 2  # 2 of 4 experts per EP rank, fc1 + fc2
        assert shapes[MIXER + "in_proj.weight"][0] == (100, 64)


def test_export_round_trips_through_load_at_tp2(ranks):
    tp1, tp2 = ranks[0]["export_tp1"], ranks[0]["export_tp2"]
    assert len(tp1) == 33 and all(n.startswith(("backbone.", "lm_head.")) for n in tp1)
    assert tp1.keys() == tp2.keys()
    for name in tp1:
        assert torch.equal(tp1[name], tp2[name]), name
    assert all(torch.equal(ranks[1]["export_tp2"][n], tp2[n]) for n in tp2)


def test_forward_matches_transformers_tp1_and_tp2(ranks):
    from conversion.presets import hf_config

    tokens = _tokens(hf_config("nemotron-h").vocab_size)
    reference = _hf_logits(ranks[0]["export_tp1"], tokens)
    scale = reference.abs().max()
    assert scale > 1.0  # order-one weights: a wrong mixer shows
    for key in ("logits_tp1", "logits_tp2"):
        for out in ranks:
            assert out[key].shape == reference.shape
            assert (out[key] - reference).abs().max() <= 1e-4 * scale, key
    # HF's dt clamp at 0.01 alone moves the logits over 10x that tolerance: the mixer counts
    clamped = _hf_logits(ranks[0]["export_tp1"], tokens, time_step_min=0.01)
    assert (clamped - reference).abs().max() > 10 * 1e-4 * scale


def test_train_step_updates_mamba_params(ranks):
    for out in ranks:
        assert out["loss"] is not None and torch.isfinite(torch.tensor(out["loss"]))
        assert all(g > 0 for g in out["mamba_grads"].values()), out["mamba_grads"]
    before, after = ranks[0]["export_tp2"], ranks[0]["export_stepped"]
    for name in ("in_proj.weight", "conv1d.weight", "A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
        hf = f"backbone.layers.0.mixer.{name}"
        assert not torch.equal(before[hf], after[hf]), hf
    assert all(torch.equal(ranks[1]["export_stepped"][n], after[n]) for n in after)  # TP ranks agree
