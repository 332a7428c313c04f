"""megatron_refit into a wide expert-parallel SGLang 0.5.23 deployment whose EPLB moves the experts
between two refits (#64): ``--tp 4 --enable-dp-attention --dp 2 --ep-size 4 --enable-dp-lm-head
--ep-num-redundant-experts 4 --enable-eplb`` of Qwen3-MoE with 8 experts top-2 (12 physical slots, 3 on
each rank), every rank a process of its own with SGLang's distributed state over gloo and its real
``Qwen3MoeForCausalLM`` (:mod:`.sglang_cpu`). Each rank joins through the loader's ``engine_refit_for``
under ``gen_eplb`` with ``gen_redundant_experts: 4``: it plans the map SGLang serves and reads it again
at every refit (:mod:`megatron_refit.engines.sglang.worker.eplb_map`).

Train TP2 x EP2 ranks (Bridge's real local shards, made in ``.venv`` by
``tests/engines/vllm/bridge_shards.py``) send two versions. Refit 1 lands at SGLang's initial (trivial)
map. Then SGLang's own EPLB path moves the experts as a rebalance spread over two forward passes
(``--eplb-rebalance-layers-per-chunk 1``) does: ``ExpertLocationUpdater.update`` of a map made by
``ExpertLocationMetadata.init_by_mapping``, layer 0 first (its weights moved between the ranks over
SGLang's own group, then its row of the global metadata updated in place), with every slot it moved
scrambled to NaN afterwards. Refit 2 lands between the two chunks: it must equal, bit for bit on every
rank, what SGLang's own ``load_weights`` makes of Bridge's export under the map in force (its
``FusedMoE.weight_loader`` writes every local replica of each expert), with the bytes sent the minimal
ones. Then SGLang moves layer 1 (the rebalance's second chunk): the refit's bytes are what it moves,
and the model again equals ``load_weights`` of version 2 under the final map.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
BRIDGE_SHARDS = ROOT / "tests" / "engines" / "vllm" / "bridge_shards.py"
NAME = "qwen3-moe-e8"
NUM_TRAIN = 2
TP, DP = 2, 2
"""The deployment: attention TP2 on each of DP2 attention-DP ranks, SGLang's ``--tp 4``."""
NUM_GEN = TP * DP
E, R = 8, 4
"""8 logical experts, 4 redundant: 12 physical slots, 3 on each of the 4 ranks (SGLang needs
``(E + R) % ep_size == 0``)."""
TRIVIAL = [p % E for p in range(E + R)]
MOVED = ([7, 7, 0, 5, 1, 2, 3, 6, 4, 0, 5, 1],  # layer 0: expert 7 twice on rank 0, 3/4/6 to rank 2
         [4, 3, 2, 6, 6, 6, 0, 1, 5, 7, 3, 2])  # layer 1: expert 6 in all three slots of rank 1
"""The map the rebalance leaves, per decoder layer (both layers hold routed experts)."""


def _refit_section(port: int) -> dict:
    return dict(engine="sglang", gen_tp=TP, gen_dp=1, gen_attention_dp=DP, gen_expert_parallel=True,
                gen_redundant_experts=R, gen_eplb=True, port=port, bucket_mb=0.25, timeout_s=120)


def _compare(model, reference) -> dict:
    mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    return dict(names_equal=set(mine) == set(theirs), num_params=len(mine),
                diff=sorted(p for p in mine if p in theirs and not torch.equal(mine[p], theirs[p])))


def _scramble(*models) -> None:
    with torch.no_grad():  # every element SGLang's loader (or the refit) does not write stays NaN
        for model in models:
            for param in model.parameters():
                param.fill_(float("nan"))


