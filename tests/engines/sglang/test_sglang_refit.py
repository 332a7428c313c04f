"""megatron_refit into SGLang 0.5.23's real model classes, on CPU over gloo.

The engine side is SGLang's own as far as it runs without an engine on CPU
(:mod:`.sglang_cpu`): every generation rank sets up SGLang's distributed state at its TP size,
builds ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` through SGLang's ``ModelConfig`` and
dummy loader, and receives with an ``LiveModelStorage`` writing in place into that model's
fused parameters (``qkv_proj``, ``gate_up_proj``, ``w13_weight`` / ``w2_weight``, padded
vocab rows), either directly or inside SGLang's real weight-update path: the trainer's
control client (``megatron_refit.engines.sglang.trainer.client``) over an ``Engine``'s methods or HTTP
(:mod:`.engine_standins`), the scheduler's ``SchedulerWeightUpdaterManager`` (sessions,
per-rank payloads) and the model runner's ``WeightUpdater``, whose custom weight loader
(``megatron_refit.engines.sglang.worker.loader.refit_loader``) runs the refit in the TP worker. A full
``Engine`` does not start on CPU from the registry's wheels (its CPU path needs an
``sgl_kernel`` built from source).

The train side is Megatron-Bridge's real local shards: train TP2 ranks built through Bridge
in the Megatron environment (``tests/engines/vllm/bridge_shards.py``) saved their pieces and
Bridge's ``export_hf_weights``. After every refit each engine rank's parameters must equal,
bit for bit, what SGLang's own ``load_weights`` makes of Bridge's export on a second model
instance on the same rank (both NaN-filled first: every element must be written).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

# find_spec, not importorskip: the spawned ranks import this module too, and importing
# sglang costs ~5 s of CPU that the train ranks do not need
if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
BRIDGE_SHARDS = ROOT / "tests" / "engines" / "vllm" / "bridge_shards.py"
NUM_TRAIN = 2
NUM_GEN = 2
VERSIONS = (1, 2)
AFTER_REFUSED = 3
"""Through SGLang's updater: the version of the refit after one the workers refuse."""
# (case, Bridge model, how the engine receives: "direct" or through SGLang's "updater")
CASES = {
    2: [("qwen3", "qwen3", "direct"), ("qwen3-moe", "qwen3-moe", "direct"),
        ("qwen3-moe-http", "qwen3-moe", "http")],
    1: [("qwen3", "qwen3", "direct"), ("qwen3-moe", "qwen3-moe", "direct"),
        ("qwen3-engine", "qwen3", "engine")],
}
"""Per generation TP size: TP2 is one engine of 2 ranks, TP1 two independent engines. How
the engine receives: ``direct`` (our receiver over SGLang's model), or the trainer's
control client (``megatron_refit.engines.sglang.trainer.client``) driving SGLang's weight-update path with
our custom weight loader, over an ``Engine``'s methods (``engine``) or HTTP (``http``)."""
SESSION = ["begin", "update", "end"]


def _refit_section(tp: int, port: int) -> dict:
    return dict(gen_tp=tp, gen_dp=NUM_GEN // tp, port=port, bucket_mb=0.25, timeout_s=120)


# -- the generation ranks ------------------------------------------------------------


def _gen(rank, tp, sglang_ports, refit_ports, bridge_dir, workdir, cases):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.engines.sglang.worker.loader import engine_refit_for, refit_member, refit_state
    from megatron_refit.engines.sglang.trainer.client import EngineClient, HTTPClient

    from .engine_standins import RankEngine, scheduler_updater, serve_http
    from .sglang_cpu import build_model, init_sglang, write_model_dir

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
                        state=member.state, weights_version=member.full.weights_version, report=report)

        refit = _refit_section(tp, refit_ports[n])
        if path == "direct":
            member = engine_refit_for(model, refit, num_train=NUM_TRAIN, replica=replica)
            results[case] = dict(checks=[check(v, member.receive(v).as_dict()) for v in VERSIONS])
            member.close()
            continue
        manager = scheduler_updater(model, dirs[case])
        if path == "engine":
            engine = RankEngine(manager, tp)
            client, calls, server = EngineClient(engine), engine.calls, None
        else:
            url, calls, server = serve_http(manager)
            client = HTTPClient(url, tp=tp, timeout=120)
        client.connect(refit, num_train=NUM_TRAIN, replica=replica)
        member = refit_member(model)
        checks = []
        for version in VERSIONS:
            client.refit(version)
            client.resume(version)  # (rank 0 of the trainer resumes once every train rank's refit returned)
            checks.append(check(version))
        # a refit this worker refuses (a version it holds already): the loader must not raise
        # into SGLang's scheduler; the weights stay as they were; the engine stays paused
        client.refit(VERSIONS[-1])
        refused = refit_state(model)
        client.refit(AFTER_REFUSED)
        client.resume(AFTER_REFUSED)
        checks.append(check(VERSIONS[-1]))  # the trainer's weights did not change
        client.close()
        if server is not None:
            server.shutdown()
        results[case] = dict(checks=checks, refused=refused, calls=calls, closed=refit_state(model),
                             weight_versions=manager.scheduler.weight_versions)
    return results


