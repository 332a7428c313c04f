"""SGLang's live expert map read into the plan's placement, without SGLang (#64): from the
``ExpertLocationMetadata`` in force (stand-ins of what the reader reads: ``ep_size``,
``physical_to_logical_map_cpu``), the rows of the model's FusedMoE layers in MoE layer order, every
refusal by name; SGLang's EPLB flags held to the ``refit:`` section; and the loader's wiring: the
layout's placement is the live one at connect, and the storage gets a reader that reads the map anew.
SGLang's real EPLB moving the map between two refits: tests/engines/sglang/test_wide_ep_eplb_sglang.py."""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_refit.config import RefitConfig
from megatron_refit.engines.sglang.worker.eplb_map import check_eplb_config, live_layout, live_placement
from megatron_refit.engines.sglang.worker.expert_location import check_expert_location
from megatron_refit.plan.expert_placement import ExpertPlacement, initial_map, sglang_placement, slots_of
from megatron_refit.plan.gen_layout import GenLayout

E, R, EP = 8, 4, 4
"""8 logical experts, 4 redundant: 12 physical slots, 3 on each of 4 ranks."""
TRIVIAL = initial_map(E, R)
MOVED = ((5, 0, 0, 1, 7, 2, 3, 6, 4, 1, 5, 7), (3, 3, 3, 2, 0, 6, 4, 1, 5, 7, 7, 2))
"""What a rebalance leaves at the model's two MoE layers: experts moved across ranks, replicas
swapped, one expert held three times on one rank."""


class _FusedMoE(torch.nn.Module):
    """SGLang's ``FusedMoE`` as the reader reads it."""

    def __init__(self, layer_id, ep_rank=0):
        super().__init__()
        self.layer_id, self.moe_ep_rank, self.moe_ep_size, self.num_experts = layer_id, ep_rank, EP, E + R
        self.num_local_experts = (E + R) // EP
        self.w13_weight = torch.nn.Parameter(torch.zeros(self.num_local_experts, 4, 2))


def _model(*layer_ids, ep_rank=0, dense=()):
    """Decoder layers: a FusedMoE at each of ``layer_ids``, a dense MLP at each of ``dense``."""
    model = torch.nn.Module()
    layers = {i: _FusedMoE(i, ep_rank) for i in layer_ids} | {i: torch.nn.Linear(2, 2) for i in dense}
    model.layers = torch.nn.ModuleList(layers[i] for i in sorted(layers))
    return model


def _metadata(rows, ep_size=EP):
    return SimpleNamespace(ep_size=ep_size, physical_to_logical_map_cpu=torch.tensor(rows))


PLANNED = sglang_placement(num_logical_experts=E, ep_size=EP, num_redundant=R)


def test_the_live_map_is_sglangs_rows_at_its_moe_layers_in_order():
    # decoder layers 0 and 2 are dense (SGLang keeps a row for them too), 1 and 3 hold routed experts
    rows = [TRIVIAL, MOVED[0], tuple(reversed(TRIVIAL)), MOVED[1]]
    live = live_placement(_model(1, 3, dense=(0, 2)), _metadata(rows), PLANNED)
    assert live == sglang_placement(num_logical_experts=E, ep_size=EP, num_redundant=R, physical_to_logical=MOVED)
    assert live.layer_map(0) != TRIVIAL  # not the connect-time (trivial) map: the one SGLang serves
    # MoE layer 1 (decoder layer 3): rank 0 holds logical expert 3 in all three of its slots
    assert slots_of(live, 0, 1) == ((0, 3), (1, 3), (2, 3))
    # the check at connect holds each FusedMoE (by its decoder layer id) to that placement's MoE layer
    assert check_expert_location(_model(1, 3, ep_rank=2, dense=(0, 2)), live, 2, _metadata(rows)) == 2
    with pytest.raises(ValueError, match=r"layers\.1: SGLang's expert location holds logical experts \[1, 7, 2\] "
                                         r"in deployment rank 1's slots 3\.\.5, the refit plans \[3, 4, 5\]"):
        check_expert_location(_model(1, 3, ep_rank=1, dense=(0, 2)), PLANNED, 1, _metadata(rows))


