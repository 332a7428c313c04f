"""megatron_refit as vLLM 0.33's weight-transfer backend, on CPU over gloo.

The engine side is vLLM's own: ``load_general_plugins()`` runs our entry point, vLLM's
``Worker`` (the class every vLLM worker process runs) builds its model with vLLM's dummy
loader and creates our engine through ``WeightTransferEngineFactory`` in its real
``load_model``; its real ``init_weight_transfer_engine`` / ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` drive the refits. Only what a GPU engine needs
around the worker is absent here: the worker's device set-up and model runner (a stand-in
that loads the model with vLLM's loader), and the engine process that fans each call out to
the workers (a queue per worker, as ``collective_rpc`` does).

The train side is vLLM's trainer contract (``WeightTransferTrainerFactory.trainer_init`` on
every train rank, ``send_weights()``) over Megatron-Bridge's real local shards: train TP2
ranks built through Bridge in the Megatron environment (``bridge_shards.py``) saved their
pieces and Bridge's ``export_hf_weights``. After every refit each engine rank's parameters
must equal, bit for bit, what vLLM's own ``load_weights`` (+ post-load) makes of Bridge's
export on a second model instance.

On CPU vLLM's MoE post-load prepacks the experts with a ``vllm._C`` op the CUDA wheel lacks
(``prepack_moe_weight``): for MoE it is skipped here (engine and reference alike) and run by
``scripts/gpu_check_vllm.py``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).resolve().parent
NUM_TRAIN = 2
VERSIONS = (1, 2)
# (case, Bridge model, engine_load[:swap]) refitted by gen TP2; re-allocation runs on "realloc";
# "qwen3-kv1": one KV head that both engine ranks hold (trained at TP1 x DP2: replicas send)
TP2_CASES = [("qwen3-moe", "qwen3-moe", "in_place"), ("qwen3", "qwen3", "in_place"),
             ("qwen3-load", "qwen3", "load_weights"), ("qwen3-staged", "qwen3", "load_weights:staged"),
             ("qwen3-lora", "qwen3+lora", "in_place"),
             ("deepseek-v3", "deepseek-v3", "in_place"), ("qwen3-kv1", "qwen3-kv1", "in_place"),
             ("nemotron-h", "nemotron-h", "in_place"), ("nemotron-h-load", "nemotron-h", "load_weights"),
             ("realloc", "qwen3", "in_place")]
TP1_CASES = [("qwen3", "qwen3", "in_place"), ("fleet", "qwen3", "in_place"), ("qwen3-auto", "qwen3", "auto")]
"""At gen TP1 the engines are independent (``ReplicaClients``): ``qwen3`` refits two of them;
``fleet`` starts with two, fails one's engine mid-refit 2 and takes in the third at refit 3."""
TP1_ENGINES = 3


# -- the engine process side -----------------------------------------------------------


class _Runner:
    """What vLLM's ``Worker`` asks of its model runner around weight transfer: the model,
    loaded by vLLM's own dummy loader (no post-load for MoE on CPU: see the module doc)."""

    def __init__(self, vcfg, moe: bool):
        self.vcfg, self.moe, self.model = vcfg, moe, None

    def load_model(self, load_dummy_weights: bool = False) -> None:
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        loader = get_model_loader(self.vcfg.load_config)
        if not self.moe:
            self.model = loader.load_model(vllm_config=self.vcfg, model_config=self.vcfg.model_config)
            return
        with set_default_torch_dtype(self.vcfg.model_config.dtype), torch.device("cpu"):
            self.model = initialize_model(vllm_config=self.vcfg)
        loader.load_weights(self.model, self.vcfg.model_config)

    def get_model(self):
        return self.model

    def get_draft_model(self):
        return None

    def reset_lora_state(self) -> None:
        pass


