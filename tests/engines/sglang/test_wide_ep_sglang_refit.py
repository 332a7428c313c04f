"""megatron_refit into one wide expert-parallel SGLang 0.5.23 deployment on CPU (#64): ``--tp 4
--enable-dp-attention --dp 2 --ep-size 4 --enable-dp-lm-head`` (attention TP2 on each of two
attention-DP ranks, the routed experts over all four ranks), every rank a process of its own with
SGLang's distributed state over gloo and its real ``Qwen3MoeForCausalLM`` built by its dummy loader,
after the server's expert location (``ExpertLocationMetadata``, trivial) as ``ModelRunner`` sets it
(:mod:`.sglang_cpu`). Each rank joins through the loader's ``engine_refit_for``, which takes its rank
from SGLang's parallel state and holds each FusedMoE layer's slots to the plan's.

Train TP2 x EP2 ranks (Bridge's real local shards of 8 experts top-2 and 64 experts top-8, made in
``.venv`` by ``tests/engines/vllm/bridge_shards.py``) send two versions. After each refit every
engine rank's parameters must equal, bit for bit, what SGLang's own ``load_weights`` makes of
Bridge's export on a second model instance of the same deployment (both NaN-filled first: every
element must be written), and the bytes sent are the minimal ones (each expert to the one rank
that holds it, the attention shard to both attention-DP ranks of an attention-TP rank).
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
NUM_TRAIN = 2
TP, DP = 2, 2
"""The deployment: attention TP2 on each of DP2 attention-DP ranks, SGLang's ``--tp 4``."""
NUM_GEN = TP * DP
VERSIONS = (1, 2)
MODELS = ("qwen3-moe-e8", "qwen3-moe-e64")
CASES = (*MODELS, "qwen3-moe-e8:node")
"""``:node``: ``refit.gen_dense_forward: node``, the four ranks on one node (each attention-DP rank takes
half of its attention-TP rank's dense rows from the train ranks and forwards them to the other)."""


def _refit_section(port: int, case: str = "") -> dict:
    return dict(engine="sglang", gen_tp=TP, gen_dp=1, gen_attention_dp=DP, gen_expert_parallel=True, port=port,
                bucket_mb=0.25, timeout_s=120,
                **(dict(gen_dense_forward="node", gen_node_ranks=NUM_GEN) if case.endswith(":node") else {}))