def test_one_row_stands_for_the_layers_it_is_read_at():
    live = live_placement(_model(0), _metadata([MOVED[0], MOVED[1]]), PLANNED)
    assert live.physical_to_logical == (MOVED[0],)


@pytest.mark.parametrize("metadata, match", [
    (None, r"SGLang holds no ExpertLocationMetadata \(get_global_expert_location_metadata\(\) is None\): the engine "
           r"cannot report its expert map"),
    (_metadata([TRIVIAL] * 2, ep_size=2), r"SGLang's ExpertLocationMetadata spreads the experts over ep_size=2, the "
                                          r"refit plans 12 slots over EP4, 4 redundant experts"),
    (SimpleNamespace(ep_size=EP), r"physical_to_logical_map_cpu is NoneType: not an integer \[layers, physical "
                                  r"slots\] map"),
    (SimpleNamespace(ep_size=EP, physical_to_logical_map_cpu=torch.tensor(TRIVIAL)),
     r"physical_to_logical_map_cpu is \(12,\): not an integer"),
    (SimpleNamespace(ep_size=EP, physical_to_logical_map_cpu=torch.zeros(2, 12)), r"is \(2, 12\): not an integer"),
    (_metadata([initial_map(E, 0)] * 2), r"SGLang's expert map holds 8 physical slots per layer, the refit plans 8 "
                                         r"experts \+ 4 redundant \(refit.gen_redundant_experts, "
                                         r"--ep-num-redundant-experts\)"),
    (_metadata([TRIVIAL]), r"SGLang's expert map has 1 layer rows, the model's FusedMoE layers are decoder layers "
                           r"0\.\.1"),
    (_metadata([TRIVIAL, (0,) * 12]), r"SGLang's expert map is no placement of the plan's slots \(MoE layer i: "
                                      r"decoder layer \[0, 1\]\[i\]\): physical_to_logical\[1\] holds no replica of "
                                      r"logical expert 1"),
    (_metadata([TRIVIAL, (8,) + TRIVIAL[1:]]), r"physical_to_logical\[1\]\[0\] = 8 is not a logical expert of 8"),
])
def test_a_map_the_reader_cannot_read_is_refused_by_name(metadata, match):
    with pytest.raises(ValueError, match=match):
        live_placement(_model(0, 1), metadata, PLANNED)


def test_a_model_without_fused_moe_is_named():
    with pytest.raises(ValueError, match=r"the SGLang model has no FusedMoE layer"):
        live_placement(_model(dense=(0,)), _metadata([TRIVIAL]), PLANNED)


def test_the_layout_holds_the_live_map_and_its_reader_reads_it_anew():
    metadata = _metadata([TRIVIAL, TRIVIAL])
    layout = GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=PLANNED)
    live, read = live_layout(_model(0, 1), layout, E, lambda: metadata)
    assert live == GenLayout(tp=2, attention_dp=2, expert_parallel=True, placement=sglang_placement(
        num_logical_experts=E, ep_size=EP, num_redundant=R, physical_to_logical=(TRIVIAL, TRIVIAL)))
    assert read() == live.placement
    # SGLang's ExpertLocationMetadata.update writes the rebalanced rows in place
    metadata.physical_to_logical_map_cpu[...] = torch.tensor(MOVED)
    assert read().physical_to_logical == MOVED
    metadata.physical_to_logical_map_cpu[1, 0] = 99
    with pytest.raises(ValueError, match=r"physical_to_logical\[1\]\[0\] = 99 is not a logical expert"):
        read()
    # EPLB over gen_tp ranks alone (no attention DP, no redundant experts): the layout kept no placement
    plain = GenLayout(tp=4, expert_parallel=True)
    moved = _metadata([[1, 0, *range(2, E)]] * 2)
    live, _ = live_layout(_model(0, 1), plain, E, lambda: moved)
    assert live.placement == ExpertPlacement(num_logical_experts=E, ep_size=4,
                                             physical_to_logical=((1, 0, *range(2, E)),) * 2)


