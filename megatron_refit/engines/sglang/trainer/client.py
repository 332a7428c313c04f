"""The trainer's side of a refit into SGLang engines (SGLang 0.5.23): the control calls.

Each engine replica runs with ``custom_weight_loader=[LOADER]``
(:mod:`megatron_refit.engines.sglang.worker.loader`); every call here is one weight-update session of
SGLang's own API: ``begin_weight_update`` → ``update_weights_from_tensor(<control message>,
load_format=LOADER)`` → ``end_weight_update``. The weights themselves travel over the refit
group, from every train rank's local shards to the TP workers that need them.

- :class:`EngineClient` over an offline ``sglang.Engine`` in this process;
- :class:`HTTPClient` over ``sglang serve`` (``POST /begin_weight_update`` …; the control
  message travels base64 in the body, as ``MultiprocessingSerializer`` writes it);
- :class:`~megatron_refit.engines.sglang.trainer.control.SglangControl` drives them (one per replica)
  around every train rank's own side of the refit.

Every session selects SGLang's runners (``selector``): under ``refit.gen_draft`` (the connect
message's section says so) ``all``, so that the messages also reach the speculative draft's runner
and the draft lands with the main model; otherwise ``target``, so that a draft the trainer does not
train (an external EAGLE head) is never handed to the loader.

Around each refit the engine is paused (``retract``: running requests go back to the queue
and are recomputed with the new weights) and its cache flushed; after a failed refit it stays
paused (its weights are no complete version) and the next complete refit resumes it. Imports
without SGLang: a control message is an empty tensor pickled with torch's own reduction.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import urllib.error
import urllib.request
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from megatron_refit.engines.sglang.messages import LOADER, close_message, connect_message, refit_message
from megatron_refit.fleet.serving import PathScores

PAUSE_MODES = ("retract", "abort")
"""SGLang's pause modes a refit can use: ``retract`` requeues running requests (recomputed
after the refit), ``abort`` ends them. (``in_place`` keeps their KV cache from the old
weights and makes SGLang refuse the flush: not offered.)"""


def serialize(named_tensors: list[tuple[str, torch.Tensor]]) -> str:
    """``named_tensors`` as SGLang's ``MultiprocessingSerializer.serialize(..., output_str=True)``
    writes them (``ForkingPickler``, base64): one TP rank's entry of an HTTP body."""
    buf = io.BytesIO()
    with torch_reductions():
        ForkingPickler(buf).dump(named_tensors)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _check_pause_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def _checked(what: str, out) -> None:
    """SGLang's ``(success, message)`` answer of an ``Engine`` weight-update call."""
    success, message = out
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


@contextlib.contextmanager
def torch_reductions():
    """Torch's own tensor pickling for the duration. Where SGLang patched it in this process
    (``monkey_patch_torch_reductions``, run by ``sglang.srt.weight_sync.utils`` and in its TP
    workers, for CUDA IPC across devices), pickling any CPU tensor fails (``IndexError``)."""
    from torch.multiprocessing import reductions

    original = getattr(reductions, "_reduce_tensor_original", None)
    if original is None or reductions.reduce_tensor is original:
        yield
        return
    patched = reductions.reduce_tensor
    reductions.reduce_tensor = original
    reductions.init_reductions()
    try:
        yield
    finally:
        reductions.reduce_tensor = patched
        reductions.init_reductions()


def input_token_logprobs(sequence: list[int], entries: list) -> list[float]:
    """SGLang's ``meta_info["input_token_logprobs"]`` of one prompt (``(logprob, token id, text)``
    per prompt token, the first one's logprob None) as the log-prob of each prompt token after the
    first; ``ValueError`` naming a position whose token is not the prompt's."""
    entries = list(entries)
    if len(entries) == len(sequence):
        entries = entries[1:]  # the first token has no log-prob
    if len(entries) != len(sequence) - 1:
        raise ValueError(f"SGLang answered {len(entries)} input_token_logprobs for a prompt of {len(sequence)} tokens")
    out = []
    for position, (token, entry) in enumerate(zip(sequence[1:], entries), start=1):
        logprob, token_id = entry[0], entry[1]
        if token_id != token or logprob is None:
            raise ValueError(f"SGLang's input_token_logprobs at position {position} are for token {token_id}, "
                             f"not the prompt's {token}")
        out.append(float(logprob))
    return out