# -- the train ranks ------------------------------------------------------------------


def _train(rank, tp, sglang_ports, refit_ports, bridge_dir, workdir, cases):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.errors import RefitAbortedError
    from megatron_refit.refit import trainer_refit_from_pieces

    results = {}
    for n, (case, name, path) in enumerate(cases):
        saved = load(bridge_dir, name, 1, rank)
        pieces = [TensorPiece(spec, tensor) for spec, tensor in saved["weights"]]
        cfg = RefitConfig.from_dict({"enabled": True, "engine": "sglang", **_refit_section(tp, refit_ports[n])})
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        reports, refused = [], None
        for version in VERSIONS:
            if version > 1:  # the next step's weights, in place of the old (as a live model's)
                for piece, (_, tensor) in zip(pieces, load(bridge_dir, name, version, rank)["weights"]):
                    piece.data = tensor
            reports.append(fleet.refit(version).as_dict())
        if path != "direct":
            try:
                fleet.refit(AFTER_REFUSED)
            except RefitAbortedError as exc:
                refused = str(exc)
            reports.append(fleet.refit(AFTER_REFUSED).as_dict())
        fleet.close()
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
            ports = free_ports(NUM_GEN // tp + len(cases))  # SGLang's groups (one per engine), refit groups
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


@pytest.mark.parametrize("tp,case", [(2, "qwen3-moe-http"), (1, "qwen3-engine")])
def test_sglang_weight_update_path_runs_the_refit(tp, case, spawned):
    """The trainer's control client through SGLang's scheduler and ``WeightUpdater``
    (``update_weights_from_tensor`` with our custom weight loader, over HTTP at TP2 and an
    Engine's methods at TP1): joins the refit group, pauses, receives each version, resumes;
    a refused refit leaves the weights as they were and the engine paused; closes."""
    out = spawned(tp)
    _check_case(out, case)
    for r in out[:NUM_TRAIN]:
        assert "failed their checks" in r[case]["refused"]
    step = lambda v: ["pause:retract", *SESSION, f"version:{v}", "continue"]  # noqa: E731
    for r in out[NUM_TRAIN:]:
        assert "does not advance past 2" in r[case]["refused"]["error"]
        assert r[case]["refused"]["state"] == "ready" and r[case]["refused"]["weights_version"] == 2
        assert r[case]["calls"] == [*SESSION, *step(1), *step(2), "pause:retract", *SESSION, *step(AFTER_REFUSED),
                                    *SESSION]
        assert r[case]["weight_versions"] == [None] * 6  # set by resume, once the refit succeeded
        assert r[case]["closed"] == dict(connected=False, state=None, weights_version=None, error=None)


# -- a fleet of SGLang engines driven by the trainer (SglangControl over HTTP) ---------------

FLEET_ENGINES = 3
FLEET_VERSIONS = (1, 2, 3, 4, 5)
"""Versions 1..5 carry Bridge's saved steps 1, 2, 1, 2, 1."""
BROKEN_AT = 4
"""Engine 0's post-load step leaves its first layer as it was while this version lands."""


def _step(version: int) -> int:
    return 2 - version % 2


def _fleet_gen(rank, requests, replies, sglang_ports, port, bridge_dir, workdir):
    """An SGLang engine (TP1) behind ``serve_http``: publishes its URL, then answers the test's
    requests (check its weights, fail its next refit, break its next post-load step) while its
    HTTP server takes the trainer's control calls and scores the serving probe with SGLang's own
    forward (``/generate``)."""
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.engines.sglang.worker.loader import refit_member, refit_state
    from megatron_refit.local.faults import fail_next_refit

    from .engine_standins import scheduler_updater, serve_http
    from .sglang_cpu import build_model, init_sglang, prefill_logprobs, write_model_dir

    gen = rank - NUM_TRAIN
    model_dir = write_model_dir(model_config("qwen3"), os.path.join(workdir, f"fleet.gen{gen}"))
    init_sglang(1, 0, sglang_ports[gen], model_dir)
    model, reference = build_model(model_dir), build_model(model_dir)
    with torch.no_grad():
        for param in (*model.parameters(), *reference.parameters()):
            param.fill_(float("nan"))
    manager = scheduler_updater(model, model_dir)
    url, calls, server = serve_http(manager, generate=lambda ids: prefill_logprobs(model, model_dir, ids))
    replies[gen].put(url)
    while True:
        op, arg = requests[gen].get(timeout=600)
        if op == "stop":
            server.shutdown()
            return dict(calls=calls, state=refit_state(model))
        if op == "fail_next":  # the engine's storage raises while the next refit lands
            fail_next_refit(refit_member(model).full.storage)
            replies[gen].put(None)
        elif op == "break_next":  # its next post-load step leaves the first layer as it was
            _break_next_post_load(model)
            replies[gen].put(None)
        elif op == "check":
            reference.load_weights(iter(load(bridge_dir, "qwen3", arg, 0)["export"].items()))
            mine, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
            replies[gen].put(dict(diff=sorted(p for p in mine if not torch.equal(mine[p], theirs[p])),
                                  **refit_state(model)))


def _break_next_post_load(model) -> None:
    from megatron_refit.engines.sglang.worker.loader import refit_member

    storage = refit_member(model).full.storage
    layer = model.model.layers[0]
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    finalize = storage.finalize

    def broken():
        storage.finalize = finalize
        finalize()
        with torch.no_grad():
            for n, p in layer.named_parameters():
                p.copy_(before[n])

    storage.finalize = broken


class _RecordedForward:
    """The trainer's forward over the serving probe (``TrainerForward``): the Megatron model's own
    log-probs of each saved step, recorded by ``bridge_shards.py`` in the Megatron environment
    (this one has no Megatron)."""

    dtype, lora = "float32", False
    experts = scale = routes = None  # a dense model; no logits' magnitudes recorded

    def __init__(self, bridge_dir: str, rank: int, vocab_size: int):
        self.bridge_dir, self.rank, self.vocab_size, self.step = bridge_dir, rank, vocab_size, 1

    def prepare(self, *, fp8: bool) -> None:
        pass

    def cover(self, base, *, budget: int, seed: int):
        return tuple(base)  # dense: every probe covers its experts

    def __call__(self, sequences):
        from bridge_shards import load

        saved = load(self.bridge_dir, "qwen3", self.step, self.rank)
        if [list(s) for s in sequences] != saved["probe"]:
            raise ValueError("the serving probe is not the one bridge_shards.py recorded")
        return saved["probe_logprobs"]


def _fleet_train(rank, requests, replies, sglang_ports, port, bridge_dir, workdir):
    """Train ranks under ``on_replica_failure: continue`` and ``verify_serving: on``: engines 0
    and 1 start; engine 1's storage raises while refit 2 lands; engine 2 joins
    (``SglangControl.add``) before refit 3; engine 0's post-load step breaks its model while
    refit 4 lands (caught by its serving probe)."""
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.control import engine_control
    from megatron_refit.engines.sglang.trainer.client import HTTPClient
    from megatron_refit.refit import trainer_refit_from_pieces

    section = dict(engine="sglang", gen_tp=1, gen_dp=2, port=port, bucket_mb=0.25, timeout_s=60,
                   on_replica_failure="continue", verify_serving="on")
    forward = _RecordedForward(bridge_dir, rank, model_config("qwen3").vocab_size)
    cfg = RefitConfig.from_dict({"enabled": True, **section})
    clients = [HTTPClient(replies[g].get(timeout=600), tp=1, timeout=120) for g in range(FLEET_ENGINES)] \
        if rank == 0 else []
    control = engine_control(cfg, clients[:2])
    pieces = [TensorPiece(spec, tensor) for spec, tensor in load(bridge_dir, "qwen3", 1, rank)["weights"]]
    fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN, forward=forward,
                                      control=control)

    def ask(gen, op, arg=None):
        requests[gen].put((op, arg))
        return replies[gen].get(timeout=600)

    out = []
    for version in FLEET_VERSIONS:
        for piece, (_, tensor) in zip(pieces, load(bridge_dir, "qwen3", _step(version), rank)["weights"]):
            piece.data = tensor
        forward.step = _step(version)
        item = dict(joined=None, checks=None)
        if rank == 0 and version == 2:
            ask(1, "fail_next")
        if rank == 0 and version == BROKEN_AT:
            ask(0, "break_next")
        if rank == 0 and version == 3:
            item["joined"] = fleet.add(clients[2])
        report = fleet.refit(version)
        item.update(failed=report.failed_replicas, replicas_ok=report.summary["refit/replicas_ok"],
                    members=sorted(fleet.members),
                    serving={k: v for k, v in report.summary.items() if k.startswith("refit/serving_max_dlogprob/")},
                    calibrated=report.summary["refit/serving_calibrated"])
        if rank == 0:
            item["checks"] = [ask(g, "check", _step(version)) for g in range(3 if version >= 3 else 2)]
        out.append(item)
    fleet.close()
    if rank == 0:
        for g in range(FLEET_ENGINES):
            requests[g].put(("stop", None))
    return out