def _vllm_config(model_name: str, tp: int, workdir: str, engine: bool, dp: int = 1, ep: bool = True,
                 quant: dict | None = None):
    """``dp > 1``: one deployment of ``dp`` data-parallel ranks, with expert parallelism (``ep``) or
    the MoE tensor-parallel over all its ranks, every rank a process of its own (vLLM's
    ``external_launcher``: ``RANK`` in the environment); ``quant``: the checkpoint's
    ``quantization_config`` (an FP8 engine)."""
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

    sys.path.insert(0, str(HERE))
    from bridge_shards import model_config

    os.makedirs(workdir, exist_ok=True)
    tmp = os.path.join(workdir, f"config.json.{os.getpid()}")  # engine ranks of one case write it at once:
    with open(tmp, "w") as f:  # whole, then in place (a reader never sees it half written)
        json.dump(dict(model_config(model_name).to_dict(), **({"quantization_config": quant} if quant else {})), f)
    os.replace(tmp, os.path.join(workdir, "config.json"))
    return VllmConfig(
        model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                                 dtype="bfloat16" if quant else "float32"),  # vLLM's FP8 takes bf16 / fp16
        parallel_config=ParallelConfig(tensor_parallel_size=tp) if dp == 1 else ParallelConfig(
            tensor_parallel_size=tp, data_parallel_size=dp, enable_expert_parallel=ep,
            distributed_executor_backend="external_launcher"),
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format="dummy"),
        weight_transfer_config=WeightTransferConfig(backend="megatron_refit") if engine else None,
    )