GENERATE = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0}, "return_logprob": True,
            "logprob_start_len": 0}
"""What the serving probe asks SGLang's ``generate``: every prompt token's log-prob."""


def session_selector(refit: dict) -> str:
    """The runners a refit's sessions select (``begin_weight_update`` and every
    ``update_weights_from_tensor``): ``all`` (the target's and the speculative draft's) under
    ``refit.gen_draft``, else ``target``."""
    return "all" if refit.get("gen_draft", False) else "target"


def _check_attention_dp(attention_dp) -> int:
    if not isinstance(attention_dp, int) or isinstance(attention_dp, bool) or attention_dp < 1:
        raise ValueError(f"attention_dp must be a positive int (the engine's --dp with --enable-dp-attention), got "
                         f"{attention_dp!r}")
    return attention_dp


def _scored(generate, sequences: list[list[int]], attention_dp: int):
    """The probe's log-probs through ``generate(body)`` (SGLang's ``generate`` arguments); with DP
    attention through each DP rank (``routed_dp_rank``: each serves from its own attention copy)."""
    def logprobs(out):
        return [input_token_logprobs(list(s), o["meta_info"]["input_token_logprobs"]) for s, o in zip(sequences, out)]

    body = {"input_ids": [list(s) for s in sequences], **GENERATE}
    if attention_dp == 1:
        return logprobs(generate(body))
    return PathScores(tuple((f"DP rank {rank}", logprobs(generate({**body, "routed_dp_rank": rank})))
                            for rank in range(attention_dp)))


