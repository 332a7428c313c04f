"""vLLM's fused parameter layout, checked against hand-written expectations of vLLM's
weight loaders (QKVParallelLinear, MergedColumnParallelLinear, FusedMoE, vocab padding)."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.plan.gen_layout import GenLayout, ModelShape, gen_target_specs
from megatron_refit.engines.fused.live import LiveModelStorage, resolve_names
from megatron_refit.engines.fused.layout import FusedLayoutStorage, expected_storage, fused_layout

H, HD, HEADS, KV, FFN, E, MI, V = 16, 4, 4, 2, 16, 4, 8, 100
SHAPE = ModelShape(num_attention_heads=HEADS, num_kv_heads=KV, vocab_size=V, num_experts=E)


def _params():
    p = {
        "model.embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "model.norm.weight": (H,),
        "model.layers.0.self_attn.q_proj.weight": (HEADS * HD, H),
        "model.layers.0.self_attn.k_proj.weight": (KV * HD, H),
        "model.layers.0.self_attn.v_proj.weight": (KV * HD, H),
        "model.layers.0.self_attn.o_proj.weight": (H, HEADS * HD),
        "model.layers.0.mlp.gate_proj.weight": (FFN, H),
        "model.layers.0.mlp.up_proj.weight": (FFN, H),
        "model.layers.0.mlp.down_proj.weight": (H, FFN),
        "model.layers.1.mlp.gate.weight": (E, H),
    }
    for e in range(E):
        p[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] = (MI, H)
        p[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] = (MI, H)
        p[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] = (H, MI)
    return {n: (s, "float32") for n, s in p.items()}


def _full():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, (s, _) in _params().items()}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fused_storage_matches_vllm_loader_semantics(tp):
    full = _full()
    specs = gen_target_specs(_params(), GenLayout(tp=tp), SHAPE, style="vllm")
    for r in range(tp):
        got = expected_storage(full, specs[r], SHAPE, tp)
        q, k, v = (full[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
        qr = HEADS * HD // tp
        kv_head = r // (tp // KV) if tp > KV else None
        kr = HD if tp > KV else KV * HD // tp
        ks = kv_head * HD if tp > KV else r * kr
        want_qkv = torch.cat([q[r * qr:(r + 1) * qr], k[ks:ks + kr], v[ks:ks + kr]])
        assert torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"], want_qkv)
        f = FFN // tp
        gate, up = full["model.layers.0.mlp.gate_proj.weight"], full["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(got["model.layers.0.mlp.gate_up_proj.weight"],
                           torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]]))
        o = full["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(got["model.layers.0.self_attn.o_proj.weight"], o[:, r * qr:(r + 1) * qr])
        m = MI // tp
        w13 = torch.stack([torch.cat([full[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"][r * m:(r + 1) * m],
                                      full[f"model.layers.1.mlp.experts.{e}.up_proj.weight"][r * m:(r + 1) * m]])
                           for e in range(E)])
        assert torch.equal(got["model.layers.1.mlp.experts.w13_weight"], w13)
        w2 = torch.stack([full[f"model.layers.1.mlp.experts.{e}.down_proj.weight"][:, r * m:(r + 1) * m]
                          for e in range(E)])
        assert torch.equal(got["model.layers.1.mlp.experts.w2_weight"], w2)
        # vocab: padded to 128 rows (multiple of 64), per rank 128/tp, HF rows first, zeros after
        emb = got["model.embed_tokens.weight"]
        per = 128 // tp
        assert emb.shape == (per, H)
        rows = max(0, min(per, V - r * per))
        assert torch.equal(emb[:rows], full["model.embed_tokens.weight"][r * per:r * per + rows])
        assert not emb[rows:].any()
        assert torch.equal(got["model.layers.1.mlp.gate.weight"], full["model.layers.1.mlp.gate.weight"])


def test_receiver_views_write_engine_storage_in_place():
    specs = gen_target_specs(_params(), GenLayout(tp=2), SHAPE, style="vllm")[1]
    recv = FusedLayoutStorage.allocate(_params(), GenLayout(tp=2), SHAPE, gen_index=1)
    full = _full()
    for s in specs:
        recv.buffer(s.name).copy_(full[s.name][tuple(slice(a, b) for a, b in s.box)])
    want = expected_storage(full, specs, SHAPE, 2)
    got = recv.storage()
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in got)


def test_engine_receiver_resolves_routed_expert_spelling_and_checks_shapes():
    specs = gen_target_specs(_params(), GenLayout(tp=2), SHAPE, style="vllm")[0]
    shapes, _ = fused_layout(specs, SHAPE, 2)
    params = {name.replace(".experts.w", ".experts.routed_experts.w"): torch.nn.Parameter(torch.zeros(shape))
              for name, (shape, _) in shapes.items()}
    resolved = resolve_names(shapes, params)
    assert resolved["model.layers.1.mlp.experts.w13_weight"].data_ptr() == \
        params["model.layers.1.mlp.experts.routed_experts.w13_weight"].data_ptr()
    with pytest.raises(ValueError, match="no parameter for"):
        resolve_names(shapes, {})


def test_engine_receiver_refuses_dtype_mismatch():
    specs = gen_target_specs(_params(), GenLayout(tp=1), SHAPE, style="vllm")[0]
    shapes, _ = fused_layout(specs, SHAPE, 1)

    class Fake(torch.nn.Module):
        def named_parameters(self, *a, **k):
            return iter((n, torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16))) for n, (s, _) in shapes.items())

    with pytest.raises(ValueError, match="is torch.bfloat16 at construction, the trainer sends float32"):
        LiveModelStorage(Fake(), specs, SHAPE, 1)


def test_engine_receiver_follows_reallocated_parameters_and_refuses_reshaped_ones():
    """What a reload / sleep-wake / ``model.to`` does to an engine: new storage for its
    parameters. Writes must land in the live storage, never the old one."""
    specs = gen_target_specs(_params(), GenLayout(tp=1), SHAPE, style="vllm")[0]
    shapes, placements = fused_layout(specs, SHAPE, 1)

    class Engine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.live = {n: torch.nn.Parameter(torch.zeros(s)) for n, (s, _) in shapes.items()}

        def named_parameters(self, *a, **k):
            return iter(self.live.items())

    engine = Engine()
    receiver = LiveModelStorage(engine, specs, SHAPE, 1)
    assert receiver.refresh_targets() is False and receiver.rebinds == 0
    piece = next(p for p in specs if p.name.endswith("self_attn.k_proj.weight"))
    fused = placements[piece.name].vllm_name
    engine.live[fused] = torch.nn.Parameter(torch.zeros(shapes[fused][0]))  # re-allocated
    assert receiver.refresh_targets() is True and receiver.rebinds == 1
    receiver.buffer(piece.name).fill_(3.0)
    assert engine.live[fused].data[placements[piece.name].index].eq(3.0).all()
    engine.live[fused] = torch.nn.Parameter(torch.empty(0))  # re-packed by a post-load step
    with pytest.raises(ValueError, match=rf"engine parameter {fused} has shape \(0,\) now .* cannot write in place"):
        receiver.refresh_targets()


def test_sglang_post_load_calls_the_models_hook_when_it_has_one():
    from megatron_refit.engines.sglang.worker.loader import sglang_post_load

    class WithHook(torch.nn.Module):
        calls = 0

        def post_load_weights(self):
            self.calls += 1

    model = WithHook()
    sglang_post_load(model)()
    assert model.calls == 1
    sglang_post_load(torch.nn.Linear(2, 2))()  # no hook: nothing to do