def _rebalance_chunk(model, model_config, layer: int, gen: int, *, scramble: bool) -> list[int]:
    """One chunk of SGLang's EPLB rebalance towards :data:`MOVED` (layer ``layer``), as
    ``EPLBManager.rebalance`` runs it (``update_expert_location_with_recovery``): the updater moves the
    weights over SGLang's world group, then writes the layer's row of the global metadata in place.
    ``scramble``: then the slots it moved on this rank are set to NaN (one a refit leaves unwritten
    must show). The local indices of the slots it moved."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, get_global_expert_location_metadata
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    before = get_global_expert_location_metadata().physical_to_logical_map_cpu[layer].tolist()
    target = ExpertLocationMetadata.init_by_mapping(model_config, physical_to_logical_map=[list(r) for r in MOVED],
                                                    moe_ep_rank=gen)
    ExpertLocationUpdater().update(model.routed_experts_weights_of_layer, target, update_layer_ids=[layer], nnodes=1,
                                   rank=gen)
    after = get_global_expert_location_metadata().physical_to_logical_map_cpu[layer].tolist()
    assert after == MOVED[layer], after
    local = (E + R) // NUM_GEN
    moved = [p - gen * local for p in range(gen * local, (gen + 1) * local) if before[p] != after[p]]
    if scramble:
        with torch.no_grad():
            for weight in model.routed_experts_weights_of_layer[layer]:
                weight[moved] = float("nan")
    return moved


def _moves(member) -> tuple[int, int]:
    """How often this rank's storage found SGLang's map moved, and its refit group re-planned for it."""
    return member.full.storage.experts_moved, member.full.replans


def _gen(rank, sglang_port, refit_port, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.engines.sglang.worker.loader import engine_refit_for

    from .sglang_cpu import build_model, init_sglang, write_model_dir

    gen = rank - NUM_TRAIN
    model_dir = write_model_dir(model_config(NAME), os.path.join(workdir, f"{NAME}.gen{gen}"))
    init_sglang(NUM_GEN, gen, sglang_port, model_dir, attention_dp=DP, ep_size=NUM_GEN,
                ep_num_redundant_experts=R, enable_eplb=True, eplb_rebalance_layers_per_chunk=1)
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    model, reference = build_model(model_dir, expert_location=True), build_model(model_dir, expert_location=True)
    _scramble(model, reference)
    metadata = get_global_expert_location_metadata()
    out = dict(initial=metadata.physical_to_logical_map_cpu.tolist(),
               w13=[p.shape[0] for n, p in model.named_parameters() if n.endswith("w13_weight")])
    member = engine_refit_for(model, _refit_section(refit_port), num_train=NUM_TRAIN, replica=0)

    report = member.receive(1).as_dict()
    reference.load_weights(iter(load(bridge_dir, NAME, 1, 0)["export"].items()))
    out["v1"] = dict(_compare(model, reference), state=member.state, weights_version=member.full.weights_version,
                     bytes_received=report["bytes_received"], moves=_moves(member))

    config = ModelConfig(model_dir, dtype="float32")
    out["moved0"] = _rebalance_chunk(model, config, 0, gen, scramble=True)  # the rebalance's first chunk, a refit
    report = member.receive(2).as_dict()
    _scramble(reference)
    reference.load_weights(iter(load(bridge_dir, NAME, 2, 0)["export"].items()))
    out["v2"] = dict(_compare(model, reference), state=member.state, weights_version=member.full.weights_version,
                     bytes_received=report["bytes_received"], map=metadata.physical_to_logical_map_cpu.tolist(),
                     moves=_moves(member))

    out["moved1"] = _rebalance_chunk(model, config, 1, gen, scramble=False)  # it moves the refit's bytes
    _scramble(reference)
    reference.load_weights(iter(load(bridge_dir, NAME, 2, 0)["export"].items()))
    out["after"] = dict(_compare(model, reference), map=metadata.physical_to_logical_map_cpu.tolist())
    member.close()
    return out


def _train(rank, sglang_port, refit_port, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.refit import trainer_refit_from_pieces

    pieces = [TensorPiece(spec, tensor) for spec, tensor in load(bridge_dir, NAME, 1, rank)["weights"]]
    cfg = RefitConfig.from_dict({"enabled": True, **_refit_section(refit_port)})
    fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
    reports = [fleet.refit(1).as_dict()]
    for piece, (_, tensor) in zip(pieces, load(bridge_dir, NAME, 2, rank)["weights"], strict=True):
        piece.data = tensor  # the next step's weights, in place of the old (as a live model's)
    reports.append(fleet.refit(2).as_dict())
    fleet.close()
    return reports


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _gen)(rank, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    from .sglang_cpu import saved_bridge_shards

    bridge = saved_bridge_shards(tmp_path_factory, NAME)
    sglang_port, refit_port = free_ports(2)
    return run_spawned(_rank, NUM_TRAIN + NUM_GEN, sglang_port, refit_port, bridge,
                       str(tmp_path_factory.mktemp("sglang-eplb")), timeout_s=300)


@pytest.mark.slow
def test_the_first_refit_lands_in_sglangs_initial_map_with_its_redundant_experts(refitted):
    gens, train = refitted[NUM_TRAIN:], refitted[:NUM_TRAIN]
    for out in gens:
        assert out["initial"] == [TRIVIAL, TRIVIAL]  # SGLang's init_trivial: slot p holds p % E
        assert out["w13"] == [(E + R) // NUM_GEN] * 2
        check = out["v1"]
        assert check["names_equal"] and check["num_params"] > 0 and check["diff"] == [], check["diff"][:5]
        assert check["state"] == "ready" and check["weights_version"] == 1 and check["moves"] == (0, 0)
    sent = sum(report["bytes_sent"] for report in (t[0] for t in train))
    assert sent == train[0][0]["bytes_minimal"] == sum(out["v1"]["bytes_received"] for out in gens) > 0


@pytest.mark.slow
def test_a_refit_between_two_chunks_of_an_eplb_rebalance_lands_in_the_moved_map(refitted):
    gens, train = refitted[NUM_TRAIN:], refitted[:NUM_TRAIN]
    assert [out["moved0"] for out in gens] == [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2]]  # every slot moved
    for gen, out in enumerate(gens):
        check = out["v2"]
        assert check["map"] == [MOVED[0], TRIVIAL]  # layer 0 moved, layer 1 not yet
        assert check["names_equal"] and check["diff"] == [], (gen, check["diff"][:5])
        assert check["state"] == "ready" and check["weights_version"] == 2
        assert check["moves"] == (1, 1)  # SGLang's map read at the refit's start, the group re-planned once
    reports = [t[1] for t in train]
    sent = sum(report["bytes_sent"] for report in reports)
    assert sent == reports[0]["bytes_minimal"] == sum(out["v2"]["bytes_received"] for out in gens) > 0
    # the moved map holds fewer expert copies per rank than the trivial one (rank 0: 7 twice; layer 0)
    assert sent < sum(report["bytes_sent"] for report in (t[0] for t in train))


@pytest.mark.slow
def test_the_rebalances_later_chunk_moves_the_refits_bytes(refitted):
    for gen, out in enumerate(refitted[NUM_TRAIN:]):
        assert out["after"]["map"] == list(MOVED)
        assert out["moved1"], gen
        assert out["after"]["diff"] == [], (gen, out["after"]["diff"][:5])