def _cfg(**kw):
    return RefitConfig.from_dict({"enabled": True, "engine": "sglang", "gen_tp": 2, "gen_attention_dp": 2,
                                  "gen_expert_parallel": True, **kw})


def _moe(**kw):
    """SGLang's ``get_exec().moe`` as the check reads it."""
    return SimpleNamespace(**{"enable_eplb": False, "ep_num_redundant_experts": 0, "elastic_ep_backend": None, **kw})


@pytest.mark.parametrize("cfg, moe, match", [
    ({}, _moe(enable_eplb=True), r"refit.gen_eplb is false, but this SGLang engine runs --enable-eplb: EPLB moves "
                                 r"experts .* set gen_eplb: true"),
    (dict(gen_eplb=True), _moe(), r"refit.gen_eplb is true, but this SGLang engine runs without --enable-eplb"),
    (dict(gen_redundant_experts=4), _moe(), r"refit.gen_redundant_experts=4, but this SGLang engine runs "
                                            r"--ep-num-redundant-experts 0"),
    ({}, _moe(ep_num_redundant_experts=4), r"refit.gen_redundant_experts=0, but .* --ep-num-redundant-experts 4"),
    (dict(gen_eplb=True), _moe(enable_eplb=True, elastic_ep_backend="mooncake"),
     r"refit.gen_eplb: this SGLang engine runs elastic EP \(--elastic-ep-backend mooncake\): .* not planned"),
    (dict(gen_eplb=True, gen_draft=True), _moe(enable_eplb=True),
     r"refit.gen_draft with refit.gen_eplb: SGLang's draft MoE layers lie past the target's expert map"),
    (dict(gen_redundant_experts=4, gen_draft=True), _moe(ep_num_redundant_experts=4),
     r"refit.gen_draft with refit.gen_redundant_experts: SGLang's draft MoE layers lie past"),
])
def test_sglangs_eplb_flags_the_section_does_not_describe_are_refused(cfg, moe, match):
    with pytest.raises(ValueError, match=match):
        check_eplb_config(_cfg(**cfg), moe)


def test_sglangs_eplb_flags_the_section_describes_are_accepted():
    check_eplb_config(_cfg(), _moe())
    check_eplb_config(_cfg(gen_redundant_experts=4), _moe(ep_num_redundant_experts=4))  # a static map
    check_eplb_config(_cfg(gen_eplb=True, gen_redundant_experts=4), _moe(enable_eplb=True, ep_num_redundant_experts=4))
    check_eplb_config(_cfg(gen_draft=True), _moe(elastic_ep_backend="nixl"))  # no EPLB: nothing moves


def _sglang_standins(monkeypatch, *, tp_rank, metadata, **moe):
    """``sglang.srt.runtime_context`` (``get_exec``, ``get_parallel``) and ``sglang.srt.eplb.expert_location``
    (``get_global_expert_location_metadata``) as the loader reads them, in place of SGLang."""
    parallel = SimpleNamespace(tp_size=4, tp_rank=tp_rank, attn_dp_size=2, attn_tp_size=2, attn_cp_size=1,
                               attn_dp_rank=tp_rank // 2, attn_tp_rank=tp_rank % 2, moe_ep_size=4,
                               moe_ep_rank=tp_rank, enable_dp_lm_head=True)
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_exec = lambda: SimpleNamespace(moe=_moe(**moe))
    context.get_parallel = lambda: parallel
    location = types.ModuleType("sglang.srt.eplb.expert_location")
    location.get_global_expert_location_metadata = lambda: metadata
    for name in ("sglang", "sglang.srt", "sglang.srt.eplb"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    monkeypatch.setitem(sys.modules, "sglang.srt.eplb.expert_location", location)


def _qwen3_moe(tp_rank):
    from transformers import Qwen3MoeConfig

    model = _model(0, 1, ep_rank=tp_rank)
    model.config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  num_experts=E, num_experts_per_tok=2, architectures=["Qwen3MoeForCausalLM"])
    return model


