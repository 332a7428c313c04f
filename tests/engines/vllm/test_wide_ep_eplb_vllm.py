"""megatron_refit into one vLLM 0.33 deployment that balances its experts (EPLB) on CPU (#64):
``--data-parallel-size 2 --tensor-parallel-size 2 --enable-expert-parallel --enable-eplb
--eplb-config '{"num_redundant_experts": 4, "use_async": false}'``, every rank vLLM's real ``Worker``
in a process of its own (``external_launcher``, gloo) holding our weight-transfer engine, as in
test_wide_ep_weight_transfer.py.

Lifted for CPU, and only that: vLLM's ``ParallelConfig`` refuses ``enable_eplb`` off CUDA / ROCm /
XPU, so ``current_platform.is_cuda_alike`` answers True while the configs are built (nothing else
asks it then). The EPLB state is vLLM's own: the model runner stand-in runs what
``GPUModelRunner.load_model`` runs under EPLB (``EplbState(...).add_model(model, model_config)``: the
initial map, ``set_eplb_state`` handing each FusedMoE layer its views, the gloo communicator); a
rebalance is vLLM's own commit of a new map into those views (``_commit_eplb_maps``) — what sync
EPLB's ``rearrange`` ends with; its expert weight exchange is replaced by scrambling (NaN) every
local slot whose expert moved, so a slot the refit leaves unwritten is caught.

Bridge's TP2 x EP2 shards of Qwen3-MoE (8 experts top-2: 12 physical slots, 3 per rank; 64 experts
top-8: 68 slots, 17 per rank; vLLM's EPLB needs the slots to divide over the 4 ranks) are sent by
two train ranks through vLLM's trainer contract. Refit 1 lands at EPLB's initial map; then every
layer's map moves (a permutation, one expert held in two slots of rank 0) and refit 2 must land in
the moved slots: each engine rank's parameters equal, bit for bit, a second instance of the
deployment loaded by vLLM's own ``load_weights`` of Bridge's export and then every local physical
slot written by vLLM's own ``FusedMoE`` ``weight_loader`` with the logical expert the live map names
(both replicas on rank 0 included); bytes sent equal the minimal ones. Async EPLB, and EPLB the
``refit:`` section does not name, are refused by name in ``init_transfer_engine`` before any group
is joined (one process).

As in test_weight_transfer.py, vLLM's MoE post-load (a ``vllm._C`` prepack the CUDA wheel lacks on
CPU) is skipped here, engine and reference alike.
"""

from __future__ import annotations

import contextlib
import os
import sys
from unittest import mock

import pytest
import torch


pytest.importorskip("vllm")

from tests.engines.vllm.test_weight_transfer import (HERE, NUM_TRAIN, VERSIONS, _Engine, _init_vllm,  # noqa: E402
                                                     _pieces, _QueueClient, _Runner, same_bytes, serve_calls,
                                                     spawn_deployment)

TP, DP = 2, 2
REDUNDANT = 4
CASES = {"qwen3-moe-e8": 8, "qwen3-moe-e64": 64}
"""Bridge model (bridge_shards.py) -> its routed experts."""


@contextlib.contextmanager
def eplb_on_cpu():
    """vLLM's ``ParallelConfig`` refuses EPLB off CUDA / ROCm / XPU: answer as a CUDA platform while
    a config is built (the module docstring)."""
    from vllm.config import parallel

    with mock.patch.object(parallel.current_platform, "is_cuda_alike", lambda: True):
        yield


