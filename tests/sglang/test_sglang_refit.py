"""megatron_refit into SGLang 0.5.23's real model classes, on CPU over gloo.

The engine side is SGLang's own as far as it runs without an engine on CPU
(:mod:`.sglang_cpu`): every generation rank sets up SGLang's distributed state at its TP size,
builds ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` through SGLang's ``ModelConfig`` and
dummy loader, and receives with an ``EngineReceiver`` writing in place into that model's
fused parameters (``qkv_proj``, ``gate_up_proj``, ``w13_weight`` / ``w2_weight``, padded
vocab rows), either directly or inside SGLang's real weight-update path: the scheduler's
``SchedulerWeightUpdaterManager`` (begin / ``update_weights_from_tensor`` / end, with the
per-rank serialised payloads ``Engine.update_weights_from_tensor`` sends) and the model
runner's ``WeightUpdater``, whose custom weight loader (``sglang_cpu.refit_loader``) runs the
refit in the TP worker. A full ``Engine`` does not start on CPU from the registry's wheels
(its CPU path needs an ``sgl_kernel`` built from source).

The train side is Megatron-Bridge's real local shards: train TP2 ranks built through Bridge
in the Megatron environment (``tests/vllm/bridge_shards.py``) saved their pieces and
Bridge's ``export_hf_weights``. After every refit each engine rank's parameters must equal,
bit for bit, what SGLang's own ``load_weights`` makes of Bridge's export on a second model
instance on the same rank (both NaN-filled first: every element must be written).
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_refit.tools.launch import free_ports, run_spawned

# find_spec, not importorskip: the spawned ranks import this module too, and importing
# sglang costs ~5 s of CPU that the train ranks do not need
if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
BRIDGE_SHARDS = ROOT / "tests" / "vllm" / "bridge_shards.py"
NUM_TRAIN = 2
NUM_GEN = 2
VERSIONS = (1, 2)
AFTER_REFUSED = 3
"""Through SGLang's updater: the version of the refit after one the workers refuse."""
# (case, Bridge model, how the engine receives: "direct" or through SGLang's "updater")
CASES = {
    2: [("qwen3", "qwen3", "direct"), ("qwen3-moe", "qwen3-moe", "direct"),
        ("qwen3-moe-updater", "qwen3-moe", "updater")],
    1: [("qwen3", "qwen3", "direct"), ("qwen3-moe", "qwen3-moe", "direct"),
        ("qwen3-updater", "qwen3", "updater")],
}
"""Per generation TP size: TP2 is one engine of 2 ranks, TP1 two independent engines."""


def _ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range. ``free_ports`` hands out ephemeral
    ports, and the gloo connections made before a later case's rendezvous can take one
    meanwhile (seen here: the refit store failing with EADDRINUSE)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return free_ports(count)
    ports: set[int] = set()
    while len(ports) < count:
        port = random.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.add(port)
    return sorted(ports)


def _refit_section(tp: int, port: int) -> dict:
    return dict(gen_tp=tp, gen_dp=NUM_GEN // tp, port=port, bucket_mb=0.25, timeout_s=120)


# -- the generation ranks ------------------------------------------------------------


class _Scheduler:
    """What ``SchedulerWeightUpdaterManager`` asks of the scheduler: the weight version."""

    def __init__(self):
        self.weight_versions = []

    def record_weight_version_change(self, new_version):
        self.weight_versions.append(new_version)


def _scheduler_updater(model, model_dir: str):
    """The scheduler's weight-update manager over a TP worker whose model runner holds
    ``model`` and SGLang's ``WeightUpdater`` (no KV cache to flush: no requests here)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker

    from .sglang_cpu import weight_updater

    class Runner:
        def __init__(self):
            self.model, self.weight_updater = model, weight_updater(model, model_dir)

    class Worker:
        deserialize_own_rank = TpModelWorker.deserialize_own_rank  # SGLang's: this rank's payload

        def __init__(self):
            self.model_runner = Runner()

        def weight_update_runners(self):
            return [("target", self.model_runner)]

    return SchedulerWeightUpdaterManager(tp_worker=Worker(), draft_worker=None, memory_saver_adapter=None,
                                         flush_cache=lambda empty_cache=True: True,
                                         is_fully_idle=lambda ignore_waiting=False: True, scheduler=_Scheduler())


def _update_session(manager, named_tensors, tp: int, weight_version: str | None = None) -> None:
    """What ``Engine.begin_weight_update`` / ``update_weights_from_tensor(named_tensors,
    load_format=LOADER)`` / ``end_weight_update`` make each TP worker's scheduler run."""
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.utils import MultiprocessingSerializer

    from .sglang_cpu import LOADER

    # one payload per TP rank, pickled as the client process pickles it: with torch's own
    # tensor reduction. Here the client shares the worker's process, where SGLang replaced
    # it on the first deserialisation (monkey_patch_torch_reductions, for CUDA IPC: it raises
    # IndexError on a CPU tensor).
    from torch.multiprocessing import reductions

    patched = reductions.reduce_tensor
    reductions.reduce_tensor = getattr(reductions, "_reduce_tensor_original", patched)
    reductions.init_reductions()
    try:
        payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(tp)]
    finally:
        reductions.reduce_tensor = patched
        reductions.init_reductions()
    for call, req in ((manager.begin_weight_update, BeginWeightUpdateReqInput()),
                      (manager.update_weights_from_tensor,
                       UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=LOADER,
                                                       weight_version=weight_version)),
                      (manager.end_weight_update, EndWeightUpdateReqInput())):
        out = call(req)
        if not out.success:
            raise RuntimeError(f"SGLang {call.__name__}: {out.message}")


