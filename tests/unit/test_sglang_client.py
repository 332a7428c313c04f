"""The SGLang control plane without SGLang: control messages, their wire format, the
loader's refusals, and how the trainer drives several engine replicas around its own refit.
(The real SGLang weight-update path runs in tests/engines/sglang.)"""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time

import pytest
import torch

from megatron_refit.engines.sglang.messages import LOADER, parse_message
from megatron_refit.engines.sglang.worker.loader import refit_loader, refit_state
from megatron_refit.config import RefitConfig
from megatron_refit.engines.sglang.messages import connect_message, refit_message
from megatron_refit.engines.sglang.trainer.client import HTTPClient, serialize


def test_control_messages_round_trip_through_the_wire_format():
    refit = {"gen_tp": 2, "port": 29600, "engine": "sglang"}
    for message, op, args in ((connect_message(refit, num_train=4, replica=1), "connect",
                               {"refit": refit, "num_train": 4, "replica": 1}),
                              (refit_message(7, full=True), "refit", {"version": 7, "full": True})):
        # what SGLang's SafeUnpickler reads back is a plain pickle: base64 of ForkingPickler bytes
        (name, tensor), = pickle.load(io.BytesIO(base64.b64decode(serialize(message))))
        assert tensor.numel() == 0 and parse_message(name) == (op, args)
    assert LOADER == f"{refit_loader.__module__}.{refit_loader.__name__}"


@pytest.mark.parametrize("name,expected", [
    ("model.layers.0.weight", "no megatron_refit control message"),
    ("megatron_refit.bogus:{}", "no megatron_refit control message"),
    ("megatron_refit.refit:[1]", "must be a JSON object"),
])
def test_bad_control_messages_are_named(name, expected):
    with pytest.raises(ValueError, match=expected):
        parse_message(name)


def test_the_loader_never_raises_into_the_engine():
    """SGLang does not catch a custom loader's exception (it would end the scheduler): every
    refusal is kept for refit_state instead (beside the model, not on it), and the next call
    clears it."""
    model = torch.nn.Linear(2, 2)
    empty = torch.empty(0, dtype=torch.uint8)
    refit_loader(model, [("model.embed_tokens.weight", torch.zeros(2))])
    assert "no megatron_refit control message" in refit_state(model)["error"]
    refit_loader(model, refit_message(1))
    assert "never connected" in refit_state(model)["error"]
    refit_loader(model, [("megatron_refit.connect:" + '{"refit": {"engine": "vllm"}, "num_train": 2}', empty)])
    assert "refit.engine is 'vllm'" in refit_state(model)["error"]
    assert refit_state(model) == dict(connected=False, state=None, weights_version=None,
                                      error=refit_state(model)["error"])
    refit_loader(model, [])
    assert refit_state(model)["error"] is None
    assert not any(name.startswith(("_megatron", "megatron")) for name in vars(model))  # nothing hung on it


def test_http_client_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tp must be a positive int"):
        HTTPClient("http://x", tp=0)
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        HTTPClient("http://x", tp=1, pause_mode="in_place")
    with pytest.raises(ValueError, match=r"attention_dp must be a positive int .*, got 0"):
        HTTPClient("http://x", tp=1, attention_dp=0)


def _answer(body: dict) -> list[dict]:
    """SGLang's generate answer: each prompt token's (log-prob, token id, text), the log-prob -0.5 minus the
    DP rank it was routed to (SGLang's ``routed_dp_rank``; 0 where none)."""
    rank = body.get("routed_dp_rank") or 0
    return [{"meta_info": {"input_token_logprobs": [[None if i == 0 else -0.5 - rank, t, ""] for i, t in enumerate(s)]}}
            for s in body["input_ids"]]


def test_with_dp_attention_the_probe_goes_through_every_dp_rank():
    """#64: an SGLang engine with DP attention serves each request from one DP rank's attention copy: the
    clients score the probe through each (``routed_dp_rank``), as PathScores the verdict judges path by path."""
    import http.server
    import json

    from megatron_refit.engines.sglang.trainer.client import EngineClient
    from megatron_refit.fleet.serving import PathScores

    class Engine:
        def generate(self, **body):
            return _answer(body)

    assert EngineClient(Engine()).score([[1, 2, 3]]) == [[-0.5, -0.5]]
    scored = EngineClient(Engine(), attention_dp=2).score([[1, 2, 3]])
    assert scored == PathScores((("DP rank 0", [[-0.5, -0.5]]), ("DP rank 1", [[-1.5, -1.5]])))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answer = json.dumps(_answer(body)).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="test-sglang-http", daemon=True)
    thread.start()
    try:
        client = HTTPClient(f"http://127.0.0.1:{server.server_port}", tp=4, attention_dp=2, timeout=10)
        assert client.score([[4, 5]]) == PathScores((("DP rank 0", [[-0.5]]), ("DP rank 1", [[-1.5]])))
    finally:
        server.shutdown()
        thread.join(5)


