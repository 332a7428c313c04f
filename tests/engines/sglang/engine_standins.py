"""What an SGLang ``Engine`` and ``sglang serve`` do with a TP worker's weight updates, in one
TP worker's process on CPU (neither starts on CPU from the registry's wheels).

Below them everything is SGLang's own: the scheduler's ``SchedulerWeightUpdaterManager``
(sessions, per-rank payloads, cache flush, TP barrier) and the model runner's
``WeightUpdater`` with the custom weight loaders of the published server args. Above them,
:class:`RankEngine` has ``sglang.Engine``'s weight-update methods (same signatures, same
``(success, message)`` answers, the message pickled once per TP rank as
``Engine._serialize_tensors_per_rank`` does) and :func:`serve_http` answers the routes of
SGLang's HTTP server that a refit uses, parsing each body with SGLang's own request classes
as FastAPI does (pydantic validation of the msgspec structs). Only the tokenizer manager's
pause / continue / weight-version calls are recorded instead of run (no requests here).
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from .sglang_cpu import weight_updater


class _Scheduler:
    """What ``SchedulerWeightUpdaterManager`` asks of the scheduler: the weight version."""

    def __init__(self):
        self.weight_versions = []

    def record_weight_version_change(self, new_version):
        self.weight_versions.append(new_version)


def scheduler_updater(model: torch.nn.Module, model_dir: str, draft: torch.nn.Module | None = None):
    """The scheduler's weight-update manager over a TP worker whose model runner holds
    ``model`` and SGLang's ``WeightUpdater`` (no KV cache to flush: no requests here);
    ``draft``: a speculative draft worker too, whose one runner holds ``draft`` (SGLang's
    ``BaseSpecWorker.weight_update_runners``: ``("draft", runner)``)."""
    from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
    from sglang.srt.managers.tp_worker import TpModelWorker

    class Runner:
        def __init__(self, runner_model):
            self.model, self.weight_updater = runner_model, weight_updater(runner_model, model_dir)

    class Worker:
        deserialize_own_rank = TpModelWorker.deserialize_own_rank  # SGLang's: this rank's payload

        def __init__(self):
            self.model_runner = Runner(model)

        def weight_update_runners(self):
            return [("target", self.model_runner)]

    class DraftWorker:
        def __init__(self):
            self.draft_runner = Runner(draft)

        def weight_update_runners(self):
            return [("draft", self.draft_runner)]

    return SchedulerWeightUpdaterManager(tp_worker=Worker(), draft_worker=None if draft is None else DraftWorker(),
                                         memory_saver_adapter=None, flush_cache=lambda empty_cache=True: True,
                                         is_fully_idle=lambda ignore_waiting=False: True, scheduler=_Scheduler())


class _TokenizerManager:
    """Records the tokenizer manager's calls a refit makes (the scheduler-side pause has no
    requests to act on here); its ``update_weights_from_tensor`` hands the request to the
    scheduler's manager (``manager``) as SGLang's tokenizer manager does, and answers
    ``(success, message)``."""

    def __init__(self, calls: list, manager=None):
        self.calls, self.manager = calls, manager

    async def update_weights_from_tensor(self, obj, request=None):
        self.calls.append("update")
        out = self.manager.update_weights_from_tensor(obj)
        return out.success, out.message

    async def pause_generation(self, obj):
        self.calls.append(f"pause:{obj.mode}")

    async def continue_generation(self, obj):
        self.calls.append("continue")

    async def update_weight_version(self, obj):
        self.calls.append(f"version:{obj.new_version}")


class RankEngine:
    """``sglang.Engine``'s weight-update methods (and its ``server_args.tp_size``, ``loop`` and
    ``tokenizer_manager``) over one TP worker's real scheduler manager."""

    def __init__(self, manager, tp: int):
        from types import SimpleNamespace

        self.manager, self.tp = manager, tp
        self.server_args = SimpleNamespace(tp_size=tp)
        self.calls: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = _TokenizerManager(self.calls, manager)

    def _answer(self, out) -> tuple[bool, str]:
        return out.success, out.message

    def begin_weight_update(self, selector: str = "all"):
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput

        self.calls.append("begin")
        return self._answer(self.manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector)))

    def end_weight_update(self):
        from sglang.srt.managers.io_struct import EndWeightUpdateReqInput

        self.calls.append("end")
        return self._answer(self.manager.end_weight_update(EndWeightUpdateReqInput()))

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        self.calls.append("update")
        payloads = [MultiprocessingSerializer.serialize(named_tensors) for _ in range(self.tp)]
        return self._answer(self.manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=load_format, flush_cache=flush_cache)))


def serve_http(manager, generate=None) -> tuple[str, list[str], ThreadingHTTPServer]:
    """An HTTP server on 127.0.0.1 answering SGLang's weight-update, pause and version routes
    for this TP worker: ``(base_url, calls, server)``. ``generate(input_ids)``: ``/generate``'s
    prefill log-probs (``return_logprob``, ``logprob_start_len: 0``) as the ``meta_info`` of each
    prompt (:func:`~tests.engines.sglang.sglang_cpu.prefill_logprobs`: SGLang's own forward)."""
    import pydantic
    from sglang.srt.managers import io_struct

    calls: list[str] = []
    routes = {
        "begin_weight_update": (io_struct.BeginWeightUpdateReqInput, manager.begin_weight_update),
        "update_weights_from_tensor": (io_struct.UpdateWeightsFromTensorReqInput, manager.update_weights_from_tensor),
        "end_weight_update": (io_struct.EndWeightUpdateReqInput, manager.end_weight_update),
        "pause_generation": (io_struct.PauseGenerationReqInput, lambda req: calls.append(f"pause:{req.mode}")),
        "continue_generation": (io_struct.ContinueGenerationReqInput, lambda req: calls.append("continue")),
        "update_weight_version": (io_struct.UpdateWeightVersionReqInput,
                                  lambda req: calls.append(f"version:{req.new_version}")),
    }
    if generate is not None:
        def answer(req):
            calls.append("generate")
            if not (req.return_logprob and req.logprob_start_len == 0):
                raise ValueError("this stand-in answers the prompt log-probs of a refit's serving probe only")
            return [dict(meta_info=dict(input_token_logprobs=lp)) for lp in generate(req.input_ids)]

        routes["generate"] = (io_struct.GenerateReqInput, answer)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            path = self.path.strip("/")
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if path not in routes:
                return self._reply(404, {"detail": "Not Found"})
            cls, handle = routes[path]
            try:
                req = pydantic.TypeAdapter(cls).validate_python(body)
            except pydantic.ValidationError as exc:
                return self._reply(422, {"detail": str(exc)})
            if path.endswith("weight_update") or path == "update_weights_from_tensor":
                calls.append({"begin_weight_update": "begin", "end_weight_update": "end"}.get(path, "update"))
            out = handle(req)
            if out is None:
                return self._reply(200, {"status": "ok"})
            if isinstance(out, list):  # /generate: one answer per prompt
                return self._reply(200, out)
            self._reply(200 if out.success else 400, {"success": out.success, "message": out.message})

        def _reply(self, code: int, content):
            data = json.dumps(content).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", calls, server