def _gen(rank, tp, sglang_ports, refit_ports, bridge_dir, workdir, cases):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from .sglang_cpu import (
        build_model,
        close_tensors,
        connect_tensors,
        engine_refit_for,
        init_sglang,
        refit_tensors,
        write_model_dir,
    )

    gen = rank - NUM_TRAIN
    replica, tp_rank = divmod(gen, tp)
    dirs = {case: write_model_dir(model_config(name), os.path.join(workdir, f"{case}.gen{gen}"))
            for case, name, _ in cases}
    init_sglang(tp, tp_rank, sglang_ports[replica], dirs[cases[0][0]])
    results = {}
    for n, (case, name, path) in enumerate(cases):
        model, reference = build_model(dirs[case]), build_model(dirs[case])
        with torch.no_grad():  # SGLang's dummy init is seeded: both would start equal. Every
            for param in (*model.parameters(), *reference.parameters()):  # element unwritten stays NaN
                param.fill_(float("nan"))

        def check(weights: int, report=None) -> dict:
            """This rank's parameters against SGLang's ``load_weights`` of Bridge's export."""
            reference.load_weights(iter(load(bridge_dir, name, weights, 0)["export"].items()))
            mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
            return dict(names_equal=set(mine) == set(theirs), num_params=len(mine),
                        diff=sorted(p for p in mine if p in theirs and not torch.equal(mine[p], theirs[p])),
                        state=sync.state, weights_version=sync.full.weights_version, report=report)

        refit = _refit_section(tp, refit_ports[n])
        if path == "direct":
            sync = engine_refit_for(model, refit, num_train=NUM_TRAIN, replica=replica)
            results[case] = dict(checks=[check(v, sync.receive(v).as_dict()) for v in VERSIONS])
            sync.close()
            continue
        manager = _scheduler_updater(model, dirs[case])
        _update_session(manager, connect_tensors(refit, num_train=NUM_TRAIN, replica=replica), tp)
        sync = model._megatron_refit
        checks = []
        for version in VERSIONS:
            _update_session(manager, refit_tensors(version), tp, weight_version=str(version))
            checks.append(check(version))
        # a refit this worker refuses (a version it holds already): the loader must not raise
        # into SGLang's scheduler; the weights stay as they were; the next refit works
        _update_session(manager, refit_tensors(VERSIONS[-1]), tp)
        refused = dict(error=model.megatron_refit_error, state=sync.state)
        _update_session(manager, refit_tensors(AFTER_REFUSED), tp, weight_version=str(AFTER_REFUSED))
        checks.append(check(VERSIONS[-1]))  # the trainer's weights did not change
        _update_session(manager, close_tensors(), tp)
        results[case] = dict(checks=checks, refused=refused, weight_versions=manager.scheduler.weight_versions,
                             closed=not hasattr(model, "_megatron_refit"))
    return results


# -- the train ranks ------------------------------------------------------------------