def eplb_config(model_name: str, workdir: str, *, tp: int = TP, dp: int = DP, use_async: bool = False,
                engine: bool = True):
    """The deployment's ``VllmConfig``: test_weight_transfer.py's, with EPLB on."""
    import json

    from vllm.config import DeviceConfig, EPLBConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    sys.path.insert(0, str(HERE))
    from bridge_shards import model_config

    os.makedirs(workdir, exist_ok=True)
    tmp = os.path.join(workdir, f"config.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(model_config(model_name).to_dict(), f)
    os.replace(tmp, os.path.join(workdir, "config.json"))
    with eplb_on_cpu():
        parallel_config = ParallelConfig(
            tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=True, enable_eplb=True,
            eplb_config=EPLBConfig(num_redundant_experts=REDUNDANT, use_async=use_async),
            distributed_executor_backend="external_launcher" if dp > 1 else None)
        return VllmConfig(
            model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                                     dtype="float32"),
            parallel_config=parallel_config, device_config=DeviceConfig("cpu"),
            load_config=LoadConfig(load_format="dummy"),
            weight_transfer_config=WeightTransferConfig(backend="megatron_refit") if engine else None)


def moved_map(num_experts: int, layer: int) -> list[int]:
    """A rebalanced map of one layer: a permutation of the experts, rank 0's first and third slots
    holding the same one, the redundant slots re-dealt."""
    perm = [(3 * e + layer + 1) % num_experts for e in range(num_experts)]
    return [perm[0], perm[1], perm[0], *perm[2:], *perm[1:REDUNDANT]]


class _EplbRunner(_Runner):
    """The model runner stand-in, plus what vLLM's ``GPUModelRunner.load_model`` does under EPLB."""

    def load_model(self, load_dummy_weights: bool = False) -> None:
        from vllm.distributed.eplb.eplb_state import EplbState

        super().load_model(load_dummy_weights)
        self.eplb_state = EplbState(self.vcfg.parallel_config, torch.device("cpu"))
        self.eplb_state.add_model(self.model, self.vcfg.model_config)