def test_the_loader_plans_the_live_map_and_hands_the_storage_its_reader(monkeypatch):
    """``engine_refit_for`` under ``gen_eplb`` with 4 redundant experts, SGLang and the refit group
    stood in: the storage is built for the map SGLang serves at connect (not the trivial one), with
    a reader that follows SGLang's metadata; a map the section does not describe is refused before
    the storage is built."""
    from megatron_refit.engine_side import entry
    from megatron_refit.engines.fused.live import LiveModelStorage
    from megatron_refit.engines.sglang.worker.loader import engine_refit_for

    built = []
    monkeypatch.setattr(LiveModelStorage, "for_model", classmethod(lambda cls, *a, **kw: built.append((a, kw))))
    monkeypatch.setattr(entry, "engine_refit", lambda cfg, storage, **kw: ("member", kw["gen_index"]))
    section = {"gen_tp": 2, "gen_attention_dp": 2, "gen_expert_parallel": True, "gen_eplb": True,
               "gen_redundant_experts": R}
    metadata = _metadata([MOVED[0], MOVED[1]])
    _sglang_standins(monkeypatch, tp_rank=2, metadata=metadata, enable_eplb=True, ep_num_redundant_experts=R)
    assert engine_refit_for(_qwen3_moe(2), section, num_train=2, replica=1) == ("member", 6)
    layout, kw = built[0][0][2], built[0][1]
    assert layout.placement.physical_to_logical == MOVED and layout.placement.num_redundant == R
    assert kw["gen_index"] == 2 and kw["live_map"]() == layout.placement
    metadata.physical_to_logical_map_cpu[...] = torch.tensor([TRIVIAL, TRIVIAL])  # EPLB moved it back
    assert kw["live_map"]().physical_to_logical == (TRIVIAL, TRIVIAL)

    # SGLang's map holds no redundant slot, the section plans 4: refused where the storage would be built
    _sglang_standins(monkeypatch, tp_rank=2, metadata=_metadata([initial_map(E, 0)] * 2), enable_eplb=True,
                     ep_num_redundant_experts=R)
    with pytest.raises(ValueError, match=r"SGLang's expert map holds 8 physical slots per layer"):
        engine_refit_for(_qwen3_moe(2), section, num_train=2)
    # SGLang runs EPLB, the section does not say so: refused before anything is read
    _sglang_standins(monkeypatch, tp_rank=2, metadata=None, enable_eplb=True)
    with pytest.raises(ValueError, match=r"refit.gen_eplb is false, but this SGLang engine runs --enable-eplb"):
        engine_refit_for(_qwen3_moe(2), {**section, "gen_eplb": False, "gen_redundant_experts": 0}, num_train=2)
    assert len(built) == 1
    # without EPLB or redundant experts the layout keeps the plan's own map and no reader
    _sglang_standins(monkeypatch, tp_rank=2, metadata=_metadata([initial_map(E, 0)] * 2))
    engine_refit_for(_qwen3_moe_plain(2), {**section, "gen_eplb": False, "gen_redundant_experts": 0}, num_train=2)
    assert built[-1][1]["live_map"] is None and built[-1][0][2].placement == sglang_placement(num_logical_experts=E,
                                                                                              ep_size=EP)


def _qwen3_moe_plain(tp_rank):
    """:func:`_qwen3_moe` with FusedMoE layers of 8 slots (no redundant experts)."""
    model = _qwen3_moe(tp_rank)
    for module in model.layers:
        module.num_experts, module.num_local_experts = E, E // EP
        module.w13_weight = torch.nn.Parameter(torch.zeros(E // EP, 4, 2))
    return model