def _train(rank, tp, sglang_ports, refit_ports, bridge_dir, workdir, cases):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load

    from megatron_refit.config import RefitConfig
    from megatron_refit.driver import RefitAbortedError, TensorPiece
    from megatron_refit.integration import trainer_refit_from_pieces

    results = {}
    for n, (case, name, path) in enumerate(cases):
        saved = load(bridge_dir, name, 1, rank)
        pieces = [TensorPiece(spec, tensor) for spec, tensor in saved["weights"]]
        cfg = RefitConfig.from_dict({"enabled": True, "backend": "sglang", **_refit_section(tp, refit_ports[n])})
        sync = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        reports, refused = [], None
        for version in VERSIONS:
            if version > 1:  # the next step's weights, in place of the old (as a live model's)
                for piece, (_, tensor) in zip(pieces, load(bridge_dir, name, version, rank)["weights"]):
                    piece.data = tensor
            reports.append(sync.refit(version).as_dict())
        if path == "updater":
            try:
                sync.refit(AFTER_REFUSED)
            except RefitAbortedError as exc:
                refused = str(exc)
            reports.append(sync.refit(AFTER_REFUSED).as_dict())
        sync.close()
        results[case] = dict(reports=reports, refused=refused)
    return results


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _gen)(rank, *args)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bridge_dir(tmp_path_factory):
    """Bridge's local shards and export (train TP2, versions 1 and 2), made in ``.venv``."""
    out = tmp_path_factory.mktemp("bridge")
    python = os.environ.get("MEGATRON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
    models = sorted({name for cases in CASES.values() for _, name, _ in cases})
    proc = subprocess.run([python, str(BRIDGE_SHARDS), str(out), *models], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return str(out)


@pytest.fixture(scope="module")
def spawned(bridge_dir, tmp_path_factory):
    """Per generation TP size: every rank's results (train ranks first)."""
    cache = {}

    def get(tp: int):
        if tp not in cache:
            cases = CASES[tp]
            ports = _ports(NUM_GEN // tp + len(cases))  # SGLang's groups (one per engine), refit groups
            cache[tp] = run_spawned(_rank, NUM_TRAIN + NUM_GEN, tp, ports[: NUM_GEN // tp], ports[NUM_GEN // tp:],
                                    bridge_dir, str(tmp_path_factory.mktemp(f"sglang-tp{tp}")), cases,
                                    timeout_s=300)
        return cache[tp]

    return get


def _check_case(out, case: str) -> None:
    """Every generation rank bit-exact after every refit; the trainers sent the minimal bytes."""
    train, gens = [r[case]["reports"] for r in out[:NUM_TRAIN]], [r[case]["checks"] for r in out[NUM_TRAIN:]]
    versions = [*VERSIONS, AFTER_REFUSED][: len(gens[0])]
    for i, version in enumerate(versions):
        for gen, checks in enumerate(gens):
            check = checks[i]
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (case, version, gen, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
        sent = sum(reports[i]["bytes_sent"] for reports in train)
        assert sent == train[0][i]["bytes_minimal"] > 0


@pytest.mark.parametrize("case", ["qwen3", "qwen3-moe"])
def test_sglang_refit_at_gen_tp2(case, spawned):
    out = spawned(2)
    _check_case(out, case)
    assert all(r[case]["checks"][0]["report"]["bytes_received"] > 0 for r in out[NUM_TRAIN:])


@pytest.mark.parametrize("case", ["qwen3", "qwen3-moe"])
def test_sglang_refit_independent_engines_at_gen_tp1(case, spawned):
    out = spawned(1)
    _check_case(out, case)
    # each engine holds the whole model: both receive the same bytes
    received = [r[case]["checks"][0]["report"]["bytes_received"] for r in out[NUM_TRAIN:]]
    assert received[0] == received[1] > 0


@pytest.mark.parametrize("tp,case", [(2, "qwen3-moe-updater"), (1, "qwen3-updater")])
def test_sglang_weight_updater_runs_the_refit(tp, case, spawned):
    """Through SGLang's scheduler and ``WeightUpdater``: ``update_weights_from_tensor`` with
    our custom weight loader joins the refit group, receives each version (a refused one
    leaves the weights and the engine as they were), closes it."""
    out = spawned(tp)
    _check_case(out, case)
    for r in out[:NUM_TRAIN]:
        assert "failed their checks" in r[case]["refused"]
    for r in out[NUM_TRAIN:]:
        assert "does not advance past 2" in r[case]["refused"]["error"]
        assert r[case]["refused"]["state"] == "ready"
        assert r[case]["weight_versions"] == [None, "1", "2", None, str(AFTER_REFUSED), None]
        assert r[case]["closed"]
