"""``refit.overlap: on``: the trainer starts the next step while a refit's bytes move.

Spawned train and engine ranks over gloo. Every train rank writes version ``v``'s weights into
its pieces *in place*, starts refit ``v`` (a snapshot, then a background send slowed per bucket
so that it is still moving), then at once overwrites the same tensors, as the next optimizer
step would. Each version must still land bit for bit as it was at its step boundary. Also: a
refit that failed in the background raises at the next call, naming its version; under
``overlap_busy: skip`` every train rank skips the same refits; shutdown waits for the refit in
flight. Megatron-Bridge's own training loop (``pretrain()`` with ``RefitCallback``), deltas,
staged swap, a failing replica, FP8, LoRA and colocated transfers: further down.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import TRAIN_YAML, RunSpec, run
from megatron_refit.local.launch import free_ports, run_spawned
from megatron_refit.testing.toy_fleet import NUM_TRAIN, SHAPES, exact, set_version, storage, train_pieces

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0
SEND_DELAY_S = 0.03


def _overlap_rank(rank, world, port, scenario, versions):
    from megatron_refit.config import RefitConfig
    from megatron_refit.errors import RefitTransportError
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces
    from megatron_refit.local.faults import slowed

    cfg = RefitConfig(enabled=True, engine="vllm", gen_tp=1, gen_dp=2, port=port, bucket_mb=4096 / (1 << 20),
                      timeout_s=TIMEOUT_S, overlap="on", delta="on",
                      overlap_busy="skip" if scenario == "skip" else "wait",
                      on_replica_failure="raise" if scenario == "raise" else "continue")
    if rank < NUM_TRAIN:
        pieces = train_pieces(rank)
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        fleet.await_start()
        for member in fleet.members.values():
            slowed(member.group, SEND_DELAY_S)
        out = dict(started=[], errors=[], in_flight=[], reports=[])
        pending = list(versions)
        while pending:
            version = pending[0]
            set_version(pieces, version)  # this step's weights, in the tensors the trainer keeps
            try:
                started = fleet.start_refit(version)
            except Exception as exc:  # noqa: BLE001 -- the last refit's failure, raised here
                out["errors"].append(dict(at=version, error=type(exc).__name__, message=str(exc),
                                          notes=getattr(exc, "__notes__", [])))
                if len(out["errors"]) > 1:
                    raise
                continue  # the same step again
            pending.pop(0)
            out["started"].append(version) if started else None
            out["in_flight"].append(fleet.background.in_flight)
            for piece in pieces:  # the next step changes them while the bytes move
                piece.data.mul_(-3.0).add_(1.0)
            time.sleep(0.05)
            out["reports"] += [r.version for r in fleet.finished()]
        t0, moving = time.monotonic(), fleet.background.in_flight
        fleet.close()  # a refit in flight lands first
        out.update(close_s=time.monotonic() - t0, moving_at_close=moving, skipped=fleet.background.skipped,
                   snapshot_bytes=fleet.background.snapshot.nbytes,
                   reports=out["reports"] + [r.version for r in fleet.finished()])
        return out
    gen = rank - NUM_TRAIN
    fail = scenario in ("raise", "continue") and gen == 1
    out = []

    def on_buffer(name, call):  # replica 1's engine raises in refit 2
        if fail and len(out) == 1 and call == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (test)")

    store = storage(0, 1, on_buffer=on_buffer)
    member = engine_refit(cfg, store, gen_index=gen, num_train=NUM_TRAIN)
    while True:
        store.calls = 0
        try:
            report = member.receive()  # whatever version the trainer sends next
            out.append(dict(version=report.version, ok=True, exact=exact(store, report.version), delta=report.delta))
        except RefitTransportError:  # the trainer closed
            break
        except Exception as exc:  # noqa: BLE001
            out.append(dict(ok=False, error=type(exc).__name__))
    member.close()
    return out


def _run(scenario, versions=(1, 2, 3, 4)):
    out = run_spawned(_overlap_rank, NUM_TRAIN + 2, scenario, list(versions), timeout_s=180,
                      port=free_ports(1)[0])
    return out[:NUM_TRAIN], out[NUM_TRAIN:]


def test_trainer_overlap_lands_every_version_as_taken_and_a_failing_replica_stays_its_own():
    """``on_replica_failure: continue``: replica 1's engine raises in refit 2; every version
    still lands bit-exactly wherever it landed, replica 1 is back at 3 (in full), the train
    ranks never raise, and each refit was still moving when the next step changed the weights."""
    train, gen = _run("continue")
    for t in train:
        assert t["started"] == [1, 2, 3, 4] and t["errors"] == [] and t["reports"] == [1, 2, 3, 4]
        assert t["in_flight"] == [1, 2, 3, 4]  # the next step ran while it moved
        # the snapshot holds what this rank sends: its row halves of the weights, once
        assert t["snapshot_bytes"] <= sum(torch.zeros(s).numel() * 4 for s in SHAPES.values())
    assert [(g["version"], g["ok"], g["exact"]) for g in gen[0]] == [(v, True, True) for v in (1, 2, 3, 4)]
    assert [g["ok"] for g in gen[1]] == [True, False, True, True]
    assert all(g["exact"] for g in gen[1] if g["ok"]) and [g.get("delta") for g in gen[1]] == [False, None, False, True]


def test_trainer_overlap_a_failed_background_refit_raises_at_the_next_call_naming_its_version():
    train, gen = _run("raise")
    for t in train:
        (error,) = t["errors"]
        assert error["at"] == 3 and error["error"] == "ReplicaFailedError"
        assert "refit 2" in error["message"] and "replica(s) [1]" in error["message"], error
        assert any("refit 2 failed in the background" in note for note in error["notes"]), error
        assert t["started"] == [1, 2, 3, 4]  # step 3 retried after the error
    assert all(g["exact"] for g in gen[0]) and [g["version"] for g in gen[0]] == [1, 2, 3, 4]
    assert [g["ok"] for g in gen[1]] == [True, False, True, True]


def test_trainer_overlap_busy_skip_skips_the_same_refits_on_every_train_rank_and_close_waits():
    train, gen = _run("skip", versions=range(1, 9))
    skipped = train[0]["skipped"]
    assert skipped and train[1]["skipped"] == skipped, (skipped, train[1]["skipped"])
    landed = [v for v in range(1, 9) if v not in skipped]
    for t in train:
        assert t["started"] == t["reports"] == landed
        if t["moving_at_close"] is not None:  # close() waited for it, and it landed
            assert t["moving_at_close"] == landed[-1] and t["close_s"] > SEND_DELAY_S
    for g in gen:
        assert [r["version"] for r in g] == landed and all(r["exact"] for r in g)


def _churn_rank(rank, world, port, flag):
    """Replicas 0 and 1 start; while refit 2 is in flight (replica 0's engine slow at it), replica
    1 lands it and leaves, and a new engine announces itself as replica 2. Both changes must
    wait for the refit in flight and take effect, in order, at the start of refit 3."""
    import os
    import threading

    from megatron_refit.config import RefitConfig
    from megatron_refit.group.store import JOINS, LEAVES
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.refit import trainer_refit_from_pieces

    cfg = RefitConfig(enabled=True, engine="vllm", gen_tp=1, gen_dp=2, port=port, bucket_mb=4096 / (1 << 20),
                      timeout_s=TIMEOUT_S, stall_s=2.0, overlap="on", delta="on", on_replica_failure="continue")
    if rank < NUM_TRAIN:
        pieces = train_pieces(rank)
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        out = dict(members={}, reports=[], announced_in_flight=None)
        for version in (1, 2, 3, 4):
            set_version(pieces, version)
            if version == 3 and rank == 0:  # both announcements arrive while refit 2 still moves
                open(flag, "w").close()
                deadline = time.monotonic() + 60
                store = fleet.control_group.store
                while time.monotonic() < deadline and not (store.check([LEAVES])
                                                           and store.get(JOINS).decode().count(",") > 2):
                    time.sleep(0.02)
                out["announced_in_flight"] = fleet.background.in_flight
            fleet.start_refit(version, busy="wait")
            out["members"][version] = sorted(fleet.members)  # as the refit just started takes them
            out["reports"] += [(r.version, r.failed_replicas) for r in fleet.finished()]
        fleet.close()
        out["reports"] += [(r.version, r.failed_replicas) for r in fleet.finished()]
        out["threads"] = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        return out
    gen = rank - NUM_TRAIN
    joiner = gen == 2
    if joiner:  # starts once refit 2 is in flight
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.02)

    def slow(name, call):  # replica 0 lands refit 2 slowly: it is still in flight when the others moved on
        if gen == 0 and out and out[-1]["version"] == 1:
            time.sleep(0.25)

    out: list = []
    store = storage(0, 1, on_buffer=slow)
    member = engine_refit(cfg, store, gen_index=gen, num_train=NUM_TRAIN)
    for _ in range(2 if gen == 1 or joiner else 4):
        report = member.receive()
        out.append(dict(version=report.version, exact=exact(store, report.version), delta=report.delta))
    member.close()  # replica 1 leaves after refit 2 (the others after the trainer's last)
    return dict(received=out, threads=sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))


def test_trainer_overlap_a_join_and_a_leave_during_a_refit_in_flight_take_effect_in_order_at_the_next(tmp_path):
    out = run_spawned(_churn_rank, NUM_TRAIN + 3, str(tmp_path / "flag"), timeout_s=180, port=free_ports(1)[0])
    train, engines = out[:NUM_TRAIN], out[NUM_TRAIN:]
    gen = [e["received"] for e in engines]
    for side in train + engines:  # after close(): no thread of ours (each named) left, nor any other
        assert side["threads"] == [], side["threads"]
    flag_train = train[0]
    assert flag_train["announced_in_flight"] == 2, flag_train  # both arrived while refit 2 moved
    for t in train:
        assert t["members"] == {1: [0, 1], 2: [0, 1], 3: [0, 2], 4: [0, 2]}, t["members"]
        assert sorted(v for v, _ in t["reports"]) == [1, 2, 3, 4] and all(not f for _, f in t["reports"]), t
    assert [(g["version"], g["exact"]) for g in gen[0]] == [(v, True) for v in (1, 2, 3, 4)]
    assert [(g["version"], g["exact"]) for g in gen[1]] == [(1, True), (2, True)]  # it landed 2, then left
    assert [(g["version"], g["exact"], g["delta"]) for g in gen[2]] == [(3, True, False), (4, True, True)]


# -- through Megatron (the harness: Bridge's enumeration, Megatron's optimizer steps) -----------------


OVERLAP_CASES = {
    # train TP2, bf16 with the DistributedOptimizer; deltas; staged swap; replica 1 fails refit 2
    "delta-staged-failing-replica": dict(model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2),
                                         dtype="bfloat16", delta="on", swap="staged", fail_replica=(1, 2),
                                         lr=1e-3),
    # trainer-side FP8 quantized from the snapshot, into gen TP2, bucket bytes through shared buffers
    "fp8-colocated": dict(model="qwen3", overrides=dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256),
                          train=TrainLayout(tp=2), gen=GenLayout(tp=2), fp8="trainer", colocated=True),
    # LoRA: base and adapters first, adapters only afterwards
    "lora": dict(model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1), lora_rank=4),
}


@pytest.mark.parametrize("case", list(OVERLAP_CASES))
def test_trainer_overlap_through_megatron(case):
    spec = RunSpec(refits=3, bucket_bytes=64 << 10, overlap=True, hold_refits=True, **OVERLAP_CASES[case])
    results = run(spec)
    result = evaluate(spec, results)
    for refit in result["refits"]:
        assert refit["bit_exact"] is True, refit
    train = [r for r in results if r["role"] == "train"]
    for t in train:  # every refit but the last was still moving after the next step
        assert [item["overlapped"] for item in t["refits"]] == [True, True, False]
    if spec.fail_replica:
        assert [bool(item["failed_replicas"]) for item in train[0]["refits"]] == [False, True, False]
        assert [r["delta"] for r in result["refits"]] == [False, True, True]
    if spec.lora_rank:
        sent = [r["bytes_sent"] for r in result["refits"]]
        assert sent[1] == sent[2] < sent[0] / 4  # adapters only after the first


# -- inside Megatron-Bridge's own pretrain() ------------------------------------------------------

PRETRAIN_YAML = TRAIN_YAML + """  overlap: on
  delta: on
  gen_dp: 2
  on_replica_failure: continue
"""
PRETRAIN_ITERATIONS = 4
FAILING = (1, 2)
"""Engine replica 1 raises while refit 2 lands."""


def _pretrain_overlap_train(rank, num_train, yaml_path, megatron_port):
    import os

    from conversion.refit_callback import RefitCallback, force_param_sync
    from conversion.te_shim import import_bridge
    from conversion.presets import hf_config
    from conversion.testing.tiny_pretrain import run_tiny_pretrain
    from megatron_refit.config import load_training_yaml
    from megatron_refit.local.faults import HoldRefits

    import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.callbacks import Callback

    os.environ.update(WORLD_SIZE=str(num_train), MASTER_PORT=str(megatron_port))
    cfg = hf_config("qwen3")
    bridge = AutoBridge.from_hf_config(cfg)
    _, refit = load_training_yaml(yaml_path)
    refit_callback = RefitCallback.from_config(refit, bridge)
    out = dict(exports={}, in_flight={}, at_end=None)

    class Steps(Callback):
        """Before the refit callback at every event: Bridge's export of the weights at this
        step boundary (what the refit taken now must land), and the release of the last
        refit, held at its start until this step had changed the weights."""

        def on_train_start(self, context):
            self.hold = None

        def on_train_step_end(self, context):
            iteration = context.state.train_state.step + 1
            if self.hold is None:  # the callback joined at on_train_start (after this one)
                self.hold = HoldRefits(refit_callback.fleet, 120)
            out["in_flight"][iteration] = refit_callback.fleet.background.in_flight
            self.hold.stepped(iteration)
            force_param_sync(context.model, context.optimizer)
            got = {n: t.detach().cpu().clone() for n, t in bridge.export_hf_weights(context.model, cpu=True,
                                                                                      show_progress=False)}
            out["exports"][iteration] = got if rank == 0 else None

        def on_train_end(self, context):
            out["at_end"] = refit_callback.fleet.background.in_flight  # on_train_end waits for it
            self.hold.stepped(float("inf"))

    steps = Steps()
    record = run_tiny_pretrain(cfg, train_iters=PRETRAIN_ITERATIONS, callbacks=[steps, refit_callback],
                               dp=num_train, overlap_param_gather=True)
    return dict(out, iterations=record["iterations"], closed=refit_callback.fleet is None,
                last=refit_callback.last_report.version, skipped_busy=refit_callback.skipped_busy)


def _pretrain_overlap_gen(refit, gen_index, num_train):
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.local.harness import _failing

    backend = HFStorage.from_config(hf_config("qwen3"), dtype=torch.bfloat16)
    armed = _failing(backend)
    member = engine_refit(refit, backend, gen_index=gen_index, num_train=num_train)
    out = {}
    for version in range(PRETRAIN_ITERATIONS + 1):
        armed[0] = (gen_index, version) == FAILING
        try:
            report = member.receive(version)
        except RuntimeError as exc:
            out[version] = dict(error=str(exc))
            continue
        out[version] = dict(weights={n: t.clone() for n, t in backend.state_dict_hf().items()}, delta=report.delta)
    member.close()
    return out


def _pretrain_overlap_rank(rank, world, port, yaml_path, megatron_port):
    import os

    from megatron_refit.config import load_training_yaml

    os.environ["TEST_REFIT_PORT"] = str(port)
    if rank < 2:
        return _pretrain_overlap_train(rank, 2, yaml_path, megatron_port)
    return _pretrain_overlap_gen(load_training_yaml(yaml_path)[1], rank - 2, num_train=2)


def test_trainer_overlap_inside_bridge_pretrain_deltas_a_failing_replica_and_shutdown_during_a_refit(tmp_path):
    """Bridge's pretrain() (TP1 x DP2, DDP with overlapped param gather, the distributed
    optimizer) with ``refit.overlap: on`` in the training YAML, two engine replicas, deltas.
    Each refit is held at its start until the next iteration has changed the weights; every version
    lands bit-exactly as Bridge exported it at its iteration; replica 1 fails refit 2 alone and
    is whole again at 3; training ends while refit 4 moves, and on_train_end waits for it."""
    path = tmp_path / "train.yaml"
    path.write_text(PRETRAIN_YAML)
    out = run_spawned(_pretrain_overlap_rank, 4, str(path), free_ports(1)[0], timeout_s=300)
    train, gens = out[:2], out[2:]
    for t in train:
        assert t["iterations"] == PRETRAIN_ITERATIONS and t["closed"] and t["skipped_busy"] == []
        # at each iteration's end the last refit was still moving (held until this step ended);
        # version 0, at on_train_start, lands before training starts
        assert t["in_flight"] == {1: None, **{i: i - 1 for i in range(2, PRETRAIN_ITERATIONS + 1)}}
        assert t["at_end"] == PRETRAIN_ITERATIONS and t["last"] == PRETRAIN_ITERATIONS
    exports = train[0]["exports"]
    for replica, got in enumerate(gens):
        for version in range(1, PRETRAIN_ITERATIONS + 1):
            if (replica, version) == FAILING:
                assert "error" in got[version]
                continue
            weights = got[version]["weights"]
            assert weights and all(torch.equal(t, exports[version][n]) for n, t in weights.items()), (replica, version)
    assert [gens[0][v]["delta"] for v in range(1, PRETRAIN_ITERATIONS + 1)] == [True] * PRETRAIN_ITERATIONS
    assert [gens[1][v].get("delta") for v in range(1, PRETRAIN_ITERATIONS + 1)] == [True, None, False, True]