def _fleet_rank(rank, world, port, *args):
    return (_fleet_train if rank < NUM_TRAIN else _fleet_gen)(rank, *args)


@pytest.fixture(scope="module")
def fleet(bridge_dir, tmp_path_factory):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    requests = [ctx.Queue() for _ in range(FLEET_ENGINES)]
    replies = [ctx.Queue() for _ in range(FLEET_ENGINES)]
    ports = free_ports(FLEET_ENGINES + 1)
    return run_spawned(_fleet_rank, NUM_TRAIN + FLEET_ENGINES, requests, replies, ports[:FLEET_ENGINES],
                       ports[-1], bridge_dir, str(tmp_path_factory.mktemp("sglang-fleet")), timeout_s=240)


def test_sglang_fleet_engine_error_stays_on_its_replica_and_a_new_engine_joins(fleet):
    """SglangControl over HTTP: an engine whose storage raises mid-refit fails alone (named; the
    others land the version bit for bit and resume; it stays paused and stale until the next
    refit brings it back); an engine started later joins through ``SglangControl.add``. With
    ``verify_serving: on`` every replica that landed a version scores the probe through SGLang's
    own forward and ``/generate``'s log-prob path, equal to Megatron's; one whose post-load step
    breaks its model is caught and named alone, held, and right again at the next refit."""
    train = fleet[:NUM_TRAIN]
    for rank_items in train:
        items = rank_items
        assert [item["members"] for item in items] == [[0, 1], [0, 1], [0, 1, 2], [0, 1, 2], [0, 1, 2]]
        assert [sorted(item["failed"]) for item in items] == [[], [1], [], [0], []]
        assert "CUDA error: an illegal memory access" in items[1]["failed"][1]
        assert items[3]["failed"][0].startswith("ServingMismatchError: refit 4: engine replica 0 does not serve")
        assert [item["replicas_ok"] for item in items] == [2, 1, 3, 2, 3]
    items, engines = train[0], fleet[NUM_TRAIN:]
    assert items[2]["joined"] == 2
    checked = [sorted(int(k.rsplit("_", 1)[1]) for k in item["serving"]) for item in items]
    assert checked == [[0, 1], [0], [0, 1, 2], [0, 1, 2], [0, 1, 2]]  # 1 failed at 2: not served, not asked
    # judged against their own calibrated noise from their second check on (a replica's first measures it; a
    # failure keeps it: 1 at 3, 0 at 5; the broken 0 at 4 is caught, not counted)
    assert [item["calibrated"] for item in items] == [0, 1, 2, 2, 3]
    for item in items:
        for key, dlogprob in item["serving"].items():
            assert dlogprob <= (1e-5 if not (item is items[3] and key.endswith("_0")) else float("inf")), (key, item)
    assert items[3]["serving"]["refit/serving_max_dlogprob/replica_0"] > 1e-2
    for version, item in zip(FLEET_VERSIONS, items):
        for replica, check in enumerate(item["checks"]):
            if (version, replica) == (2, 1):  # failed: stale at version 1
                assert check["state"] == "stale" and check["weights_version"] == 1
                continue
            if (version, replica) == (BROKEN_AT, 0):  # its bytes landed; its model is not the trainer's
                assert check["diff"] and all(".layers.0." in p for p in check["diff"]), check["diff"]
                continue
            assert check["diff"] == [], (version, replica, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version, (version, replica)
    resumed = [[c for c in engine["calls"] if c.startswith(("version:", "pause"))] for engine in engines]
    assert resumed[0][-4:] == ["version:4", "pause:retract", "pause:retract", "version:5"]  # held after 4
    resumed = [[c for c in calls if c.startswith("version:")] for calls in resumed]
    assert resumed == [["version:1", "version:2", "version:3", "version:4", "version:5"],
                       ["version:1", "version:3", "version:4", "version:5"],  # stayed paused after its failed 2
                       ["version:3", "version:4", "version:5"]]
    assert all(engine["calls"].count("generate") >= 3 for engine in engines)
    assert all(engine["state"]["connected"] is False for engine in engines)