class _EplbEngine(_Engine):
    """One case on one engine rank: vLLM's ``Worker`` over a model in EPLB, and the reference."""

    def __init__(self, case: str, rank: int, workdir: str, bridge_dir: str):
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu_worker import Worker

        load_general_plugins()
        self.case, self.bridge_name, self.bridge_dir, self.moe = case, case, bridge_dir, True
        self.vcfg = eplb_config(case, os.path.join(workdir, case))
        self.worker = Worker(self.vcfg, local_rank=rank, rank=rank, distributed_init_method="unused",
                             is_driver_worker=rank == 0)
        self.worker.device = torch.device("cpu")
        self.worker.model_runner = _EplbRunner(self.vcfg, moe=True)
        self.worker.load_model()  # vLLM's: the model (in EPLB), then our engine

    def _state(self):
        (state,) = self.worker.model_runner.eplb_state.model_states.values()
        return state

    def live_map(self) -> list[list[int]]:
        return self._state().physical_to_logical_map.tolist()

    def move(self) -> dict:
        """A rebalance: vLLM's own commit of a moved map into the EPLB state (the views every
        FusedMoE layer reads), every local slot whose expert moved scrambled."""
        from vllm.distributed.eplb.eplb_state import _commit_eplb_maps

        state = self._state()
        before = state.physical_to_logical_map.clone()
        num_experts = state.model.num_logical_experts
        new = torch.tensor([moved_map(num_experts, layer) for layer in range(before.shape[0])], dtype=before.dtype)
        _commit_eplb_maps(state, new)
        scrambled = 0
        with torch.no_grad():
            for layer, runner in enumerate(self.model.moe_layers):
                routed = runner.routed_experts
                for physical, local in enumerate(routed.expert_map.tolist()):
                    if local >= 0 and before[layer, physical] != new[layer, physical]:
                        routed.w13_weight[local].fill_(float("nan"))
                        routed.w2_weight[local].fill_(float("nan"))
                        scrambled += 1
        return dict(scrambled=scrambled)

    def check(self, version: int) -> dict:
        """Every parameter against the reference: vLLM's ``load_weights`` of Bridge's export into a
        second instance of the deployment, then every local physical slot written by vLLM's
        ``FusedMoE`` weight loader with the logical expert EPLB's live map names there."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        from bridge_shards import load

        export = load(self.bridge_dir, self.bridge_name, version, 0)["export"]
        rows = self.live_map()
        with set_current_vllm_config(self.vcfg):
            self.vcfg.compilation_config.static_forward_context.clear()
            with set_default_torch_dtype(self.vcfg.model_config.dtype), torch.device("cpu"):
                ref = initialize_model(vllm_config=self.vcfg)
            ref.load_weights(iter(export.items()))
            written = _write_slots(ref, export, rows)
        mine, theirs = dict(self.model.named_parameters()), dict(ref.named_parameters())
        engine = self.worker.weight_transfer_engine
        rank0_layer0 = [m[:3] for m in rows[:1]]
        return dict(names_equal=set(mine) == set(theirs), num_params=len(mine), map=rows, written=written,
                    rank0_layer0=rank0_layer0,
                    w13=[tuple(p.shape) for n, p in mine.items() if "w13" in n][:1],
                    diff=sorted(n for n in mine if n in theirs and not same_bytes(mine[n], theirs[n])),
                    state=engine.state, weights_version=engine.weights_version,
                    report=engine.last_report.as_dict())


def _write_slots(model, export: dict, rows: list[list[int]]) -> int:
    """Each local physical slot of every MoE layer written from ``export`` by vLLM's own
    ``FusedMoE`` weight loader, with the logical expert ``rows`` names there; the slots written."""
    written = 0
    with torch.no_grad():
        for layer, runner in enumerate(model.moe_layers):
            routed = runner.routed_experts
            prefix = routed.layer_name  # model.layers.<i>.mlp.experts
            for physical, logical in enumerate(rows[layer]):
                for ckpt, shard, param in (("gate_proj", "w1", routed.w13_weight), ("up_proj", "w3", routed.w13_weight),
                                           ("down_proj", "w2", routed.w2_weight)):
                    name = "w2_weight" if shard == "w2" else "w13_weight"
                    ok = param.weight_loader(param=param, loaded_weight=export[f"{prefix}.{logical}.{ckpt}.weight"],
                                             weight_name=f"{prefix}.{name}", shard_id=shard, expert_id=physical,
                                             return_success=True)
                    written += bool(ok) and shard == "w2"
    return written


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    sys.path.insert(0, str(HERE))
    gen = rank - NUM_TRAIN
    os.environ.update(RANK=str(gen), LOCAL_RANK=str(gen), WORLD_SIZE=str(TP * DP))  # external_launcher
    # vLLM creates its EPLB group with the others when the first config has EPLB on
    _init_vllm(TP, gen, vllm_port, eplb_config(next(iter(CASES)), os.path.join(workdir, "x"), engine=False), dp=DP)
    serve_calls(requests[gen], replies[gen], lambda case: _EplbEngine(case, gen, workdir, bridge_dir))


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    sys.path.insert(0, str(HERE))
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from bridge_shards import load, next_version
    from megatron_refit.engines.vllm.trainer.deployment_client import DeploymentClient
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    load_general_plugins()
    gens = list(range(world - NUM_TRAIN))
    results = {}
    for n, case in enumerate(CASES):
        every = _QueueClient(requests, replies, gens, case)  # the test's own calls (build, move, check)
        client = DeploymentClient([_QueueClient(requests, replies, gens[r * TP:(r + 1) * TP], case) for r in range(DP)])
        if rank == 0:
            every.call("case")
        weights = _pieces(load(bridge_dir, case, 1, rank)["weights"])
        refit = dict(gen_tp=TP, gen_dp=1, gen_attention_dp=DP, gen_expert_parallel=True, gen_eplb=True,
                     gen_redundant_experts=REDUNDANT, port=refit_ports[n], bucket_mb=0.25, timeout_s=120)
        engine = WeightTransferTrainerFactory.trainer_init(
            MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank), client=client,
            source=LocalShardSource(weights))
        out = []
        for version in VERSIONS:
            moved = None
            if version > 1:
                next_version(weights, bridge_dir, case, version, rank)
                if rank == 0:  # EPLB rebalances between the refits (every engine rank commits the new map)
                    moved = every.call("move")
            report = engine.send_weights()
            out.append(dict(report=report.as_dict(), moved=moved,
                            checks=every.call("check", version=version) if rank == 0 else None))
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
    return spawn_deployment(tmp_path_factory, _rank, CASES, num_gen=TP * DP, num_ports=len(CASES))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_refit_lands_in_the_slots_vllms_eplb_serves_now(refitted, case):
    experts = CASES[case]
    slots_per_rank = (experts + REDUNDANT) // (TP * DP)
    first, second = [[rank_out[case][i] for rank_out in refitted[:NUM_TRAIN]] for i in (0, 1)]
    initial = [e % experts for e in range(experts + REDUNDANT)]
    for version, items in zip(VERSIONS, (first, second)):
        checks = items[0]["checks"]
        assert len(checks) == TP * DP
        for rank, check in enumerate(checks):
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (case, version, rank, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["w13"][0][0] == slots_per_rank  # vLLM's EPLB split: E + R slots over the 4 ranks
            assert check["written"] == slots_per_rank * len(check["map"])  # the reference wrote every local slot
            want = [initial] * len(check["map"]) if version == 1 else [moved_map(experts, layer)
                                                                      for layer in range(len(check["map"]))]
            assert check["map"] == want  # what vLLM's EPLB served at this refit
        sent = sum(item["report"]["bytes_sent"] for item in items)
        assert sent == items[0]["report"]["bytes_minimal"] > 0, [item["report"] for item in items]
        received = [check["report"]["bytes_received"] for check in checks]
        assert sum(received) == sent
    # the move: rank 0 holds one expert in two slots (both written, bit-exact above); the slots whose
    # expert moved were scrambled before refit 2, on every rank
    assert second[0]["checks"][0]["rank0_layer0"][0][0] == second[0]["checks"][0]["rank0_layer0"][0][2]
    assert all(m["scrambled"] > 0 for m in second[0]["moved"])


# -- in one process: refused before any group is joined -------------------------------------


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Our engine as vLLM's factory builds it in a TP2 + EP engine with sync / async EPLB (not initialised)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    out = {}
    for use_async in (False, True):
        vcfg = eplb_config("qwen3-moe-e8", str(tmp_path_factory.mktemp("one")), dp=1, use_async=use_async)
        out[use_async] = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_refit"),
                                                                   vcfg, torch.device("cpu"), torch.nn.Linear(1, 1))
    return out


SECTION = {"gen_tp": 2, "gen_expert_parallel": True, "gen_eplb": True, "gen_redundant_experts": REDUNDANT}


@pytest.mark.parametrize("use_async, section, match", [
    (True, SECTION, r"refit\.gen_eplb: this vLLM engine runs async EPLB \(eplb_config\.use_async, vLLM's default\)"
                    r".* run sync EPLB: --eplb-config '\{\"use_async\": false\}'"),
    (False, {**SECTION, "gen_eplb": False, "gen_redundant_experts": 0},
     r"refit\.gen_eplb is false, but this vLLM engine runs --enable-eplb"),
    (False, {**SECTION, "gen_redundant_experts": 2},
     r"refit\.gen_redundant_experts=2, but this vLLM engine runs --eplb-config num_redundant_experts=4"),
])
def test_eplb_the_refit_cannot_follow_is_refused_before_any_group_is_joined(engines, use_async, section, match):
    engine = engines[use_async]
    info = engine.parse_init_info({"refit": section, "num_train": 2})
    with pytest.raises(ValueError, match=match):
        engine.init_transfer_engine(info)
    assert engine.member is None
