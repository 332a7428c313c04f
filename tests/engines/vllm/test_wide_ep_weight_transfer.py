"""megatron_refit into one wide expert-parallel vLLM 0.33 deployment on CPU (#64): ``--data-parallel-size 2
--tensor-parallel-size 2 --enable-expert-parallel`` (EP4), every rank a process of its own (vLLM's
``external_launcher``, gloo), vLLM's real ``Worker`` holding our weight-transfer engine as in
test_weight_transfer.py. vLLM's own FusedMoE layers computed each rank's ``expert_map``; the worker
checks it against the plan's and receives into it.

Train TP2 x EP2 ranks (Bridge's real local shards of 8 experts top-2 and 64 experts top-8, made in
``.venv``) send through vLLM's trainer contract, train rank 0 driving the deployment through a
:class:`~megatron_refit.engines.vllm.trainer.deployment_client.DeploymentClient` of one client per
DP rank (as one server per DP rank would be driven). After every refit each engine rank's parameters
must equal, bit for bit, what vLLM's own ``load_weights`` makes of Bridge's export on a second model
instance of the same deployment (its expert map), and the bytes sent are the minimal ones (each
expert to the one rank that holds it, the attention shard to both data-parallel ranks of a TP rank).

EP on CPU fails upstream at the forward (vLLM issue #57837: no ``all_gatherv`` in
``CpuCommunicator``), so a running ``vllm serve --data-parallel-size 2`` of a MoE model is not
checked here; it needs two GPUs (a DP rank each), more than ``make gpu-check``'s one.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")

from tests.engines.vllm.test_weight_transfer import (HERE, NUM_TRAIN, VERSIONS, _Engine, _init_vllm,  # noqa: E402
                                                     _pieces, _QueueClient, _vllm_config, serve_calls, spawn_deployment)

TP, DP = 2, 2
CASES = {"qwen3-moe-e8": True, "qwen3-moe-e64": True, "qwen3-moe-e8:moe-tp": False, "qwen3-moe-e64:node": True}
"""Case -> expert parallelism; ``:moe-tp``: without it, vLLM shards each expert tensor-parallel over
all D x T ranks (``FusedMoEParallelConfig``'s flattened TP); ``:node``: the four ranks on one node,
``refit.gen_dense_forward: node`` (each DP rank takes half of its TP rank's dense rows, forwards them)."""
MODELS = ("qwen3-moe-e8", "qwen3-moe-e64")  # made by bridge_shards.py


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    """Engine rank ``rank - NUM_TRAIN`` of the deployment: its rank in vLLM's DP x TP world."""
    sys.path.insert(0, str(HERE))
    gen = rank - NUM_TRAIN
    os.environ.update(RANK=str(gen), LOCAL_RANK=str(gen), WORLD_SIZE=str(TP * DP))  # external_launcher
    _init_vllm(TP, gen, vllm_port, _vllm_config(MODELS[0], TP, os.path.join(workdir, "x"), False, dp=DP), dp=DP)
    def engine(case: str) -> _Engine:
        return _Engine(case, case.partition(":")[0], TP, gen, workdir, bridge_dir, dp=DP, ep=CASES[case])

    serve_calls(requests[gen], replies[gen], engine)


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    sys.path.insert(0, str(HERE))
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from bridge_shards import load
    from megatron_refit.engines.vllm.trainer.deployment_client import DeploymentClient
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    load_general_plugins()
    gens = list(range(world - NUM_TRAIN))
    results = {}
    for n, case in enumerate(CASES):
        model = case.partition(":")[0]
        every = _QueueClient(requests, replies, gens, case)  # the test's own calls (build, check)
        # the trainer drives the deployment as a vLLM server per DP rank (external load balancing)
        client = DeploymentClient([_QueueClient(requests, replies, gens[r * TP:(r + 1) * TP], case) for r in range(DP)])
        if rank == 0:
            every.call("case")
        saved = load(bridge_dir, model, 1, rank)
        weights = _pieces(saved["weights"])
        refit = dict(gen_tp=TP, gen_dp=1, gen_attention_dp=DP, gen_expert_parallel=CASES[case], port=refit_ports[n],
                     bucket_mb=0.25, timeout_s=120,
                     **(dict(gen_dense_forward="node", gen_node_ranks=TP * DP) if case.endswith(":node") else {}))
        engine = WeightTransferTrainerFactory.trainer_init(
            MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank), client=client,
            source=LocalShardSource(weights))
        out = []
        for version in VERSIONS:
            if version > 1:
                for piece, (_, t) in zip(weights, load(bridge_dir, model, version, rank)["weights"]):
                    piece.data = t
            report = engine.send_weights()
            out.append(dict(report=report.as_dict(), checks=every.call("check", version=version) if rank == 0
                            else None))
        engine.shutdown()
        results[case] = out
    if rank == 0:
        for g in gens:
            requests[g].put((-1, "stop", {}))
    return results


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _serve)(rank, world, port, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    return spawn_deployment(tmp_path_factory, _rank, MODELS, num_gen=TP * DP, num_ports=len(CASES))


@pytest.mark.slow
@pytest.mark.parametrize("case, experts", [("qwen3-moe-e8", 8), ("qwen3-moe-e64", 64)])
def test_wide_ep_refit_lands_in_vllms_own_expert_slots(refitted, case, experts):
    train = [rank_out[case] for rank_out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == TP * DP
        for check in checks:
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (case, version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["w13"][0][0] == experts // (TP * DP)  # vLLM's own EP split: whole experts per rank
        sent = sum(item["report"]["bytes_sent"] for item in items)
        assert sent == items[0]["report"]["bytes_minimal"] > 0
        received = [check["report"]["bytes_received"] for check in checks]
        # each rank: its attention shard (same on both DP ranks of a TP rank) and its experts only
        assert received[0] == received[2] and received[1] == received[3] and sum(received) == sent


@pytest.mark.slow
def test_without_expert_parallelism_each_expert_is_tensor_parallel_over_the_deployment(refitted):
    """``gen_expert_parallel: false`` at DP2 x TP2: vLLM shards every expert over all four ranks (a quarter
    of its intermediate rows each); every rank receives its quarter of every expert, bit-exact."""
    train = [rank_out["qwen3-moe-e8:moe-tp"] for rank_out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        for check in checks:
            assert check["diff"] == [] and check["names_equal"], (version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["w13"][0][0] == 8  # every expert on every rank, sliced
        assert sum(item["report"]["bytes_sent"] for item in items) == items[0]["report"]["bytes_minimal"] > 0


@pytest.mark.slow
def test_dense_rows_forwarded_inside_a_node_land_bit_exact_in_vllms_own_parameters(refitted):
    """``gen_dense_forward: node`` into vLLM's real workers: each DP rank takes half of its TP rank's
    dense rows from the train ranks and the two pass them on; every refit bit-exact against vLLM's
    own load, the train ranks sending less than to the same deployment without forwarding."""
    train = [rank_out["qwen3-moe-e64:node"] for rank_out in refitted[:NUM_TRAIN]]
    direct = [rank_out["qwen3-moe-e64"] for rank_out in refitted[:NUM_TRAIN]]
    for version, items, plain in zip(VERSIONS, zip(*train), zip(*direct)):
        checks = items[0]["checks"]
        for check in checks:
            assert check["names_equal"] and check["diff"] == [], (version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
        sent = sum(item["report"]["bytes_sent"] for item in items)
        assert sent == items[0]["report"]["bytes_minimal"] > 0
        assert sent < sum(item["report"]["bytes_sent"] for item in plain)
        assert sum(check["report"]["bytes_received"] for check in checks) == sent