def _init_vllm(tp: int, tp_rank: int, port: int, vcfg, dp: int = 1) -> None:
    """vLLM's groups for this rank: ``tp_rank`` is its rank in the ``dp * tp`` world."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vcfg):
        init_distributed_environment(world_size=tp * dp, rank=tp_rank, local_rank=tp_rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(tp, 1, backend="gloo")


class _Engine:
    """One case on one engine rank: a vLLM ``Worker`` holding our engine, and the reference."""

    def __init__(self, case: str, bridge_name: str, tp: int, tp_rank: int, workdir: str, bridge_dir: str,
                 dp: int = 1, ep: bool = True):
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu_worker import Worker

        load_general_plugins()
        self.case, self.bridge_name, self.bridge_dir = case, bridge_name, bridge_dir
        from bridge_shards import model_config
        from megatron_refit.engines.hf.checkpoint import model_shape

        model_name = bridge_name.partition("+")[0]
        self.moe = model_shape(model_config(model_name)).num_experts > 0
        self.vcfg = _vllm_config(model_name, tp, os.path.join(workdir, case), engine=True, dp=dp, ep=ep)
        self.worker = Worker(self.vcfg, local_rank=tp_rank, rank=tp_rank, distributed_init_method="unused",
                             is_driver_worker=tp_rank == 0)
        self.worker.device = torch.device("cpu")  # what its init_device sets (CUDA only)
        self.worker.model_runner = _Runner(self.vcfg, self.moe)
        self.worker.load_model()  # vLLM's: model, then our engine from weight_transfer_config

    @property
    def model(self):
        return self.worker.get_model()

    def update_weights(self, **kwargs) -> None:  # in place, the post-load step runs in the update
        return self._no_moe_post_load(self.worker.update_weights, **kwargs)

    def finish_weight_update(self) -> None:
        return self._no_moe_post_load(self.worker.finish_weight_update)

    def _no_moe_post_load(self, call, **kwargs):
        if not self.moe:
            return call(**kwargs)
        from unittest import mock

        with mock.patch("vllm.model_executor.model_loader.utils.process_weights_after_loading"):
            return call(**kwargs)

    def check(self, version: int) -> dict:
        """Diff of every parameter against vLLM's ``load_weights`` of Bridge's export."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        from bridge_shards import load

        export = load(self.bridge_dir, self.bridge_name, version, 0)["export"]
        with set_current_vllm_config(self.vcfg):
            self.vcfg.compilation_config.static_forward_context.clear()
            with set_default_torch_dtype(self.vcfg.model_config.dtype), torch.device("cpu"):
                ref = initialize_model(vllm_config=self.vcfg)
            ref.load_weights(iter(self.checkpoint(export).items()))
            if not self.moe:
                process_weights_after_loading(ref, self.vcfg.model_config, torch.device("cpu"))
        mine, theirs = dict(self.model.named_parameters()), dict(ref.named_parameters())
        engine = self.worker.weight_transfer_engine
        return dict(names_equal=set(mine) == set(theirs), num_params=len(mine),
                    w13=[tuple(p.shape) for n, p in mine.items() if "w13" in n][:1],
                    diff=sorted(n for n in mine if n in theirs and not same_bytes(mine[n], theirs[n])),
                    state=engine.state, weights_version=engine.weights_version,
                    report=engine.last_report.as_dict(), rebinds=getattr(engine.member.full.storage, "rebinds", None))

    def checkpoint(self, export: dict) -> dict:
        """The checkpoint vLLM's reference loads for Bridge's ``export`` (an FP8 engine's: quantized)."""
        return export

    def fail_next(self) -> None:
        """The engine's storage raises while the next refit's second bucket lands (once)."""
        from megatron_refit.local.faults import fail_next_refit

        fail_next_refit(self.worker.weight_transfer_engine.member.full.storage)

    def reallocate(self, shrink: str | None = None) -> None:
        """What a reload or a wake-up does to the engine: fresh storage for every parameter
        (``shrink``: that one replaced by an empty tensor, as a kernel repack would)."""
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.data = torch.empty(0) if name == shrink else torch.full_like(param.data, float("nan"))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bytes (dtype, shape and every bit: FP8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def _serve(rank, world, port, requests, replies, tp, vllm_ports, refit_ports, workdir, bridge_dir, cases):
    """An engine rank: run the calls its client sends until told to stop."""
    sys.path.insert(0, str(HERE))
    gen = rank - NUM_TRAIN
    tp_rank = gen % tp
    from cpu_moe import allow_non_gated_moe_on_cpu

    allow_non_gated_moe_on_cpu()  # Nemotron-H's ReLU² experts (see cpu_moe.py)
    # MoE first: vLLM creates its expert-parallel group only when the first config has experts
    _init_vllm(tp, tp_rank, vllm_ports[gen // tp], _vllm_config("qwen3-moe", tp, os.path.join(workdir, "x"), False))
    serve_calls(requests[gen], replies[gen], lambda case: _Engine(
        case, next(b for c, b, _ in cases if c == case), tp, tp_rank, workdir, bridge_dir))


def serve_calls(requests, replies, make_engine) -> None:
    """Run the calls a client sends this engine rank until told to stop: ``case`` builds that case's
    engine (``make_engine(case)``), any other method runs on it (or its vLLM ``Worker``)."""
    from vllm.config import set_current_vllm_config

    engines: dict[str, _Engine] = {}
    while True:
        seq, method, kwargs = requests.get()
        if method == "stop":
            return
        try:
            if method == "case":
                engines[kwargs["case"]] = make_engine(kwargs["case"])
                result = None
            else:
                engine = engines[kwargs.pop("case")]
                target = engine if hasattr(engine, method) else engine.worker
                with set_current_vllm_config(engine.vcfg):
                    result = getattr(target, method)(**kwargs)
            replies.put((seq, True, result))
        except Exception as exc:  # noqa: BLE001 -- sent back to the client, which raises
            import traceback

            traceback.print_exc()  # the client reports only the message
            replies.put((seq, False, f"{type(exc).__name__}: {exc}"))


_SEQ = itertools.count()


class _QueueClient:
    """``VLLMWeightSyncClient`` over engine ranks in other processes (``collective_rpc``)."""

    def __init__(self, requests, replies, gens: list[int], case: str):
        self.requests, self.replies, self.gens, self.case = requests, replies, gens, case

    def call(self, method: str, **kwargs):
        seq = next(_SEQ)
        for g in self.gens:
            self.requests[g].put((seq, method, dict(kwargs, case=self.case)))
        out = []
        for g in self.gens:  # replies to an earlier call abandoned after an error are skipped
            out.append(next(r for r in iter(lambda: self.replies[g].get(timeout=300), None) if r[0] == seq)[1:])
        errors = [value for ok, value in out if not ok]
        if errors:
            raise RuntimeError(f"engine {method} failed: {errors[0]}")
        return [value for _, value in out]

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self):
        self.call("start_weight_update")

    def start_draft_weight_update(self):
        self.call("start_draft_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update")

    def shutdown_weight_transfer_engine(self):
        self.call("shutdown_weight_transfer_engine")


# -- the trainer side ------------------------------------------------------------------


def _pieces(saved: list):
    from megatron_refit.endpoint.sender import TensorPiece

    return [TensorPiece(spec, tensor) for spec, tensor in saved]


def _train(rank, world, port, requests, replies, tp, vllm_ports, refit_ports, workdir, bridge_dir, cases):
    sys.path.insert(0, str(HERE))
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from bridge_shards import load
    from megatron_refit.engines.vllm.trainer.clients import ReplicaClients
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    load_general_plugins()
    gens = list(range(world - NUM_TRAIN))
    results = {}
    for n, (case, bridge_name, engine_load) in enumerate(cases):
        if case == "fleet":
            results[case] = _fleet(rank, requests, replies, refit_ports[n], bridge_dir)
            continue
        if tp == 1:  # independent engines, one per replica: init_info gets each one's replica index
            client = ReplicaClients([_QueueClient(requests, replies, [g], case) for g in gens[:2]])
            gen_dp = 2
        else:
            client = _QueueClient(requests, replies, gens, case)
            gen_dp = len(gens) // tp
        if rank == 0:
            client.call("case") if tp > 1 else [c.call("case") for c in client.clients]
        saved = load(bridge_dir, bridge_name, 1, rank)
        weights, adapters = _pieces(saved["weights"]), _pieces(saved["adapters"])
        lora = saved["lora"] or (0, 0.0)
        source = LocalShardSource(weights, adapters, lora_rank=lora[0], lora_alpha=lora[1])
        engine_load, _, swap = engine_load.partition(":")  # "load_weights:staged": refit.swap staged
        refit = dict(gen_tp=tp, gen_dp=gen_dp, port=refit_ports[n], bucket_mb=0.25, timeout_s=120,
                     engine_load=engine_load, swap=swap or "in_place")
        engine = WeightTransferTrainerFactory.trainer_init(
            MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank), client=client, source=source)
        out = []
        for version in VERSIONS:
            if version > 1:  # the next step's weights, in place of the old (as a live model's)
                saved = load(bridge_dir, bridge_name, version, rank)
                for piece, (_, t) in zip(weights + adapters, saved["weights"] + saved["adapters"]):
                    piece.data = t
            report = engine.send_weights()
            item = dict(report=report.as_dict(), checks=None)
            if rank == 0:
                item["checks"] = _call_all(client, tp, "check", version=version)
            out.append(item)
        if case == "realloc":
            out += _reallocations(engine, client, rank, tp)
        engine.shutdown()
        results[case] = out
    if rank == 0:
        for g in gens:
            requests[g].put((-1, "stop", {}))
    return results


def spawn_deployment(tmp_path_factory, rank, models, *, num_gen: int, num_ports: int):
    """Bridge's shards of ``models`` saved (in ``.venv``), then ``rank`` spawned on ``NUM_TRAIN +
    num_gen`` processes as ``rank(rank, world, port, requests, replies, vllm_port, refit_ports,
    workdir, bridge_dir)``, ``num_ports`` refit ports: one wide deployment's run (its results)."""
    import multiprocessing as mp

    bridge = tmp_path_factory.mktemp("bridge")
    python = os.environ.get("MEGATRON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    proc = subprocess.run([python, str(HERE / "bridge_shards.py"), str(bridge), *models], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ctx = mp.get_context("spawn")
    requests = [ctx.Queue() for _ in range(num_gen)]
    replies = [ctx.Queue() for _ in range(num_gen)]
    ports = free_ports(1 + num_ports)
    return run_spawned(rank, NUM_TRAIN + num_gen, requests, replies, ports[0], ports[1:],
                       str(tmp_path_factory.mktemp("engine")), str(bridge), timeout_s=900,
                       env={"VLLM_TARGET_DEVICE": "cpu"})


FLEET_VERSIONS = (1, 2, 3, 4)


def _fleet(rank, requests, replies, port, bridge_dir):
    """Independent engines at gen TP1 under ``on_replica_failure: continue``: replicas 0 and 1
    start; replica 1's engine raises while refit 2 lands; engine 2 joins (``add_engine``) before
    refit 3. Versions 1..4 carry Bridge's saved steps 1, 2, 1, 2."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from bridge_shards import load
    from megatron_refit.engines.vllm.trainer.clients import ReplicaClients
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    clients = [_QueueClient(requests, replies, [g], "fleet") for g in range(TP1_ENGINES)]
    if rank == 0:
        for c in clients:  # every engine builds its model; engine 2 connects only when it joins
            c.call("case")
    weights = _pieces(load(bridge_dir, "qwen3", 1, rank)["weights"])
    refit = dict(gen_tp=1, gen_dp=2, port=port, bucket_mb=0.25, timeout_s=60, on_replica_failure="continue")
    engine = WeightTransferTrainerFactory.trainer_init(
        MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank),
        client=ReplicaClients(clients[:2]), source=LocalShardSource(weights))
    out = []
    for version in FLEET_VERSIONS:
        step = 2 - version % 2
        for piece, (_, tensor) in zip(weights, load(bridge_dir, "qwen3", step, rank)["weights"]):
            piece.data = tensor
        item = dict(joined=None, checks=None)
        if rank == 0 and version == 2:
            clients[1].call("fail_next")
        if rank == 0 and version == 3:
            item["joined"] = engine.add_engine(clients[2])
        report = engine.send_weights(version)
        item.update(failed=report.failed_replicas, summary=report.summary, members=sorted(engine.fleet.members))
        if rank == 0:
            item["checks"] = [c.call("check", version=step)[0] for c in clients[:3 if version >= 3 else 2]]
        out.append(item)
    engine.shutdown()
    return out


def _call_all(client, tp, method, **kwargs):
    if tp > 1:
        return client.call(method, **kwargs)
    return [value for c in client.clients for value in c.call(method, **kwargs)]


def _reallocations(engine, client, rank, tp) -> list:
    """Refit 3 after the engine re-allocated every parameter (must land in the new storage);
    refit 4 after one parameter lost its checkpoint shape (must fail on every rank, by name)."""
    out = []
    if rank == 0:
        _call_all(client, tp, "reallocate")
    report = engine.send_weights(3)
    out.append(dict(report=report.as_dict(), checks=_call_all(client, tp, "check", version=2) if rank == 0
                    else None))
    if rank == 0:
        _call_all(client, tp, "reallocate", shrink="model.layers.0.mlp.down_proj.weight")
    try:
        engine.send_weights(4)
        out.append(dict(error=None))
    except Exception as exc:  # noqa: BLE001 -- the test reads which error each rank saw
        out.append(dict(error=f"{type(exc).__name__}: {exc}"))
    return out


def _rank(rank, world, port, *args):
    fn = _train if rank < NUM_TRAIN else _serve
    return fn(rank, world, port, *args)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridge_dir(tmp_path_factory):
    """Bridge's local shards and export (train TP2, versions 1 and 2), made in ``.venv``."""
    out = tmp_path_factory.mktemp("bridge")
    python = os.environ.get("MEGATRON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    models = sorted({b for _, b, _ in TP2_CASES + TP1_CASES})
    proc = subprocess.run([python, str(HERE / "bridge_shards.py"), str(out), *models], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(out)


@pytest.fixture(scope="module")
def spawned(bridge_dir, tmp_path_factory):
    cache = {}

    def get(tp: int, num_gen: int, cases):
        if tp not in cache:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            requests = [ctx.Queue() for _ in range(num_gen)]
            replies = [ctx.Queue() for _ in range(num_gen)]
            # vLLM's groups (one per engine), refit groups (one per case)
            ports = free_ports(num_gen // tp + len(cases))
            out = run_spawned(_rank, NUM_TRAIN + num_gen, requests, replies, tp, ports[: num_gen // tp],
                              ports[num_gen // tp:], str(tmp_path_factory.mktemp("engine")), bridge_dir, cases,
                              timeout_s=900, env={"VLLM_TARGET_DEVICE": "cpu"})
            cache[tp] = out
        return cache[tp]

    return get


def _check_case(out, case: str, num_gen: int) -> None:
    train = [rank_out[case] for rank_out in out[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == num_gen
        for check in checks:
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (case, version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["report"]["bytes_received"] > 0
        sent = sum(item["report"]["bytes_sent"] for item in items)
        assert sent == items[0]["report"]["bytes_minimal"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c, _, _ in TP2_CASES if c != "realloc"])
def test_weight_transfer_refits_vllm_at_gen_tp2(case, spawned):
    _check_case(spawned(2, 2, TP2_CASES), case, 2)


@pytest.mark.slow
def test_weight_transfer_lora_second_refit_moves_adapters_only(spawned):
    out = spawned(2, 2, TP2_CASES)
    full, adapters = (sum(rank_out["qwen3-lora"][i]["report"]["bytes_sent"] for rank_out in out[:NUM_TRAIN])
                      for i in (0, 1))
    assert 0 < adapters < full / 4  # the tiny model: LoRA rank 4 of hidden 64


@pytest.mark.slow
def test_weight_transfer_reallocated_engine_is_re_resolved_or_refused(spawned):
    out = spawned(2, 2, TP2_CASES)
    _check_case(out, "realloc", 2)
    rank0 = out[0]["realloc"]
    after_realloc = rank0[2]["checks"]  # refit 3 carried version 2's weights into the new storage
    assert all(c["diff"] == [] and c["rebinds"] == 1 and c["weights_version"] == 3 for c in after_realloc)
    errors = [rank_out["realloc"][3]["error"] for rank_out in out[:NUM_TRAIN]]
    assert all(e is not None for e in errors), errors
    # rank 0 sees the engine's own error (through update_weights) or the abort; rank 1 the abort
    assert "RefitAbortedError" in errors[1] and "failed their checks" in errors[1]
    assert "down_proj" in errors[0] or "RefitAbortedError" in errors[0]


@pytest.mark.slow
def test_weight_transfer_refits_independent_engines_at_gen_tp1(spawned):
    _check_case(spawned(1, TP1_ENGINES, TP1_CASES), "qwen3", 2)


@pytest.mark.slow
def test_weight_transfer_engine_load_auto_writes_in_place_where_the_parameters_hold_the_checkpoint_layout(spawned):
    out = spawned(1, TP1_ENGINES, TP1_CASES)
    _check_case(out, "qwen3-auto", 2)
    checks = [c for item in out[0]["qwen3-auto"] for c in item["checks"]]
    assert {c["report"]["engine_load"] for c in checks} == {"in_place"}  # what auto chose, reported


@pytest.mark.slow
def test_weight_transfer_fleet_engine_error_stays_on_its_replica_and_a_new_engine_joins(spawned):
    """One vLLM engine raising mid-refit fails that replica alone: the other lands it bit for
    bit, the failed one stays stale (never ready at a mix) and the next refit brings it back; an
    engine started later joins the running trainer through add_engine and gets the current
    version."""
    train = [rank_out["fleet"] for rank_out in spawned(1, TP1_ENGINES, TP1_CASES)[:NUM_TRAIN]]
    for rank_items in train:
        assert [item["members"] for item in rank_items] == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2]]
        assert [sorted(item["failed"]) for item in rank_items] == [[], [1], [], []]
        assert "CUDA error: an illegal memory access" in rank_items[1]["failed"][1]
        assert [item["summary"]["refit/replicas_ok"] for item in rank_items] == [2, 1, 3, 3]
    items = train[0]
    assert items[2]["joined"] == 2
    for version, item in zip(FLEET_VERSIONS, items):
        for replica, check in enumerate(item["checks"]):
            if (version, replica) == (2, 1):  # failed: stale, still at version 1, not ready
                assert check["state"] == "stale" and check["weights_version"] == 1
                continue
            assert check["names_equal"] and check["diff"] == [], (version, replica, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version, (version, replica)
    joined = items[2]["checks"]  # the new engine received what a starting one does
    assert joined[2]["report"]["bytes_received"] == joined[0]["report"]["bytes_received"] > 0


# -- in one process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """Our engine as vLLM's factory builds it after plugin loading (not initialised)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vcfg = _vllm_config("qwen3", 1, str(tmp_path_factory.mktemp("one")), engine=True)
    return WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_refit"), vcfg,
                                                     torch.device("cpu"), torch.nn.Linear(1, 1))


def test_weight_transfer_backend_is_found_by_name_after_plugin_loading(engine):
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from megatron_refit.engines.vllm.plugin import register
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine
    from megatron_refit.engines.vllm.worker.engine import MegatronRefitEngine

    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "megatron_refit"] == [
        "megatron_refit.engines.vllm.plugin:register"]
    assert type(engine) is MegatronRefitEngine and engine.state == "stale"
    assert WeightTransferTrainerFactory._registry["megatron_refit"]() is MegatronRefitTrainerEngine
    register()  # vLLM may load plugins again: no "already registered"


GOOD_INIT = {"refit": {"gen_tp": 1}, "num_train": 2}


@pytest.mark.parametrize("bad,field", [
    ({"num_train": 0}, "init_info.num_train"),
    ({"refit": {"gen_tp": 0}}, "refit.gen_tp"),
    ({"refit": {"bucket_mb": "big"}}, "refit.bucket_mb"),
    ({"refit": {"engine_load": "magic"}}, "refit.engine_load"),
    ({"refit": {"gen_tpp": 2}}, "gen_tpp"),
    ({"refit": [1]}, "init_info.refit"),
    ({"replica": -1}, "init_info.replica"),
    ({"lora_rank": 4}, "init_info.lora_alpha"),
    ({"portt": 1}, "portt"),
])
def test_weight_transfer_bad_init_info_names_the_field(engine, bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        engine.parse_init_info({**GOOD_INIT, **bad})


def test_weight_transfer_refuses_a_wide_expert_parallel_deployment_by_name(engine):
    """#64: EPLB (redundant, moving experts) that the engine does not run is refused at the start of
    ``init_transfer_engine``, before any group is joined (EPLB it runs: test_wide_ep_eplb_vllm.py); a
    deployment of data-parallel ranks the engine does not run is refused naming both sides."""
    info = engine.parse_init_info({**GOOD_INIT, "refit": {"gen_tp": 2, "gen_expert_parallel": True,
                                                          "gen_redundant_experts": 4, "gen_eplb": True}})
    with pytest.raises(ValueError, match=r"refit\.gen_eplb is true, but this vLLM engine runs without --enable-eplb"):
        engine.init_transfer_engine(info)
    info = engine.parse_init_info({**GOOD_INIT, "refit": {"gen_tp": 1, "gen_attention_dp": 2}})
    with pytest.raises(ValueError, match=r"init_info\.refit\.gen_attention_dp=2, but this vLLM engine runs "
                                         r"data_parallel_size=1"):
        engine.init_transfer_engine(info)
    assert engine.member is None


@pytest.mark.parametrize("bad,field", [({"version": -1}, "update_info.version"),
                                       ({"version": "3"}, "update_info.version"),
                                       ({"version": 1, "full": "yes"}, "update_info.full"), ({}, "version"),
                                       ({"version": 1, "names": []}, "names")])
def test_weight_transfer_bad_update_info_names_the_field(engine, bad, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        engine.parse_update_info(bad)


def test_weight_transfer_phases_out_of_order_are_refused(engine):
    with pytest.raises(RuntimeError, match="start_weight_update before init_weight_transfer_engine"):
        engine.start_weight_update()
    with pytest.raises(RuntimeError, match="finish_weight_update before init_weight_transfer_engine"):
        engine.finish_weight_update()


def test_weight_transfer_a_version_that_fails_to_go_live_is_never_finished_as_ready(tmp_path):
    """The received bytes are in, but vLLM's load of them raises (inside ``update_weights``):
    the weights are ``stale`` and a ``finish_weight_update`` after it refuses, never ``ready``."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from megatron_refit.endpoint.report import RefitReport

    vcfg = _vllm_config("qwen3", 1, str(tmp_path), engine=True)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_refit"), vcfg,
                                                       torch.device("cpu"), torch.nn.Linear(1, 1))

    class Received:  # what the refit group hands over: version 1, every byte in
        def receive(self, version, full=False):
            return RefitReport(version=version, role="gen", rank=0)

    class FailingLoad:
        def load(self, model=None, only=None):
            raise RuntimeError("load_weights failed (injected)")

    engine.member, engine._storage, engine._mode = Received(), FailingLoad(), "load_weights"
    engine.start_weight_update()
    with pytest.raises(RuntimeError, match=r"load_weights failed \(injected\)"):
        engine.update_weights({"version": 1})
    assert engine.state == "stale" and engine.weights_version is None
    with pytest.raises(RuntimeError, match="finish_weight_update without a completed update_weights"):
        engine.finish_weight_update()
    assert engine.state == "stale" and engine.weights_version is None


def test_weight_transfer_trainer_refuses_a_source_without_local_shards():
    from vllm.distributed.weight_transfer import ModuleSource

    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo

    info = MegatronRefitTrainerInitInfo(refit={}, num_train=1, rank=0)
    with pytest.raises(ValueError, match="pass a LocalShardSource"):
        MegatronRefitTrainerEngine.trainer_init(info, client=None, source=ModuleSource(torch.nn.Linear(1, 1)))
    with pytest.raises(ValueError, match=r"init_info\.rank 1 outside 0\.\.0"):
        MegatronRefitTrainerInitInfo(refit={}, num_train=1, rank=1)
