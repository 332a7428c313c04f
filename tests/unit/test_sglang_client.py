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
    """What :class:`TrainerFleet` does with its control on train rank 0 (its one caller): each
    starting replica's connect (a failed one recorded as the fleet aborts its join), each member
    replica's engine calls around its part of a refit (``broken``: replicas whose group breaks:
    no landing, dropped and forgotten), the control's close."""

    def __init__(self, control, started: threading.Event, members=(0, 1), broken=()):
        self.control, self.started = control, started
        self.members, self.broken = dict.fromkeys(members), set(broken)
        self.landed: dict = {}
        self.aborted: dict = {}
        for replica in control.replicas:
            future = control.connect(replica, num_train=2)
            future.add_done_callback(lambda f, r=replica: f.exception() is not None and self.aborted.update(
                {r: f"the {control.engine}'s connect call failed: {type(f.exception()).__name__}: {f.exception()}"}))

    def refit(self, version, *, full=False):
        for replica in self.members:
            self.control.start(replica, version, full)
        assert self.started.wait(5), "the engines' calls must run while the trainer refits"
        for replica in list(self.members):
            if replica in self.broken:
                del self.members[replica]
                self.control.forget(replica)
                continue
            try:
                self.control.land(replica, version)
                self.landed[replica] = "ok"
            except Exception as exc:  # noqa: BLE001 -- what the fleet records as the replica's failure
                self.landed[replica] = str(exc)
        return f"report {version}"


def _control(clients):
    from megatron_refit.engines.sglang.trainer.control import SglangControl

    return SglangControl(clients, RefitConfig(engine="sglang", timeout_s=5, gen_dp=len(clients) or 2))


def _closed(control) -> None:
    assert control.close(wait_s=5) == []  # every engine told, every lane ended


def test_sglang_control_drives_every_replica_and_resumes_only_those_that_landed():
    calls: list = []
    started = threading.Event()
    clients = [_Client(calls, started, replica=r) for r in range(2)]
    control = _control(clients)
    fleet = _Fleet(control, started)
    assert fleet.refit(3) == "report 3"
    assert sorted(c for c in calls if c[0] != "connect") == [("refit", 3, 0), ("refit", 3, 1), ("resume", 3, 0),
                                                             ("resume", 3, 1)]
    assert sorted(c for c in calls if c[0] == "connect") == [("connect", 0), ("connect", 1)]
    calls.clear()
    _closed(control)
    assert sorted(calls) == [("close", 0), ("close", 1)]


def test_sglang_control_a_failed_replica_stays_paused_and_is_named_alone():
    calls: list = []
    started = threading.Event()
    clients = [_Client(calls, started, replica=0), _Client(calls, started, fail="refit", replica=1),
               _Client(calls, started, fail="resume", replica=2), _Client(calls, started, replica=3)]
    control = _control(clients)
    fleet = _Fleet(control, started, members=(0, 1, 2, 3), broken=(3,))
    fleet.refit(6)
    assert fleet.landed[0] == "ok"
    assert fleet.landed[1] == ("SGLang engine replica 1: receiving version 6 failed: RuntimeError: "
                               "update_weights_from_tensor failed: boom")
    assert "replica 2: making version 6 live failed: RuntimeError: continue_generation answered 500" in \
        fleet.landed[2]
    assert ("resume", 6, 0) in calls and ("resume", 6, 1) not in calls and ("resume", 6, 3) not in calls
    assert control.replicas == [0, 1, 2]  # replica 3's group broke: its lane is gone, not waited for
    _closed(control)


def test_sglang_control_an_engine_refusing_connect_fails_its_connect_future_at_once():
    calls: list = []
    started = threading.Event()
    control = _control([_Client(calls, started), _Client(calls, started, fail="connect", replica=1)])
    fleet = _Fleet(control, started)
    deadline = time.monotonic() + 5
    while 1 not in fleet.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fleet.aborted == {1: "the SGLang engine's connect call failed: RuntimeError: the engine refused: "
                                "gen_tp mismatch"}
    _closed(control)


def test_sglang_control_a_joining_replica_connects_in_its_lane_then_takes_the_next_refit():
    calls: list = []
    started = threading.Event()
    control = _control([_Client(calls, started, replica=0)])
    fleet = _Fleet(control, started, members=(0,))
    joiner = _Client(calls, started, replica=5)
    joiner.connected.clear()  # SGLang's connect returns once the train ranks took it in
    connecting = control.connect(5, num_train=2, client=joiner)
    assert control.replicas == [0, 5] and not connecting.done()
    fleet.members[5] = None  # the train ranks took it in at the start of the refit
    joiner.connected.set()
    fleet.refit(7)
    assert calls.index(("connect", 5)) < calls.index(("refit", 7, 5)) < calls.index(("resume", 7, 5))
    assert fleet.landed == {0: "ok", 5: "ok"} and connecting.result(5) is None
    _closed(control)


def test_a_replica_added_while_the_trainer_runs_is_awaited_until_it_announces_or_its_timeout():
    """TrainerFleet.add's wait (megatron_refit.fleet.joins.Joins.await_announcement) over a real
    store: the announcement ends it; a connect call that ended first, or silence past
    refit.timeout_s, raises, named."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from torch.distributed import TCPStore

    from megatron_refit.errors import EngineLoadError
    from megatron_refit.fleet.joins import Joins
    from megatron_refit.fleet.runner import Runner
    from megatron_refit.group.store import JOINS
    from megatron_refit.local.ports import free_port

    store = TCPStore("127.0.0.1", free_port(), 1, True, timeout=__import__("datetime").timedelta(seconds=5))
    runner = Runner()
    joins = Joins(RefitConfig(engine="sglang", timeout_s=0.3, gen_dp=1), SimpleNamespace(rank=0, store=store),
                  runner, SimpleNamespace(), threading.Event(), connect=None, member=None)
    assert joins.announced(1) is None
    pending = Future()
    threading.Timer(0.05, lambda: store.set(f"{JOINS}/1", "incarnation-a")).start()
    joins.await_announcement(1, None, pending, "SGLang engine")
    assert joins.announced(1) == "incarnation-a"
    with pytest.raises(EngineLoadError, match="SGLang engine replica 2 did not announce its join within "
                                              "refit.timeout_s=0.3 s"):
        joins.await_announcement(2, None, pending, "SGLang engine")
    ended = Future()
    ended.set_exception(RuntimeError("init_info refused"))
    with pytest.raises(RuntimeError, match="init_info refused"):
        joins.await_announcement(2, None, ended, "SGLang engine")
    ended = Future()
    ended.set_result(None)
    with pytest.raises(RuntimeError, match="SGLang engine replica 2: its connect call returned before it joined"):
        joins.await_announcement(2, None, ended, "SGLang engine")
    assert runner.close() == []


def test_engine_sglang_plans_the_engine_layout_and_writes_in_place():
    from megatron_refit.config import RefitConfig

    assert RefitConfig(engine="sglang").gen_style == RefitConfig(engine="vllm").gen_style == "vllm"
    assert RefitConfig(engine="hf").gen_style == "full"
    with pytest.raises(ValueError, match="engine_load must be 'in_place', got 'load_weights'"):
        RefitConfig(engine="sglang", engine_load="load_weights")
    with pytest.raises(ValueError, match="refit.swap 'staged' is not offered for engine 'sglang'"):
        RefitConfig(engine="sglang", swap="staged")
