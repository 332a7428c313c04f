"""``RefitCallback`` driven through Megatron-Bridge's ``CallbackManager`` over real Megatron
training: DDP-wrapped chunks and the DistributedOptimizer (bf16 params, fp32 main params),
gloo on CPU.

Two train ranks (TP2, or TP1 x DP2) and one generation rank (Hugging Face transformers,
gen TP1). Every iteration: a real step (``train_step`` with Megatron's optimizer), then
Bridge's ``on_train_step_end`` event with a real ``CallbackContext``. After every refit the
generation weights must equal Bridge's ``export_hf_weights`` of the trainer's bf16 params
bit for bit. Skipped iterations and ``every_n_steps`` send nothing; with
``overlap_param_gather`` the step's param all-gather is still pending when the event fires,
and the callback must finish it before reading (the test shows it was pending).
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from megatron_refit.local.harness import TRAIN_YAML
from megatron_refit.local.launch import free_ports, run_spawned

pytestmark = pytest.mark.slow

ITERATIONS = 4

def _record_first_send(into: dict) -> None:
    """This process: the stacks at its first bucket's send (in ``ProcessGroupTransport._post``,
    below ``isend``), of the thread that sends it (a replica's lane) and of the training thread,
    as ``(file, function)`` from the outermost."""
    import sys
    import threading
    import traceback

    from megatron_refit.transport.process_group import ProcessGroupTransport

    original, training = ProcessGroupTransport._post, threading.main_thread().ident

    def _post(self, op, buffer, peer, tag, what):
        if "lane" not in into and what.startswith("send"):
            lane = traceback.extract_stack(sys._getframe(1))
            if any(f.name == "run_buckets" for f in lane):  # a bucket, not the handshake's or a digest
                into["lane"] = [(f.filename, f.name) for f in lane]
                into["training"] = [(f.filename, f.name)
                                    for f in traceback.extract_stack(sys._current_frames()[training])]
        return original(self, op, buffer, peer, tag, what)

    ProcessGroupTransport._post = _post


def _ours(stack) -> list[str]:
    """The frames of a recorded stack that are this project's code (not Python's, Bridge's or the test's)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return [f"{os.path.relpath(file, root)}:{name}" for file, name in stack
            if file.startswith(os.path.join(root, "megatron_refit") + os.sep)
            or file.startswith(os.path.join(root, "conversion") + os.sep)]


