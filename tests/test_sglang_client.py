"""The SGLang control plane without SGLang: control messages, their wire format, the
loader's refusals, and how the trainer drives several engine replicas around its own refit.
(The real SGLang weight-update path runs in tests/sglang.)"""

from __future__ import annotations

import base64
import io
import pickle
import threading

import pytest
import torch

from megatron_refit.engines.sglang.loader import LOADER, parse_message, refit_loader, refit_state
from megatron_refit.engines.sglang.client import (
    HTTPClient,
    close_engines,
    connect_message,
    refit_engines,
    refit_message,
    serialize,
)


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
    refusal is kept on the model instead, and the next call clears it."""
    model = torch.nn.Linear(2, 2)
    empty = torch.empty(0, dtype=torch.uint8)
    refit_loader(model, [("model.embed_tokens.weight", torch.zeros(2))])
    assert "no megatron_refit control message" in model.megatron_refit_error
    refit_loader(model, refit_message(1))
    assert "never connected" in model.megatron_refit_error
    refit_loader(model, [("megatron_refit.connect:" + '{"refit": {"engine": "vllm"}, "num_train": 2}', empty)])
    assert "refit.engine is 'vllm'" in model.megatron_refit_error
    assert refit_state(model) == dict(connected=False, state=None, weights_version=None,
                                      error=model.megatron_refit_error)
    refit_loader(model, [])
    assert model.megatron_refit_error is None


def test_http_client_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tp must be a positive int"):
        HTTPClient("http://x", tp=0)
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        HTTPClient("http://x", tp=1, pause_mode="in_place")


class _Client:
    """A replica's control calls, recorded (rendezvous with the trainer as the real ones do)."""

    def __init__(self, calls: list, started: threading.Event, fail: str | None = None):
        self.calls, self.started, self.fail = calls, started, fail

    def refit(self, version, *, full=False):
        self.calls.append(("refit", version))
        self.started.set()
        if self.fail == "refit":
            raise RuntimeError("update_weights_from_tensor failed: boom")

    def resume(self, version):
        self.calls.append(("resume", version))

    def close(self):
        self.calls.append(("close",))


class _Trainer:
    def __init__(self, started: threading.Event, fail: bool = False):
        self.started, self.fail = started, fail

    def refit(self, version, *, full=False):
        assert self.started.wait(5), "the engines' calls must run while the trainer refits"
        if self.fail:
            raise RuntimeError("rank 1 failed: digest mismatch")
        return f"report {version}"

    def close(self):
        pass


def test_refit_engines_drives_every_replica_and_resumes_only_after_success():
    calls: list = []
    started = threading.Event()
    clients = [_Client(calls, started), _Client(calls, started)]
    assert refit_engines(_Trainer(started), clients, 3, rank=0) == "report 3"
    assert sorted(calls) == [("refit", 3)] * 2 + [("resume", 3)] * 2
    calls.clear()
    started.clear()  # other train ranks send only: they never call the engines
    started.set()
    assert refit_engines(_Trainer(started), clients, 4, rank=1) == "report 4"
    assert calls == []
    close_engines(_Trainer(started), clients, rank=0)
    assert calls == [("close",)] * 2


def test_a_failed_refit_leaves_every_engine_paused_and_names_the_cause():
    calls: list = []
    started = threading.Event()
    with pytest.raises(RuntimeError, match="digest mismatch"):  # the trainer's own error first
        refit_engines(_Trainer(started, fail=True), [_Client(calls, started)], 5, rank=0)
    assert calls == [("refit", 5)]  # no resume
    calls.clear()
    started.clear()
    with pytest.raises(RuntimeError, match="replica 1: refit 6: update_weights_from_tensor failed: boom"):
        refit_engines(_Trainer(started), [_Client(calls, started), _Client(calls, started, fail="refit")], 6, rank=0)
    assert ("resume", 6) not in calls


def test_engine_sglang_plans_the_engine_layout_and_writes_in_place():
    from megatron_refit.config import RefitConfig

    assert RefitConfig(engine="sglang").gen_style == RefitConfig(engine="vllm").gen_style == "vllm"
    assert RefitConfig(engine="hf").gen_style == "full"
    with pytest.raises(ValueError, match="engine_load must be 'in_place', got 'load_weights'"):
        RefitConfig(engine="sglang", engine_load="load_weights")
    with pytest.raises(ValueError, match="refit.swap 'staged' is not offered for engine 'sglang'"):
        RefitConfig(engine="sglang", swap="staged")