class _Client:
    """A replica's control calls, recorded (rendezvous with the trainer as the real ones do)."""

    def __init__(self, calls: list, started: threading.Event, fail: str | None = None, replica: int = 0):
        self.calls, self.started, self.fail, self.replica = calls, started, fail, replica
        self.connected = threading.Event()
        self.connected.set()  # a starting replica: the train ranks take it in at once

    def connect(self, refit, *, num_train, replica=0):
        self.calls.append(("connect", replica))
        if self.fail == "connect":
            raise RuntimeError("the engine refused: gen_tp mismatch")
        self.connected.wait(5)  # SGLang's connect returns once the train ranks took it in

    def refit(self, version, *, full=False):
        self.calls.append(("refit", version, self.replica))
        self.started.set()
        if self.fail == "refit":
            raise RuntimeError("update_weights_from_tensor failed: boom")

    def resume(self, version):
        self.calls.append(("resume", version, self.replica))
        if self.fail == "resume":
            raise RuntimeError("continue_generation answered 500")

    def close(self):
        self.calls.append(("close", self.replica))


class _Fleet:
    """The train ranks' side as :class:`TrainerFleet` runs it on rank 0: its runner, the hooks the
    control builds it with (``join(hooks)``), each member replica's engine calls around its part (``broken``: replicas
    whose group breaks: no landing, dropped and forgotten)."""

    def __init__(self, started: threading.Event, members=(0, 1), broken=()):
        from megatron_refit.fleet.runner import Runner

        self.runner = Runner()
        self.started, self.members, self.broken = started, dict.fromkeys(members), set(broken)
        self.landed: dict = {}
        self.joins: dict = {}
        self.aborted: dict = {}
        self.hooks = None

    def await_start(self):
        pass

    def abort_join(self, replica, reason):
        self.aborted[replica] = reason

    def refit(self, version, *, full=False):
        if self.hooks is None:  # a train rank other than 0
            return f"report {version}"
        for replica in self.members:
            self.hooks.start(replica, version, full)
        assert self.started.wait(5), "the engines' calls must run while the trainer refits"
        for replica in list(self.members):
            if replica in self.broken:
                del self.members[replica]
                self.hooks.forget(replica)
                continue
            try:
                self.hooks.land(replica, version)
                self.landed[replica] = "ok"
            except Exception as exc:  # noqa: BLE001 -- what the fleet records as the replica's failure
                self.landed[replica] = str(exc)
        return f"report {version}"

    def announced(self, replica):
        return self.joins.get(replica)

    def run_in_lane(self, lane, call, *args):
        return self.runner.submit(lane, call, *args)

    def retire_lane(self, lane):
        self.runner.retire(lane)

    def close(self):
        assert self.runner.close() == []


def _connected(clients, fleet, rank=0):
    from megatron_refit.engines.sglang.trainer.control import SglangControl

    # rank > 0: no clients
    control = SglangControl(clients, RefitConfig(engine="sglang", timeout_s=5, gen_dp=len(clients) or 2))
    def join(hooks):
        assert hooks is (control if rank == 0 else None)  # train rank 0's fleet runs the control's calls
        fleet.hooks = hooks
        return fleet

    assert control.connect(join, rank=rank, num_train=2) is fleet
    return control


def test_sglang_control_drives_every_replica_and_resumes_only_those_that_landed():
    calls: list = []
    started = threading.Event()
    clients = [_Client(calls, started, replica=r) for r in range(2)]
    fleet = _Fleet(started)
    control = _connected(clients, fleet)
    assert fleet.refit(3) == "report 3"
    assert sorted(c for c in calls if c[0] != "connect") == [("refit", 3, 0), ("refit", 3, 1), ("resume", 3, 0),
                                                             ("resume", 3, 1)]
    assert sorted(c for c in calls if c[0] == "connect") == [("connect", 0), ("connect", 1)]
    calls.clear()
    other = _Fleet(started)
    _connected([], other, rank=1)
    assert other.refit(4) == "report 4"  # other train ranks send only
    assert calls == [] and other.hooks is None
    control.close(fleet, rank=0)
    assert sorted(calls) == [("close", 0), ("close", 1)]


