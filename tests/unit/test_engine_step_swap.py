"""The staged swap as one pause of vLLM's engine core (``megatron_refit.engines.vllm.server_swap``)
and ``HTTPClient``'s use of it, without vLLM: a fake ``EngineClient`` that records the order in
which the engine core would receive each utility call, and a standard-library HTTP server for
the client. The running server's own test is ``tests/engines/vllm_server/test_vllm_server_swap.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_refit.engines.vllm.payload import parse_swap_payload, swap_payload
from megatron_refit.engines.vllm.server_swap import engine_step_swap
from megatron_refit.engines.vllm.trainer.clients import HTTPClient


class FakeEngine:
    """vLLM's ``EngineClient`` as the swap uses it: each call's message is 'sent' when its
    coroutine starts (as ``call_utility_async`` sends before its first suspension) and answered
    after ``delay_s``."""

    def __init__(self, *, swap_error: Exception | None = None, reset: bool = True, delay_s: float = 0.001):
        self.sent: list[tuple] = []
        self.paused_at = None
        self.swap_error, self.reset, self.delay_s = swap_error, reset, delay_s

    async def _answer(self, *message):
        self.sent.append(message)
        await asyncio.sleep(self.delay_s)

    async def sleep(self, *, level, mode):
        await self._answer("sleep", level, mode)  # vLLM answers once no step runs, no fixed sleep after
        self.paused_at = len(self.sent)  # what the engine had received when the pause answered

    async def collective_rpc(self, method):
        await self._answer("collective_rpc", method)
        if self.swap_error is not None:
            raise self.swap_error

    async def get_weight_version(self):
        return "3"

    async def reset_prefix_cache(self, reset_running_requests=False):
        await self._answer("reset_prefix_cache", reset_running_requests)
        return self.reset

    async def update_weight_version(self, version):
        await self._answer("set_weight_version", version)

    async def wake_up(self, tags):
        await self._answer("wake_up", tags)
        return True


def _swap(engine, version="4", kv="recompute", settle=False):
    return asyncio.run(engine_step_swap(engine, version, kv, settle=settle))


SWAP = ["sleep", "collective_rpc", "reset_prefix_cache", "set_weight_version"]
RESUME = ("wake_up", ["scheduling"])


def test_engine_step_swap_pauses_the_scheduler_swaps_resets_labels_and_resumes():
    engine = FakeEngine()
    answer = _swap(engine)
    assert [m[0] for m in engine.sent] == SWAP + ["wake_up"] and engine.sent[-1] == RESUME
    assert engine.sent[0] == ("sleep", 0, "keep")  # vLLM's level 0: the scheduler paused, requests kept
    assert engine.sent[1] == ("collective_rpc", "finish_weight_update")
    assert engine.sent[2] == ("reset_prefix_cache", True)  # the requests in flight recompute their KV
    assert answer["kv"] == "recompute" and answer["weight_version"] == "4" and answer["prefix_cache_reset"]
    assert 0 < answer["held_s"] <= answer["blocked_s"] < 0.02, answer
    assert engine.paused_at > 1 and not answer["settled"]  # the burst went out right behind the pause


def test_engine_step_swap_settles_the_pause_first_when_a_batch_may_be_in_flight():
    engine = FakeEngine()
    answer = _swap(engine, settle=True)
    assert [m[0] for m in engine.sent] == SWAP + ["wake_up"] and answer["settled"]
    assert engine.paused_at == 1  # nothing of the swap was sent before the pause answered


def test_engine_step_swap_keep_leaves_the_requests_in_flight_and_drops_the_prefix_cache_only_if_it_can():
    engine = FakeEngine(reset=False)  # requests hold blocks: vLLM cannot reset the prefix cache
    answer = _swap(engine, kv="keep")
    assert ("reset_prefix_cache", False) in engine.sent and engine.sent[-1] == RESUME
    assert answer["kv"] == "keep" and answer["prefix_cache_reset"] is False


def test_engine_step_swap_that_fails_in_the_engine_stays_paused_with_the_label_it_served():
    engine = FakeEngine(swap_error=RuntimeError("injected: half the layers swapped"))
    with pytest.raises(RuntimeError, match="injected"):
        _swap(engine)
    assert [m[0] for m in engine.sent] == SWAP + ["set_weight_version"]  # no wake_up
    assert engine.sent[-1] == ("set_weight_version", "3")


def test_engine_step_swap_whose_kv_reset_fails_under_recompute_stays_paused():
    engine = FakeEngine(reset=False)
    with pytest.raises(RuntimeError, match="prefix cache could not be reset"):
        _swap(engine, kv="recompute")
    assert RESUME not in engine.sent and engine.sent[-1] == ("set_weight_version", "3")


@pytest.mark.parametrize("body, field", [([], "JSON object"), ({"kv": "drop"}, "kv must be one of"),
                                         ({"weight_version": 4}, "weight_version must be a string"),
                                         ({"version": "4"}, "unknown field")])
def test_swap_payload_refuses_a_bad_body_naming_the_field(body, field):
    with pytest.raises(ValueError, match=field):
        parse_swap_payload(body)
    assert parse_swap_payload(swap_payload("7", "keep")) == ("7", "keep")


class _Server:
    """An HTTP server that answers every POST with ``{}`` (``{"success": true}`` for the prefix
    cache reset, the swap's answer for the swap route unless ``route`` is False: 404), recording paths."""

    def __init__(self, route: bool):
        paths = self.paths = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                paths.append(self.path)
                if self.path == "/megatron_refit/swap" and not route:
                    self.send_response(404)
                    self.end_headers()
                    self.wfile.write(b'{"detail": "Not Found"}')
                    return
                answer = {"success": True} if self.path.startswith("/reset_prefix_cache") else {}
                if self.path == "/megatron_refit/swap":
                    answer = dict(blocked_s=0.005, kv=body["kv"], weight_version=body.get("weight_version"))
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-vllm-server", daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_http_client_in_flight_swaps_with_one_call_to_the_engine_step_route(kv):
    server = _Server(route=True)
    try:
        client = HTTPClient(server.url, swap="staged", policy="in_flight", kv=kv)
        client.finish_weight_update("3")
        client.finish_weight_update("4")
    finally:
        server.close()
    assert server.paths == ["/megatron_refit/swap"] * 2
    assert client.engine_step and client.last_swap == dict(blocked_s=0.005, kv=kv, weight_version="4")


@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_http_client_without_the_route_falls_back_to_the_pause_once_warned(caplog, kv):
    server = _Server(route=False)
    try:
        client = HTTPClient(server.url, swap="staged", policy="in_flight", kv=kv)
        with caplog.at_level(logging.WARNING):
            client.finish_weight_update("3")
            client.finish_weight_update("4")
    finally:
        server.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "VLLM_PLUGINS=megatron_refit" in warnings[0] and "/pause" in warnings[0]
    reset = "/reset_prefix_cache?reset_running_requests=true" if kv == "recompute" else "/reset_prefix_cache"
    assert server.paths == ["/megatron_refit/swap", "/pause?mode=keep", "/finish_weight_update", reset, "/resume",
                            "/pause?mode=keep", "/finish_weight_update", reset, "/resume"]
    assert client.engine_step is False and client.last_swap is None


def test_http_client_refuses_kv_keep_outside_in_flight_and_an_unknown_kv():
    with pytest.raises(ValueError, match="kv='keep' needs policy='in_flight'"):
        HTTPClient("http://127.0.0.1:1", swap="staged", kv="keep")
    with pytest.raises(ValueError, match="kv must be one of"):
        HTTPClient("http://127.0.0.1:1", swap="staged", policy="in_flight", kv="drop")