def _gen(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.engines.sglang.worker.expert_location import check_expert_location
    from megatron_refit.engines.sglang.worker.loader import engine_refit_for
    from megatron_refit.plan.expert_placement import sglang_placement

    from .sglang_cpu import build_model, init_sglang, write_model_dir

    gen = rank - NUM_TRAIN
    dirs = {name: write_model_dir(model_config(name), os.path.join(workdir, f"{name}.gen{gen}")) for name in MODELS}
    init_sglang(NUM_GEN, gen, sglang_port, dirs[MODELS[0]], attention_dp=DP, ep_size=NUM_GEN)
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    results = dict(ranks=(parallel.tp_rank, parallel.attn_dp_rank, parallel.attn_tp_rank, parallel.moe_ep_rank))
    for n, case in enumerate(CASES):
        name = case.partition(":")[0]
        model, reference = build_model(dirs[name], expert_location=True), build_model(dirs[name], expert_location=True)
        with torch.no_grad():  # SGLang's dummy init is seeded: both would start equal. Every
            for param in (*model.parameters(), *reference.parameters()):  # element unwritten stays NaN
                param.fill_(float("nan"))
        experts = model.config.num_experts
        # SGLang's own placement, held to one the refit would plan from another map: refused by name
        swapped = list(range(experts))
        swapped[0], swapped[-1] = swapped[-1], swapped[0]
        try:
            check_expert_location(model, sglang_placement(num_logical_experts=experts, ep_size=NUM_GEN,
                                                           physical_to_logical=(tuple(swapped),)),
                                  gen, get_global_expert_location_metadata())
            moved = None
        except ValueError as exc:
            moved = str(exc)

        member = engine_refit_for(model, _refit_section(refit_ports[n], case), num_train=NUM_TRAIN, replica=0)
        checks = []
        for version in VERSIONS:
            report = member.receive(version).as_dict()
            reference.load_weights(iter(load(bridge_dir, name, version, 0)["export"].items()))
            mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
            checks.append(dict(names_equal=set(mine) == set(theirs), num_params=len(mine),
                               diff=sorted(p for p in mine if p in theirs and not torch.equal(mine[p], theirs[p])),
                               state=member.state, weights_version=member.full.weights_version,
                               bytes_received=report["bytes_received"]))
        member.close()
        w13 = [p.shape[0] for p_name, p in model.named_parameters() if p_name.endswith("w13_weight")]
        results[case] = dict(checks=checks, moved=moved, w13=w13)
    return results


def _train(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.refit import trainer_refit_from_pieces

    results = {}
    for n, case in enumerate(CASES):
        name = case.partition(":")[0]
        pieces = [TensorPiece(spec, tensor) for spec, tensor in load(bridge_dir, name, 1, rank)["weights"]]
        cfg = RefitConfig.from_dict({"enabled": True, **_refit_section(refit_ports[n], case)})
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        reports = []
        for version in VERSIONS:
            if version > 1:  # the next step's weights, in place of the old (as a live model's)
                for piece, (_, tensor) in zip(pieces, load(bridge_dir, name, version, rank)["weights"]):
                    piece.data = tensor
            reports.append(fleet.refit(version).as_dict())
        fleet.close()
        results[case] = reports
    return results


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _gen)(rank, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    from .sglang_cpu import saved_bridge_shards

    bridge = saved_bridge_shards(tmp_path_factory, *MODELS)
    ports = free_ports(1 + len(CASES))  # SGLang's group, one refit group per case
    return run_spawned(_rank, NUM_TRAIN + NUM_GEN, ports[0], ports[1:], bridge,
                       str(tmp_path_factory.mktemp("sglang-wide-ep")), timeout_s=300)


@pytest.mark.slow
def test_sglangs_attention_ranks_are_the_plans(refitted):
    """SGLang's ``tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank`` and ``moe_ep_rank = tp_rank``:
    the refit's deployment rank ``dp_rank * gen_tp + tp_rank``."""
    assert [out["ranks"] for out in refitted[NUM_TRAIN:]] == [(0, 0, 0, 0), (1, 0, 1, 1), (2, 1, 0, 2), (3, 1, 1, 3)]


@pytest.mark.slow
@pytest.mark.parametrize("name, experts", [("qwen3-moe-e8", 8), ("qwen3-moe-e64", 64)])
def test_wide_ep_refit_lands_in_sglangs_own_expert_slots(refitted, name, experts):
    gens = [out[name] for out in refitted[NUM_TRAIN:]]
    train = [out[name] for out in refitted[:NUM_TRAIN]]
    for gen, out in enumerate(gens):
        assert out["w13"] and set(out["w13"]) == {experts // NUM_GEN}  # SGLang's own EP split: whole experts
        if gen in (0, NUM_GEN - 1):  # the swapped experts live on the first and the last rank only
            assert f"holds logical experts [{gen * experts // NUM_GEN}, " in out["moved"]  # its first slot
            assert f"in deployment rank {gen}'s slots" in out["moved"]
        else:
            assert out["moved"] is None
    for i, version in enumerate(VERSIONS):
        for gen, out in enumerate(gens):
            check = out["checks"][i]
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (name, version, gen, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
        reports = [rank_reports[i] for rank_reports in train]
        sent = sum(report["bytes_sent"] for report in reports)
        assert sent == reports[0]["bytes_minimal"] > 0
        received = [out["checks"][i]["bytes_received"] for out in gens]
        # each rank: its attention shard (the same on both attention-DP ranks of a TP rank) and its experts only
        assert received[0] == received[2] and received[1] == received[3] and sum(received) == sent


@pytest.mark.slow
def test_dense_rows_forwarded_inside_a_node_land_bit_exact_in_sglangs_own_parameters(refitted):
    """``gen_dense_forward: node`` into SGLang's real DP-attention deployment: every element of every
    rank written, equal to SGLang's own load; the train ranks send the minimal of that plan, less
    than to the same deployment without forwarding."""
    gens = [out["qwen3-moe-e8:node"] for out in refitted[NUM_TRAIN:]]
    for i, version in enumerate(VERSIONS):
        for out in gens:
            check = out["checks"][i]
            assert check["names_equal"] and check["diff"] == [], (version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
        reports = [rank_out["qwen3-moe-e8:node"][i] for rank_out in refitted[:NUM_TRAIN]]
        direct = [rank_out["qwen3-moe-e8"][i] for rank_out in refitted[:NUM_TRAIN]]
        sent = sum(report["bytes_sent"] for report in reports)
        assert sent == reports[0]["bytes_minimal"] > 0
        assert sent < sum(report["bytes_sent"] for report in direct)
        assert sum(out["checks"][i]["bytes_received"] for out in gens) == sent