class EngineClient:
    """Control calls over an ``sglang.Engine`` in this process (its methods block). ``attention_dp``:
    the engine's ``--dp`` under ``--enable-dp-attention``: the serving probe goes through each DP rank."""

    def __init__(self, engine, *, pause_mode: str = "retract", attention_dp: int = 1) -> None:
        self.engine = engine
        self.pause_mode = _check_pause_mode(pause_mode)
        self.attention_dp = _check_attention_dp(attention_dp)
        self.selector = "target"
        """The runners this replica's sessions select (:func:`session_selector`, set at connect)."""

    def _session(self, named_tensors, *, flush_cache: bool) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        _checked("begin_weight_update", self.engine.begin_weight_update(selector=self.selector))
        try:
            with torch_reductions():  # pickled as the Engine does, one copy per TP rank
                payloads = [MultiprocessingSerializer.serialize(named_tensors)
                            for _ in range(self.engine.server_args.tp_size)]
            # Engine.update_weights_from_tensor has no selector in 0.5.23 (it selects all runners):
            # its tokenizer manager's call, with the session's
            req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, load_format=LOADER,
                                                  flush_cache=flush_cache, selector=self.selector)
            _checked("update_weights_from_tensor", self._tokenizer_call("update_weights_from_tensor", req, None))
        finally:
            _checked("end_weight_update", self.engine.end_weight_update())

    def _tokenizer_call(self, method: str, *args):
        # sglang.Engine has no pause / continue / weight-version methods in 0.5.23: its
        # tokenizer manager's, as the HTTP routes call them
        return self.engine.loop.run_until_complete(getattr(self.engine.tokenizer_manager, method)(*args))

    def connect(self, refit: dict, *, num_train: int, replica: int = 0) -> None:
        self.selector = session_selector(refit)
        self._session(connect_message(refit, num_train=num_train, replica=replica), flush_cache=False)

    def refit(self, version: int, *, full: bool = False) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._tokenizer_call("pause_generation", PauseGenerationReqInput(mode=self.pause_mode))
        self._session(refit_message(version, full), flush_cache=True)

    def resume(self, version: int) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput, UpdateWeightVersionReqInput

        self._tokenizer_call("update_weight_version",
                             UpdateWeightVersionReqInput(new_version=str(version), abort_all_requests=False))
        self._tokenizer_call("continue_generation", ContinueGenerationReqInput())

    def close(self) -> None:
        self._session(close_message(), flush_cache=False)

    def score(self, sequences: list[list[int]]):
        """The serving probe (``refit.verify_serving``) through ``Engine.generate``'s log-prob path
        (through each DP rank: :class:`~megatron_refit.fleet.serving.PathScores`)."""
        return _scored(lambda body: self.engine.generate(**body), sequences, self.attention_dp)

    def hold(self) -> None:
        """Stop serving (pause): the engine failed its serving check; the next refit resumes it."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._tokenizer_call("pause_generation", PauseGenerationReqInput(mode=self.pause_mode))


class HTTPClient:
    """Control calls over ``sglang serve`` at ``base_url`` (standard library only). ``tp``:
    the server's TP size (one serialised payload per TP rank); ``attention_dp``: its ``--dp`` under
    ``--enable-dp-attention`` (the serving probe goes through each DP rank)."""

    def __init__(self, base_url: str, *, tp: int, timeout: float = 600, pause_mode: str = "retract",
                 api_key: str | None = None, attention_dp: int = 1) -> None:
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be a positive int (the server's TP size), got {tp!r}")
        self.base_url = base_url.rstrip("/")
        self.tp = tp
        self.attention_dp = _check_attention_dp(attention_dp)
        self.timeout = timeout
        self.pause_mode = _check_pause_mode(pause_mode)
        self.api_key = api_key
        self.selector = "target"
        """The runners this server's sessions select (:func:`session_selector`, set at connect)."""

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body`` as JSON; the JSON answer (None if there is none)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(f"{self.base_url}/{path}", data=json.dumps(body).encode(), method="POST",
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"SGLang server {self.base_url}: POST /{path} answered {exc.code}: {detail}") from exc
        try:
            out = json.loads(answer or b"{}")
        except ValueError:
            return None
        if isinstance(out, dict) and out.get("success") is False:
            raise RuntimeError(f"SGLang server {self.base_url}: POST /{path} failed: {out.get('message')}")
        return out

    def _session(self, named_tensors, *, flush_cache: bool) -> None:
        payload = serialize(named_tensors)
        self._post("begin_weight_update", {"selector": self.selector})
        try:
            self._post("update_weights_from_tensor", {"serialized_named_tensors": [payload] * self.tp,
                                                      "load_format": LOADER, "flush_cache": flush_cache,
                                                      "selector": self.selector})
        finally:
            self._post("end_weight_update", {})

    def connect(self, refit: dict, *, num_train: int, replica: int = 0) -> None:
        self.selector = session_selector(refit)
        self._session(connect_message(refit, num_train=num_train, replica=replica), flush_cache=False)

    def refit(self, version: int, *, full: bool = False) -> None:
        self._post("pause_generation", {"mode": self.pause_mode})
        self._session(refit_message(version, full), flush_cache=True)

    def resume(self, version: int) -> None:
        self._post("update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self._post("continue_generation", {})

    def close(self) -> None:
        self._session(close_message(), flush_cache=False)

    def score(self, sequences: list[list[int]]):
        """The serving probe (``refit.verify_serving``) through the server's ``/generate``
        (token-id prompts, ``return_logprob``, ``logprob_start_len: 0``; through each DP rank:
        :class:`~megatron_refit.fleet.serving.PathScores`)."""
        return _scored(lambda body: self._post("generate", body), sequences, self.attention_dp)

    def hold(self) -> None:
        """Stop serving (``/pause_generation``): the server failed its serving check; the next
        refit resumes it."""
        self._post("pause_generation", {"mode": self.pause_mode})