def test_sglang_control_a_failed_replica_stays_paused_and_is_named_alone():
    calls: list = []
    started = threading.Event()
    clients = [_Client(calls, started, replica=0), _Client(calls, started, fail="refit", replica=1),
               _Client(calls, started, fail="resume", replica=2), _Client(calls, started, replica=3)]
    fleet = _Fleet(started, members=(0, 1, 2, 3), broken=(3,))
    control = _connected(clients, fleet)
    fleet.refit(6)
    assert fleet.landed[0] == "ok"
    assert fleet.landed[1] == ("SGLang engine replica 1: receiving version 6 failed: RuntimeError: "
                               "update_weights_from_tensor failed: boom")
    assert "replica 2: making version 6 live failed: RuntimeError: continue_generation answered 500" in \
        fleet.landed[2]
    assert ("resume", 6, 0) in calls and ("resume", 6, 1) not in calls and ("resume", 6, 3) not in calls
    assert control.replicas == [0, 1, 2]  # replica 3's group broke: its lane is gone, not waited for
    control.close(fleet, rank=0)


def test_sglang_control_an_engine_refusing_connect_aborts_its_join_at_once():
    calls: list = []
    started = threading.Event()
    fleet = _Fleet(started)
    control = _connected([_Client(calls, started), _Client(calls, started, fail="connect", replica=1)], fleet)
    deadline = time.monotonic() + 5
    while 1 not in fleet.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fleet.aborted == {1: "the SGLang engine's connect call failed: RuntimeError: the engine refused: "
                                "gen_tp mismatch"}
    control.close(fleet, rank=0)


def test_sglang_control_a_joining_replica_connects_in_its_lane_then_takes_the_next_refit():
    calls: list = []
    started = threading.Event()
    fleet = _Fleet(started, members=(0,))
    control = _connected([_Client(calls, started, replica=0)], fleet)
    joiner = _Client(calls, started, replica=5)
    joiner.connected.clear()
    # the join is announced once its connect call ran (engine_refit announces, then waits for the train ranks)
    original = joiner.connect

    def connect(refit, *, num_train, replica=0):
        fleet.joins[replica] = "incarnation"
        original(refit, num_train=num_train, replica=replica)

    joiner.connect = connect
    assert control.add(joiner, replica=5) == 5
    fleet.members[5] = None  # the train ranks took it in at the start of the refit
    joiner.connected.set()
    fleet.refit(7)
    assert calls.index(("connect", 5)) < calls.index(("refit", 7, 5)) < calls.index(("resume", 7, 5))
    assert fleet.landed == {0: "ok", 5: "ok"}
    with pytest.raises(ValueError, match="replica must be a non-negative int, got -1"):
        control.add(_Client(calls, started), replica=-1)
    control.close(fleet, rank=0)


def test_sglang_control_a_replica_that_never_announces_is_refused_in_its_timeout():
    from megatron_refit.errors import EngineLoadError

    calls: list = []
    started = threading.Event()
    fleet = _Fleet(started, members=(0,))
    control = _connected([_Client(calls, started)], fleet)
    control.timeout_s = 0.3
    silent = _Client(calls, started)
    silent.connected.clear()  # blocks, never announces
    with pytest.raises(EngineLoadError, match="replica 1 did not announce its join within refit.timeout_s=0.3 s"):
        control.add(silent)
    assert control.replicas == [0]
    silent.connected.set()
    control.close(fleet, rank=0)
    with pytest.raises(ValueError, match="SglangControl.add: only train rank 0, after connect, takes in engines"):
        _connected([], _Fleet(started), rank=1).add(silent)


def test_engine_sglang_plans_the_engine_layout_and_writes_in_place():
    from megatron_refit.config import RefitConfig

    assert RefitConfig(engine="sglang").gen_style == RefitConfig(engine="vllm").gen_style == "vllm"
    assert RefitConfig(engine="hf").gen_style == "full"
    with pytest.raises(ValueError, match="engine_load must be 'in_place', got 'load_weights'"):
        RefitConfig(engine="sglang", engine_load="load_weights")
    with pytest.raises(ValueError, match="refit.swap 'staged' is not offered for engine 'sglang'"):
        RefitConfig(engine="sglang", swap="staged")
