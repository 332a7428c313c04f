"""The trainer side of the vLLM weight-transfer backend in a Megatron environment (no vLLM).

Megatron training environments often lack vLLM (its transformers pins differ from
Megatron-Bridge's): the trainer engine, its payloads and the control-plane clients must
import and work without it. ``HTTPClient`` is checked against a real HTTP server on
loopback that records the routes, in the order vLLM's RL routes expect them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from megatron_refit.config import RefitConfig


def test_weight_transfer_trainer_side_imports_without_vllm():
    code = ("import sys, importlib.util\n"
            "assert importlib.util.find_spec('vllm') is None, 'this check needs an environment without vLLM'\n"
            "from megatron_refit.engines.vllm import payload, plugin\n"
            "from megatron_refit.engines.vllm.trainer import clients, engine\n"
            "assert not engine.HAVE_VLLM and 'vllm' not in sys.modules\n"
            "info = engine.MegatronRefitTrainerInitInfo(refit={'gen_tp': 2}, num_train=2, rank=0)\n"
            "assert info.is_sender and info.config.gen_tp == 2 and info.backend == 'megatron_refit'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_weight_transfer_trainer_init_info_names_the_bad_field():
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerInitInfo

    with pytest.raises(ValueError, match=r"init_info\.rank 2 outside 0\.\.1"):
        MegatronRefitTrainerInitInfo(refit={}, num_train=2, rank=2)
    with pytest.raises(ValueError, match=r"init_info\.num_train must be an int >= 1"):
        MegatronRefitTrainerInitInfo(refit={}, num_train=0, rank=0)
    with pytest.raises(ValueError, match=r"refit\.gen_dp must be positive"):
        MegatronRefitTrainerInitInfo(refit={"gen_dp": 0}, num_train=1, rank=0)
    with pytest.raises(ValueError, match=r"init_info\.refit must be the refit: config section"):
        MegatronRefitTrainerInitInfo(refit="vllm", num_train=1, rank=0)


class _RecordingLLM:
    """Records the calls LLMClient makes (the offline LLM's RL methods, by name)."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.calls.append((name, args))


def test_weight_transfer_llm_client_resets_the_prefix_cache_after_each_update():
    from megatron_refit.engines.vllm.trainer.clients import LLMClient

    llm = _RecordingLLM()
    client = LLMClient(llm)
    client.init_weight_transfer_engine({"a": 1})
    client.start_weight_update()
    client.update_weights({"version": 3})
    client.finish_weight_update("3")
    assert llm.calls == [("init_weight_transfer_engine", ({"init_info": {"a": 1}},)), ("start_weight_update", ()),
                         ("update_weights", ({"update_info": {"version": 3}},)), ("finish_weight_update", ("3",)),
                         ("reset_prefix_cache", ())]


@pytest.fixture
def server():
    """A loopback HTTP server that records (path, JSON body) and answers 200, or 400 for /bad, or
    404 for the engine-step swap route (a server started without megatron_refit's endpoint plugin)."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 -- http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            seen.append((self.path, json.loads(body) if body else None))
            self.send_response(400 if self.path.startswith("/bad") else 404 if "megatron_refit" in self.path else 200)
            self.end_headers()
            answer = b'{"success": %s}' % (b"false" if "fail" in self.path else b"true")
            self.wfile.write(b'{"error": "no such thing"}' if self.path.startswith("/bad") else
                             answer if self.path.startswith("/reset_prefix_cache") else b"{}")

        def log_message(self, *args):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    httpd.shutdown()


def test_weight_transfer_http_client_pauses_generation_around_each_update(server):
    from megatron_refit.engines.vllm.trainer.clients import HTTPClient
    from megatron_refit.engines.vllm.payload import update_payload

    url, seen = server
    client = HTTPClient(url + "/", timeout=10)
    client.init_weight_transfer_engine({"num_train": 2})
    client.start_weight_update()
    client.update_weights(update_payload(7, full=True))
    client.finish_weight_update("7")
    client.shutdown_weight_transfer_engine()
    assert seen == [("/init_weight_transfer_engine", {"init_info": {"num_train": 2}}),
                    ("/pause?mode=wait&clear_cache=true", None), ("/start_weight_update", None),
                    ("/update_weights", {"update_info": {"version": 7, "full": True, "complete": False}}),
                    ("/finish_weight_update", {"weight_version": "7"}), ("/resume", None),
                    ("/shutdown_weight_transfer_engine", None)]
    with pytest.raises(RuntimeError, match=r"POST /bad answered 400: .*no such thing"):
        client._post("bad")
    with pytest.raises(ValueError, match="pause_mode must be one of"):
        HTTPClient(url, pause_mode="never")
    # refit.swap: staged: the server serves while the bytes land in staging, and pauses only
    # for finish_weight_update (the load from staging)
    seen.clear()
    staged = HTTPClient(url, timeout=10, swap="staged")
    staged.start_weight_update()
    staged.update_weights(update_payload(8, full=False))
    staged.finish_weight_update("8")
    assert [path for path, _ in seen] == ["/start_weight_update", "/update_weights",
                                          "/pause?mode=wait&clear_cache=true", "/finish_weight_update", "/resume"]
    with pytest.raises(ValueError, match="swap must be 'in_place' or 'staged'"):
        HTTPClient(url, swap="sometimes")


def test_weight_transfer_http_client_in_flight_keeps_requests_for_the_swap_alone(server):
    """policy in_flight on a server without the engine-step swap route: the requests in flight are
    kept (pause mode keep, no drain) for the swap, then re-run their KV under the new version (the
    prefix cache reset with the running requests), then resume; a reset the server refuses leaves
    it paused, named."""
    from megatron_refit.engines.vllm.trainer.clients import HTTPClient

    url, seen = server
    client = HTTPClient(url, timeout=10, swap="staged", policy="in_flight")
    client.start_weight_update()
    client.update_weights({"version": 9})
    client.finish_weight_update("9")
    assert [path for path, _ in seen] == ["/start_weight_update", "/update_weights", "/megatron_refit/swap",
                                          "/pause?mode=keep",
                                          "/finish_weight_update", "/reset_prefix_cache?reset_running_requests=true",
                                          "/resume"]
    seen.clear()
    failing = HTTPClient(url, timeout=10, swap="staged", policy="in_flight")
    failing._post = lambda path, body=None, post=failing._post, **kw: post(
        path.replace("reset_running", "fail_running"), body, **kw)
    with pytest.raises(RuntimeError, match=r"prefix cache could not be reset .*success.*False.*stays paused"):
        failing.finish_weight_update("10")
    assert [path for path, _ in seen][-1].startswith("/reset_prefix_cache")  # no /resume
    with pytest.raises(ValueError, match=r"policy 'in_flight' needs swap='staged'.*got swap='in_place'"):
        HTTPClient(url, policy="in_flight")
    with pytest.raises(ValueError, match=r"policy must be one of \['drain', 'in_flight'\], got 'keep'"):
        HTTPClient(url, swap="staged", policy="keep")


def test_weight_transfer_vllm_control_gives_each_engine_its_replica(server):
    from megatron_refit.engines.vllm.trainer.clients import HTTPClient, ReplicaClients
    from megatron_refit.engines.vllm.trainer.control import VllmControl

    url, seen = server
    control = VllmControl([HTTPClient(url), HTTPClient(url)], RefitConfig(engine="vllm", gen_dp=2), lora=(4, 8.0))
    for replica, client in enumerate(control.clients):
        control.connect_call(replica, 3)(client)
    infos = [body["init_info"] for _, body in seen]
    assert [i["replica"] for i in infos] == [0, 1]
    assert all(i["num_train"] == 3 and (i["lora_rank"], i["lora_alpha"]) == (4, 8.0) for i in infos)
    with pytest.raises(ValueError, match="at least one client"):
        ReplicaClients([])
    with pytest.raises(ValueError, match=r"1 engine clients for refit.gen_dp=2"):
        VllmControl([HTTPClient(url)], RefitConfig(engine="vllm", gen_dp=2))


def test_weight_transfer_vllm_control_staged_lands_by_waiting_for_the_staging_before_the_pause(server):
    """swap: staged: the land waits for the staging and its preparation in update_weights (so a
    failure there ends vLLM's update session, before any pause), then pauses for the swap."""
    from megatron_refit.engines.vllm.trainer.clients import HTTPClient
    from megatron_refit.engines.vllm.trainer.control import VllmControl

    url, seen = server
    control = VllmControl([HTTPClient(url, swap="staged")],
                          RefitConfig(engine="vllm", swap="staged", engine_load="load_weights"))
    control.receive_call(5, full=True)(control.clients[0])
    control.land_call(5)(control.clients[0])
    assert seen == [("/start_weight_update", None),
                    ("/update_weights", {"update_info": {"version": 5, "full": True, "complete": False}}),
                    ("/update_weights", {"update_info": {"version": 5, "full": True, "complete": True}}),
                    ("/pause?mode=wait&clear_cache=true", None), ("/finish_weight_update", {"weight_version": "5"}),
                    ("/resume", None)]


def _source_rank(rank, world, port):
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.presets import hf_config
    from conversion.local_shards import enumerate_local_shards
    from conversion.lora import apply_lora
    from megatron_refit.plan.layout import TrainLayout
    from conversion.refit import local_shard_source

    init_gloo(rank, world, port)
    init_model_parallel(TrainLayout())
    cfg = hf_config("qwen3")
    built = build_model(cfg, TrainLayout())
    plain = local_shard_source(built.bridge, built.model, cfg)
    lora_model = apply_lora(build_model(cfg, TrainLayout()).model, dim=4, alpha=8)
    lora = local_shard_source(built.bridge, lora_model, cfg)
    return dict(plain=sorted(p.spec.name for p in plain.weights), expected=sorted(
        s.spec.name for s in enumerate_local_shards(built.bridge, built.model, cfg)),
        plain_lora=(plain.lora_rank, len(plain.adapters)), lora=(lora.lora_rank, lora.lora_alpha, len(lora.adapters)),
        device=str(lora.device))


@pytest.mark.slow
def test_weight_transfer_source_from_a_bridge_model_holds_its_local_shards_and_lora_adapters():
    from megatron_refit.local.launch import run_spawned

    out = run_spawned(_source_rank, 1, timeout_s=180)[0]
    assert out["plain"] == out["expected"] and out["plain"]
    assert out["plain_lora"] == (0, 0)
    rank, alpha, adapters = out["lora"]
    assert (rank, alpha) == (4, 8) and adapters > 0 and out["device"] == "cpu"


class _RefusingClient:
    """An engine that answers ``init_weight_transfer_engine`` with an error at once (as a vLLM
    server answers 500 for a refit section that does not fit it)."""

    def init_weight_transfer_engine(self, init_info):
        raise RuntimeError("vLLM server http://engine:8000: POST /init_weight_transfer_engine answered 500: "
                           "init_info.refit.gen_tp=2, but this vLLM engine runs tensor_parallel_size=1")


def _refused_rank(rank, world, port):
    import time

    import torch

    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.vllm.trainer.engine import (
        LocalShardSource,
        MegatronRefitTrainerEngine,
        MegatronRefitTrainerInitInfo,
    )
    from megatron_refit.plan.spec import ShardSpec

    piece = TensorPiece(ShardSpec(name="w", global_shape=(4,), dtype="float32", box=((0, 4),)), torch.zeros(4))
    info = MegatronRefitTrainerInitInfo(refit={"engine": "vllm", "gen_tp": 2, "port": port, "timeout_s": 60},
                                        num_train=world, rank=rank)
    start = time.monotonic()
    try:
        MegatronRefitTrainerEngine.trainer_init(info, client=_RefusingClient() if rank == 0 else None,
                                                source=LocalShardSource([piece]))
        error = None
    except Exception as exc:  # noqa: BLE001 -- the test reads what each rank raised
        error = f"{type(exc).__name__}: {exc}"
    return dict(error=error, seconds=time.monotonic() - start)


def test_weight_transfer_an_engine_refusing_init_reaches_every_train_rank_in_seconds():
    """The engine's error reaches every train rank within seconds, not after refit.timeout_s
    (60 s here): train rank 0 raises the engine's own error, the others name it."""
    from megatron_refit.local.launch import run_spawned

    out = run_spawned(_refused_rank, 2, timeout_s=120)
    assert all(r["seconds"] < 15 for r in out), out
    assert "answered 500: init_info.refit.gen_tp=2" in out[0]["error"], out[0]
    for rank in out:  # every train rank names the replica and the engine's own error
        assert rank["error"].startswith("RefitTransportError: refit: the engines did not start: replica 0: joining "
                                        "failed: RefitTransportError: train rank 0 aborted the join: the vLLM engine's "
                                        "connect call failed: "), rank
        assert "answered 500: init_info.refit.gen_tp=2" in rank["error"], rank