def _train(rank, world, refit, tp, overlap, skipped, port, wait_for_replica=None):

    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.testing.megatron_optim import distributed_optimizer
    from conversion.refit_callback import RefitCallback
    from conversion.testing.train_step import train_step
    from megatron_refit.local.harness import tokens_for
    from megatron_refit.plan.layout import TrainLayout
    from megatron.bridge.training.callbacks import CallbackContext, CallbackManager  # after conversion's TE shim

    init_gloo(rank, world, port)
    layout = TrainLayout(tp=tp, dp=world // tp)
    init_model_parallel(layout)
    cfg = hf_config("qwen3")
    built = build_model(cfg, layout, dtype=torch.bfloat16)
    built, optimizer = distributed_optimizer(built, lr=1e-2, overlap=overlap)
    stacks: dict = {}
    _record_first_send(stacks)
    engines = [_EngineClient()] if refit.engine == "sglang" else None  # one per replica (gen_dp 1)
    callback = RefitCallback.from_config(refit, built.bridge, engines=engines)
    manager = CallbackManager()
    manager.add(callback)
    # what the callback reads of GlobalState; Bridge's TensorBoard writer lives on the last rank only
    writer = _Writer() if rank == world - 1 else None
    state = types.SimpleNamespace(train_state=types.SimpleNamespace(step=0), tensorboard_logger=writer,
                                  wandb_logger=None)

    def context(**kw):
        return CallbackContext(state=state, model=built.model, user_state=manager.user_state, optimizer=optimizer,
                               **kw)

    manager.fire("on_train_start", context())  # version 0: the weights training starts from
    start = {n: t.detach().clone() for n, t in built.bridge.export_hf_weights(built.model, cpu=True,
                                                                              show_progress=False)}
    out = []
    for it in range(ITERATIONS):
        if it == 1 and wait_for_replica is not None:  # the joiner announced itself: the next refit takes it in
            _await_join(refit, wait_for_replica)
        loss = train_step(built, optimizer, tokens_for(it + 1, cfg.vocab_size))
        before = [p.detach().clone() for chunk in built.model for p in chunk.parameters()]
        manager.fire("on_train_step_end", context(skipped_iter=it + 1 in skipped, loss_dict={"lm loss": loss}))
        after = [p.detach() for chunk in built.model for p in chunk.parameters()]
        pending = sum(not torch.equal(a, b) for a, b in zip(before, after))  # finished by the callback's fleet
        report = callback.last_report
        refitted = report is not None and report.version == it + 1
        export = None
        if refitted:  # collective over the train ranks; rank 0 keeps it
            export = {n: t.detach().clone() for n, t in built.bridge.export_hf_weights(
                built.model, cpu=True, show_progress=False)}
            export = export if rank == 0 else None
        out.append(dict(iteration=it + 1, refitted=refitted, pending=pending, export=export, loss=loss,
                        dtypes=sorted({str(p.dtype) for chunk in built.model for p in chunk.parameters()}),
                        sent=report.bytes_sent if refitted else 0, summary=report.summary if refitted else None))
        state.train_state.step += 1
    manager.fire("on_train_end", context())
    return dict(role="train", steps=out, skipped=callback.skipped, closed=callback.fleet is None,
                start=start if rank == 0 else None, scalars=writer.scalars if writer else None,
                engine_calls=[e.calls for e in engines] if engines else None, stacks=stacks)


class _EngineClient:
    """Records the control calls an SGLang client gets (the engine here is an HF receiver
    with a loop of its own; tests/engines/sglang runs the real SGLang side)."""

    def __init__(self):
        self.calls = []

    def connect(self, refit, *, num_train, replica=0):
        self.calls.append(("connect", refit["engine"], num_train, replica))

    def refit(self, version, *, full=False):
        self.calls.append(("refit", version))

    def resume(self, version):
        self.calls.append(("resume", version))

    def close(self):
        self.calls.append(("close",))


class _Writer:
    """Records ``add_scalar`` calls as TensorBoard's SummaryWriter receives them."""

    def __init__(self):
        self.scalars = []

    def add_scalar(self, name, value, iteration):
        self.scalars.append((name, value, iteration))

def _gen(refit, versions, num_train, device="cpu", gen_index=0):
    from conversion.presets import hf_config
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.engines.hf.storage import HFStorage

    backend = HFStorage.from_config(hf_config("qwen3"), dtype=torch.bfloat16, device=device)
    member = engine_refit(refit, backend, gen_index=gen_index, num_train=num_train, device=device)
    out = {}
    for version in versions:
        report = member.receive(version)
        out[version] = dict(weights={n: t.cpu() for n, t in backend.state_dict_hf().items()},
                            minimal=report.bytes_minimal, seconds=report.seconds["total"])
    member.close()
    return dict(role="gen", refits=out)

def _rank(rank, world, port, refit, tp, overlap, skipped, versions, megatron_port):
    if rank < 2:
        return _train(rank, 2, refit, tp, overlap, skipped, megatron_port)
    return _gen(refit, versions, num_train=2)

def _run(tp: int, overlap: bool = False, skipped=(), every: int = 1, engine: str = "hf"):
    from megatron_refit.config import RefitConfig

    refit_port, megatron_port = free_ports(2)
    refit = RefitConfig(enabled=True, engine=engine, port=refit_port, bucket_mb=0.25, timeout_s=120,
                        every_n_steps=every)
    versions = [0] + [v for v in range(1, ITERATIONS + 1) if v % every == 0 and v not in skipped]  # 0: the start
    out = run_spawned(_rank, 3, refit, tp, overlap, set(skipped), versions, megatron_port, timeout_s=300)
    train, gen = out[:2], out[2]
    refitted = [0] + [s["iteration"] for s in train[0]["steps"] if s["refitted"]]
    assert refitted == versions == sorted(gen["refits"])
    start = gen["refits"][0]["weights"]
    assert all(torch.equal(start[n], train[0]["start"][n]) for n in start)  # the starting weights, exactly
    for step in train[0]["steps"]:
        assert step["dtypes"] == ["torch.bfloat16"]  # the model params, not the fp32 main params
        if step["refitted"]:
            got = gen["refits"][step["iteration"]]["weights"]
            want = step["export"]
            assert set(got) <= set(want) and got
            diff = [n for n in got if not torch.equal(got[n], want[n])]
            assert not diff, (step["iteration"], diff[:5])
            assert sum(t["steps"][step["iteration"] - 1]["sent"] for t in train) == \
                gen["refits"][step["iteration"]]["minimal"]
    assert train[0]["skipped"] == list(skipped) and all(t["closed"] for t in train)
    if engine == "sglang":  # train rank 0 drove the engine replica around every refit; rank 1 none
        assert train[1]["engine_calls"] == [[]]
        for replica, calls in enumerate(train[0]["engine_calls"]):
            assert calls == [("connect", "sglang", 2, replica), *[c for v in versions for c in (("refit", v),
                                                                                               ("resume", v))],
                             ("close",)]
    losses = [s["loss"] for s in train[-1]["steps"]]
    assert len(set(losses)) == len(losses)  # real optimizer steps changed the weights
    # every refit's flat group metrics reached the training run's writer (last rank) at its iteration
    assert train[0]["scalars"] is None
    logged = {}
    for name, value, iteration in train[1]["scalars"]:
        logged.setdefault(iteration, {})[name] = value
    assert sorted(logged) == versions
    for step in train[1]["steps"]:
        if step["refitted"]:
            assert logged[step["iteration"]] == step["summary"] == train[0]["steps"][step["iteration"] - 1]["summary"]
            assert step["summary"]["refit/bytes"] == gen["refits"][step["iteration"]]["minimal"]
    return train

def test_callback_refits_from_ddp_and_distributed_optimizer_at_tp2_skipping_an_iteration():
    """Bit-exact at every refit; a skipped iteration sends nothing (the generation rank
    expects exactly the other versions). With ``refit.engine: sglang`` and ``engines``,
    train rank 0 drives every replica's control client around each refit."""
    train = _run(tp=2, skipped=(3,), engine="sglang")  # the HF receiver stands for the engine (gen_tp 1)
    assert all(s["pending"] == 0 for t in train for s in t["steps"])  # without overlap: gathered in step()
    _check_depth(train[0]["stacks"])


def _check_depth(stacks: dict) -> None:
    """The refit path's depth in our frames (docs/architecture.md, "The refit path"), printed:
    on the thread that sends (a replica's lane of the fleet's runner) at most 6 from the lane's
    loop to ``isend``; on the training thread, the callback hands the refit to the lanes in 3."""
    lane, training = _ours(stacks["lane"]), _ours(stacks["training"])
    training = training[next(i for i, f in enumerate(training) if "refit_callback.py" in f):]  # from the callback
    print("the training thread at the first bucket's send:", *training, sep="\n  ")
    print("the replica's lane, which sends it:", *lane, sep="\n  ")
    assert lane[-1].endswith("process_group.py:isend") and lane[-2].endswith("sender.py:_post"), lane
    assert lane[0].endswith("runner.py:_loop") and len(lane) <= 6, lane
    assert [f.rsplit(":", 1)[1] for f in training] == ["on_train_start", "refit", "_refit"], training


def test_callback_every_2nd_step_finishes_an_overlapped_param_gather_before_reading():
    """TP1 x DP2 with overlap_param_gather: when the event fires, the step's all-gather is
    still pending (replicas hold stale shards of each other's params); on the iterations it
    refits the callback finishes it before reading, on the others it leaves it to the
    next forward."""
    train = _run(tp=1, overlap=True, every=2)
    for t in train:
        assert [s["pending"] > 0 for s in t["steps"]] == [s["refitted"] for s in t["steps"]] == [
            it % 2 == 0 for it in range(1, ITERATIONS + 1)]


# -- inside Bridge's real pretrain() -------------------------------------------------------

PRETRAIN_ITERATIONS = 3


def _rng_digest() -> str:
    """The generators' states this rank trains with (CPU, and Megatron's RNG tracker)."""
    import hashlib

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    for name, state in sorted(get_cuda_rng_tracker().get_states().items()):
        digest.update(name.encode() + state.cpu().numpy().tobytes())
    return digest.hexdigest()


def _pretrain_train(rank, num_train, yaml_path, megatron_port, wait_joins: int = 0):
    import os

    from conversion.presets import hf_config
    from conversion.refit_callback import RefitCallback
    from conversion.te_shim import import_bridge
    from conversion.testing.tiny_pretrain import run_tiny_pretrain
    from megatron_refit.config import load_training_yaml

    import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.callbacks import Callback

    os.environ.update(WORLD_SIZE=str(num_train), MASTER_PORT=str(megatron_port))  # Bridge's world: the train ranks
    cfg = hf_config("qwen3")
    bridge = AutoBridge.from_hf_config(cfg)
    bridge_config, refit = load_training_yaml(yaml_path)
    callbacks = [RefitCallback.from_config(refit, bridge)] if refit.enabled else []
    exports = {}

    class Export(Callback):
        """After the refit callback: Bridge's export of what it just sent (collective over
        the train ranks), and the dtype of the params it read."""

        def _export(self, context, version):
            got = {n: t.detach().cpu().clone() for n, t in bridge.export_hf_weights(context.model, cpu=True,
                                                                                      show_progress=False)}
            dtypes = sorted({str(p.dtype) for chunk in context.model for p in chunk.parameters()})
            report = callbacks[0].last_report
            exports[version] = dict(weights=got if rank == 0 else None, dtypes=dtypes, sent=report.bytes_sent,
                                    seconds=report.seconds["total"], replicas_ok=report.summary["refit/replicas_ok"],
                                    checked=report.summary["refit/serving_checked"],
                                    dlogprob=report.summary["refit/serving_max_dlogprob"], rng=_rng_digest())

        def on_train_start(self, context):
            self._export(context, context.state.train_state.step)
            if wait_joins and rank == 0:  # the test's joiner has announced itself: the next refit takes it in
                import time

                from megatron_refit.group.store import JOINS

                store, deadline = callbacks[0].fleet.control_group.store, time.monotonic() + 200
                while store.get(JOINS).decode().count(",") < wait_joins and time.monotonic() < deadline:
                    time.sleep(0.05)

        def on_train_step_end(self, context):
            self._export(context, context.state.train_state.step + 1)

    record = run_tiny_pretrain(cfg, train_iters=PRETRAIN_ITERATIONS, callbacks=callbacks + [Export()], dp=num_train,
                               overlap_param_gather=num_train > 1)
    return dict(exports=exports, record=record, closed=callbacks[0].fleet is None)


def _pretrain_rank(rank, world, port, yaml_path, megatron_port, device):
    import os

    os.environ["TEST_REFIT_PORT"] = str(port)  # ${oc.env:...} in the training YAML
    num_train = world - 1
    if rank < num_train:
        return _pretrain_train(rank, num_train, yaml_path, megatron_port)
    from megatron_refit.config import load_training_yaml

    return _gen(load_training_yaml(yaml_path)[1], range(PRETRAIN_ITERATIONS + 1), num_train=num_train, device=device)


def run_pretrain_refit(workdir: str, *, num_train: int = 2, device: str = "cpu", verify_serving: str = "auto") -> dict:
    """Bridge's pretrain() on ``num_train`` ranks (TP1 x DP, overlapped param gather when DP > 1)
    with ``RefitCallback`` into one HF generation rank; every refit checked against Bridge's
    export. ``device="cuda"``: one train rank and the engine on one GPU, colocated (CUDA IPC):
    ``scripts/gpu_check.py`` runs it."""
    import os

    path = os.path.join(workdir, "train.yaml")
    with open(path, "w") as f:
        f.write(TRAIN_YAML + ("  mode: colocated\n" if device == "cuda" else "")
                + f"  verify_serving: {verify_serving}\n")
    out = run_spawned(_pretrain_rank, num_train + 1, path, free_ports(1)[0], device, timeout_s=300)
    train, gen = out[:num_train], out[num_train]
    checks = {}
    for version, refit in gen["refits"].items():
        want = train[0]["exports"][version]
        diff = [n for n, t in refit["weights"].items() if not torch.equal(t, want["weights"][n])]
        checks[version] = dict(bit_exact=not diff, diff=diff[:5], dtypes=want["dtypes"],
                               bytes_sent=sum(t["exports"][version]["sent"] for t in train),
                               bytes_minimal=refit["minimal"], weights=refit["weights"],
                               **{key: train[0]["exports"][version][key] for key in ("checked", "dlogprob")},
                               rng=[t["exports"][version]["rng"] for t in train],
                               seconds=max(refit["seconds"], *(t["exports"][version]["seconds"] for t in train)))
    return dict(versions=sorted(gen["refits"]), checks=checks, iterations=train[0]["record"]["iterations"],
                losses=train[0]["record"]["losses"], closed=all(t["closed"] for t in train))


@pytest.fixture(scope="module")
def pretrain_runs(tmp_path_factory) -> dict:
    """Bridge's pretrain() with the refit callback, once with ``verify_serving: on`` and once
    ``off``; both tests below read them (its default, ``auto``, runs in the replicas test below)."""
    return {mode: run_pretrain_refit(str(tmp_path_factory.mktemp(mode)), verify_serving=mode) for mode in ("on", "off")}


def test_callback_inside_bridge_pretrain_with_overlapped_param_gather(pretrain_runs):
    """Bridge's own pretrain() (mock data, bf16, DistributedOptimizer, overlap_param_gather,
    TP1 x DP2), the refit switched on in the training YAML and the callback list built as
    docs/quickstart.md shows; bit-exact at the start and after every iteration."""
    result = pretrain_runs["on"]
    assert result["versions"] == list(range(PRETRAIN_ITERATIONS + 1))
    assert result["iterations"] == PRETRAIN_ITERATIONS and result["closed"]
    for version, check in result["checks"].items():
        assert check["bit_exact"], (version, check["diff"])
        assert check["dtypes"] == ["torch.bfloat16"]
        assert check["bytes_sent"] == check["bytes_minimal"] > 0
    losses = result["losses"]
    assert len(losses) == PRETRAIN_ITERATIONS and len(set(losses)) == PRETRAIN_ITERATIONS


def test_callback_verify_serving_inside_bridge_pretrain_changes_no_training(pretrain_runs):
    """The serving check's reference forward runs where the callback runs, inside Bridge's own
    pretrain() (bf16, DistributedOptimizer, overlap_param_gather, TP1 x DP2): with the check on
    every refit, the losses, every rank's generator states after every step and the
    weights the engine holds are those of the same training with the check off, bit for bit."""
    on, off = pretrain_runs["on"], pretrain_runs["off"]
    assert on["losses"] == off["losses"] and len(set(on["losses"])) == PRETRAIN_ITERATIONS
    for version in on["versions"]:
        a, b = on["checks"][version], off["checks"][version]
        assert a["bit_exact"] and b["bit_exact"], version
        assert a["rng"] == b["rng"], version  # no generator drawn from, nothing restored wrongly
        assert all(torch.equal(t, b["weights"][n]) for n, t in a["weights"].items()), version
        assert a["checked"] == 1 and a["dlogprob"] <= 0.05 / 5, a  # bf16: 5x under the default tolerance
        assert b["checked"] == 0


def _pretrain_fleet_rank(rank, world, port, yaml_path, megatron_port):
    import os

    from megatron_refit.config import load_training_yaml

    os.environ["TEST_REFIT_PORT"] = str(port)
    if rank < 2:
        return _pretrain_train(rank, 2, yaml_path, megatron_port, wait_joins=3)  # both configured, and the joiner
    refit = load_training_yaml(yaml_path)[1]
    if rank == 2:  # replica 0: every version
        return _gen(refit, range(PRETRAIN_ITERATIONS + 1), num_train=2)
    if rank == 3:  # replica 1: leaves after version 1
        return _gen(refit, [0, 1], num_train=2, gen_index=1)
    return _joining_gen(refit, num_train=2, gen_index=2)  # replica 2: not configured, joins while it runs


def test_callback_inside_bridge_pretrain_replicas_come_and_go(tmp_path):
    """Bridge's pretrain() with two engine replicas configured: one closes its refit after
    version 1 and leaves, a third starts beside the run and joins. Training runs to its end;
    every replica holds each version it took part in bit for bit (the joiner every one from its
    join on, the first in full); the metrics count, per version, the replicas that hold it."""
    import os

    path = os.path.join(str(tmp_path), "train.yaml")
    with open(path, "w") as f:
        # timeout_s 240: the engines wait that long for the trainer's store (Megatron's start-up
        # on two loaded cores beside three engine processes)
        f.write(TRAIN_YAML.replace("timeout_s: 120", "timeout_s: 240")
                + "  gen_dp: 2\n  on_replica_failure: continue\n  delta: 'on'\n")
    out = run_spawned(_pretrain_fleet_rank, 5, path, free_ports(1)[0], timeout_s=300)
    train, stays, leaves, joins = out[:2], out[2], out[3], out[4]
    assert train[0]["record"]["iterations"] == PRETRAIN_ITERATIONS and all(t["closed"] for t in train)
    assert sorted(leaves["refits"]) == [0, 1] and sorted(stays["refits"]) == list(range(PRETRAIN_ITERATIONS + 1))
    joined = sorted(joins["refits"])
    assert joined and joined == list(range(joined[0], PRETRAIN_ITERATIONS + 1)), joined
    assert not joins["refits"][joined[0]]["delta"] and all(joins["refits"][v]["delta"] for v in joined[1:])
    exports = train[0]["exports"]
    for gen in (stays, leaves, joins):
        for version, refit in gen["refits"].items():
            assert all(torch.equal(t, exports[version]["weights"][n]) for n, t in refit["weights"].items()), version
    holders = [sum(v in gen["refits"] for gen in (stays, leaves, joins)) for v in range(PRETRAIN_ITERATIONS + 1)]
    assert [exports[v]["replicas_ok"] for v in range(PRETRAIN_ITERATIONS + 1)] == holders


def _joining_gen(refit, num_train, gen_index=1):
    """An engine replica that was not there when training started (replica 1 of a run
    configured with one): it joins the running trainer and takes each version it sends."""
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.errors import RefitTransportError
    from megatron_refit.engine_side.entry import engine_refit

    backend = HFStorage.from_config(hf_config("qwen3"), dtype=torch.bfloat16)
    member = engine_refit(refit, backend, gen_index=gen_index, num_train=num_train)
    out = {}
    while True:
        try:
            report = member.receive()  # the version the trainer sends next
        except RefitTransportError:  # the trainer finished: its ranks are gone
            break
        out[report.version] = dict(weights={n: t.cpu() for n, t in backend.state_dict_hf().items()},
                                   delta=report.delta)
    return dict(role="gen", refits=out)


def _await_join(refit, replica: int, timeout_s: float = 120.0) -> None:
    """Until engine replica ``replica`` announced its join in the train ranks' store (however
    slowly the machine starts it, training does not end before it joins)."""
    import datetime
    import threading

    import torch.distributed as dist

    from megatron_refit.group.store import await_announced

    store = dist.TCPStore(refit.host, refit.port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    await_announced(store, replica, timeout_s, threading.Event())  # the fleet's own wait for a join


def _rank_with_joiner(rank, world, port, refit, megatron_port):
    if rank < 2:
        return _train(rank, 2, refit, 2, False, set(), megatron_port, wait_for_replica=1)
    if rank == 2:
        return _gen(refit, [0, *range(1, ITERATIONS + 1)], num_train=2)
    return _joining_gen(refit, num_train=2)


def test_callback_takes_in_a_replica_that_joins_while_training_runs():
    """RefitCallback under Bridge's callback manager (DDP + the distributed optimizer, train TP2)
    with one engine replica configured; a second one starts beside the run and joins at the
    next refit: from then on it holds every version bit for bit, the first one in full."""
    from megatron_refit.config import RefitConfig

    refit_port, megatron_port = free_ports(2)
    refit = RefitConfig(enabled=True, engine="hf", port=refit_port, bucket_mb=0.25, timeout_s=20, delta="on")
    out = run_spawned(_rank_with_joiner, 4, refit, megatron_port, timeout_s=300)
    train, first, joiner = out[0], out[2], out[3]
    versions = sorted(joiner["refits"])
    assert versions and versions == list(range(versions[0], ITERATIONS + 1)), versions  # every one since it joined
    assert not joiner["refits"][versions[0]]["delta"]  # the version it joined at, in full
    assert all(joiner["refits"][v]["delta"] for v in versions[1:])  # deltas afterwards
    exports = {0: train["start"], **{s["iteration"]: s["export"] for s in train["steps"]}}
    for version in versions:
        got, want = joiner["refits"][version]["weights"], exports[version]
        assert set(got) <= set(want) and all(torch.equal(got[n], want[n]) for n in got), version
        assert all(torch.equal(first["refits"][version]["weights"][n], got[n]) for n in got)  # the other replica too
