"""Control-plane clients (vLLM's ``VLLMWeightSyncClient`` protocol) that keep serving correct.

vLLM's ``finish_weight_update`` swaps weights but leaves the scheduler's prefix cache alone:
a request whose prompt shares a prefix with an earlier one would then reuse KV computed
under the old weights. And a request running while ``update_weights`` writes would mix two
versions. These clients close both holes around every update:

- :class:`LLMClient` over an offline ``vllm.LLM`` (its calls are synchronous, so no request
  runs during an update): the prefix cache is reset after ``finish_weight_update``. A version
  the fleet checks (``refit.verify_serving``) is scored before it takes traffic: ``generate``
  waits at the client's gate from before the version lands until the verdict.
- :class:`HTTPClient` over ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1`` exposes the RL routes):
  ``/pause`` (in-flight requests finish or are aborted; KV and prefix caches are cleared)
  before ``start_weight_update`` and ``/resume`` after ``finish_weight_update``. After a
  failed update the server stays paused: its weights are not a complete version; the next
  complete update resumes it. Under ``swap: staged`` the pause covers the swap alone: an update
  that fails before its swap (its receive, or its preparation beside the live model) fails in
  ``update_weights``, before any pause, and the version that served serves on, untouched.
- :class:`ReplicaClients`: the clients of several independent engines (one ``LLM`` or server
  per replica) for the trainer engine; each replica's calls run apart
  (:class:`~megatron_refit.engines.vllm.trainer.control.VllmControl`), so one engine's failure
  stays with it, and engines may join while the trainer runs.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.error
import urllib.request
from typing import Any

from megatron_refit.engines.vllm.payload import KV_MODES, SWAP_PATH, swap_payload
from megatron_refit.errors import StaleWeightsError


logger = logging.getLogger(__name__)

PAUSE_MODES = ("wait", "abort")
POLICIES = ("drain", "in_flight")
"""What a staged swap does with the requests in flight (docs/guide-swap.md)."""

_NO_ROUTE = object()
"""What ``HTTPClient._post(..., missing_ok=True)`` returns where the server has no such route (404)."""


class LLMClient:
    """``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.version: str | None = None
        """The weight version of the last update that completed."""
        self._opened: threading.Event | None = None
        """Set when the gate (:meth:`gate`) of the version under its serving check opens."""
        self._gating = False
        """:meth:`gate` was called for the update under way (its finish keeps the gate closed)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def start_draft_weight_update(self) -> None:
        """``refit.gen_draft``: the refit's session also writes vLLM's speculative draft."""
        self.llm.start_draft_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()  # no prompt may reuse KV computed under the old weights
        gated, self._gating = self._gating, False
        if not gated:  # a version landed unchecked: a hold (below), or a gate left without a verdict, ends
            self.llm.__dict__.pop("generate", None)
            self._open()
        self.version = weight_version

    def speculation(self) -> dict[str, int]:
        """This ``LLM``'s speculative decoding so far, as :meth:`HTTPClient.speculation` reads a
        server's: the draft tokens it proposed and those the model accepted (vLLM's counters, from
        ``LLM.get_metrics``; 0 and 0 without a draft). ``RuntimeError`` where the ``LLM`` keeps no
        statistics (built with ``disable_log_stats=True``, the offline default)."""
        if not getattr(self.llm.llm_engine, "log_stats", False):
            raise RuntimeError("vLLM LLM: its speculative-decoding counters need statistics: build it with "
                               "LLM(..., disable_log_stats=False)")
        names = {metric.removesuffix("_total"): key for key, metric in SPECULATION_METRICS.items()}
        out = dict.fromkeys(SPECULATION_METRICS, 0)
        for metric in self.llm.get_metrics():  # one counter per engine
            key = names.get(metric.name)
            if key is not None:
                out[key] += int(metric.value)
        return out

    def gate(self, timeout_s: float = 900.0) -> None:
        """The version about to land is scored before it takes traffic (``refit.verify_serving``):
        from now until :meth:`release` (it passed) or :meth:`hold` (it did not), this ``LLM``'s
        ``generate`` waits, then runs over the version or is refused; after ``timeout_s`` without
        a verdict it raises :class:`~megatron_refit.errors.StaleWeightsError`. The probe's own
        scoring passes."""
        self._open()  # one left without a verdict
        opened = self._opened = threading.Event()
        self._gating = True
        llm = self.llm

        def waiting(*args, **kwargs):
            if not opened.wait(timeout_s):
                raise StaleWeightsError(f"vLLM LLM: the version under its serving check (refit.verify_serving) got "
                                        f"no verdict within {timeout_s:g} s; refusing to generate from it")
            return llm.generate(*args, **kwargs)  # now the class's (released) or the refusal (held)

        llm.generate = waiting

    def release(self) -> None:
        """The gated version passed its serving check: ``generate`` runs over it again (calls that
        waited go on)."""
        self.llm.__dict__.pop("generate", None)
        self._open()

    def _open(self) -> None:
        opened, self._opened = self._opened, None
        if opened is not None:
            opened.set()

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def hold(self) -> None:
        """Stop serving: the engine failed its serving check (``refit.verify_serving``). From now
        until the next update completes, this ``LLM``'s ``generate`` raises
        :class:`~megatron_refit.errors.StaleWeightsError` (no rollout comes from a version that
        does not serve the trainer's model); the probe's own scoring goes on."""
        version = self.version

        def refused(*args, **kwargs):
            raise StaleWeightsError(f"vLLM LLM: the weights of version {version} failed their serving check "
                                    "(refit.verify_serving); refusing to generate until the next refit lands")

        self.llm.generate = refused
        self._gating = False
        self._open()  # calls waiting at a gate are refused

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The serving probe (``refit.verify_serving``) through ``LLM.generate``: each prompt's
        ``prompt_logprobs`` (the log-prob vLLM computes for every prompt token after the first)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        prompts = [{"prompt_token_ids": list(s)} for s in sequences]
        outputs = type(self.llm).generate(self.llm, prompts, params, use_tqdm=False)  # the class's: past a hold
        return [prompt_token_logprobs(s, [None if e is None else {t: lp.logprob for t, lp in e.items()}
                                          for e in out.prompt_logprobs]) for s, out in zip(sequences, outputs)]


def prompt_token_logprobs(sequence: list[int], entries: list) -> list[float]:
    """vLLM's ``prompt_logprobs`` of one prompt (per position: None for the first, then a mapping
    token id -> log-prob that holds the prompt's own token) as the log-prob of each prompt token
    after the first; ``ValueError`` naming the position where the prompt's token is missing."""
    if len(entries) != len(sequence):
        raise ValueError(f"vLLM answered {len(entries)} prompt_logprobs entries for a prompt of {len(sequence)} tokens")
    out = []
    for position, (token, entry) in enumerate(zip(sequence[1:], entries[1:]), start=1):
        found = None if entry is None else entry.get(token, entry.get(str(token)))
        if found is None:
            raise ValueError(f"vLLM's prompt_logprobs at position {position} lack the prompt's token {token}")
        out.append(float(found["logprob"] if isinstance(found, dict) else found))
    return out


class HTTPClient:
    """``VLLMWeightSyncClient`` over ``vllm serve``'s RL routes (as vLLM's own
    ``HTTPVLLMWeightSyncClient``, standard library only), pausing generation around each
    update. ``pause_mode``: ``wait`` lets in-flight requests finish, ``abort`` ends them.

    ``policy`` (``swap: staged``; docs/guide-swap.md): ``drain`` pauses as ``pause_mode`` says, so
    no request sees two versions; ``in_flight`` swaps the prepared version in between two steps of
    vLLM's engine core, with no ``/pause``: one ``POST /megatron_refit/swap`` (the server's
    endpoint plugin, :mod:`megatron_refit.engines.vllm.server_swap`; ``VLLM_PLUGINS=megatron_refit``).
    ``kv``: ``recompute`` makes the requests in flight recompute their KV cache under the new
    version (no token is ever sampled over KV of another version than its own, and no new request
    reuses the old version's prefix cache); ``keep`` (PipelineRL's in-flight update) lets them go
    on over their old KV. A completion's tokens before the swap are the old version's, the rest
    the new one's, and vLLM reports the split (``weight_versions`` of ``/inference/v1/generate``,
    with ``--enable-scale-out``). A server without the route gets vLLM's ``/pause?mode=keep``
    around the swap instead (it blocks for the step under way and the pause's fixed 20 ms sleep),
    with one WARNING naming why. ``last_swap``: the route's answer for the last swap (``held_s``,
    the time the engine's scheduler was held; ``blocked_s``, that and the step under way when the
    pause came; None after a ``/pause``)."""

    def __init__(self, base_url: str, timeout: float = 300, *, pause_mode: str = "wait",
                 swap: str = "in_place", policy: str = "drain", kv: str = "recompute") -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {list(PAUSE_MODES)}, got {pause_mode!r}")
        if swap not in ("in_place", "staged"):
            raise ValueError(f"swap must be 'in_place' or 'staged' (refit.swap), got {swap!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
        if policy == "in_flight" and swap != "staged":
            raise ValueError(f"policy 'in_flight' needs swap='staged' (refit.swap), got swap={swap!r}: in place, "
                             "the engine's weights are no complete version while the update is open")
        if kv not in KV_MODES:
            raise ValueError(f"kv must be one of {list(KV_MODES)}, got {kv!r}")
        if kv != "recompute" and policy != "in_flight":
            raise ValueError(f"kv={kv!r} needs policy='in_flight' (under {policy!r} no request is in flight at the "
                             "swap)")
        self.policy = policy
        self.kv = kv
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.pause_mode = pause_mode
        self.swap = swap
        """``staged`` (``refit.swap``): the engine serves during ``update_weights`` (the bytes land
        in staging buffers) and pauses only for ``finish_weight_update``, which loads them."""
        self.engine_step: bool | None = None
        """``in_flight``: whether the server has the engine-step swap route (None: not asked yet)."""
        self.last_swap: dict | None = None

    def _post(self, path: str, body: dict[str, Any] | None = None, *, missing_ok: bool = False) -> Any:
        """POST ``body`` as JSON; the JSON answer (None if there is none; ``missing_ok``:
        :data:`_NO_ROUTE` where the server has no such route)."""
        data = json.dumps(body).encode() if body is not None else b""
        request = urllib.request.Request(f"{self.base_url}/{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                answer = response.read()
            return json.loads(answer) if answer.strip().startswith((b"{", b"[")) else None
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            if exc.code == 404 and missing_ok:
                return _NO_ROUTE
            raise RuntimeError(f"vLLM server {self.base_url}: POST /{path} answered {exc.code}: {detail}") from exc

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self, route: str = "start_weight_update") -> None:
        if self.swap == "in_place":
            self._post(f"pause?mode={self.pause_mode}&clear_cache=true")  # KV and prefix caches dropped
        self._post(route)

    def start_draft_weight_update(self) -> None:
        """``refit.gen_draft``: the refit's session also writes vLLM's speculative draft."""
        self.start_weight_update("start_draft_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.last_swap = None
        if self.policy == "in_flight" and self.engine_step is not False:
            if self._engine_step_swap(weight_version):
                return
        in_flight = self.policy == "in_flight"
        if in_flight:  # the requests in flight stay where they are, for the swap alone
            self._post("pause?mode=keep")
        elif self.swap == "staged":  # the pause covers only the swap of the prepared version
            self._post(f"pause?mode={self.pause_mode}&clear_cache=true")
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)
        if in_flight and self.kv == "recompute":  # their KV recomputed under the new version
            answer = self._post("reset_prefix_cache?reset_running_requests=true")
            if not (answer or {}).get("success", False):
                raise RuntimeError(f"vLLM server {self.base_url}: the prefix cache could not be reset after the swap "
                                   f"({answer}); the server stays paused")
        elif in_flight:  # kv: keep, as the route does: the old version's prefixes dropped where no request holds them
            self._post("reset_prefix_cache")
        self._post("resume")

    def _engine_step_swap(self, weight_version: str | None) -> bool:
        """The swap as one step of the engine core (:data:`SWAP_PATH`); False (and, the first
        time, a WARNING) where the server lacks the route."""
        answer = self._post(SWAP_PATH.lstrip("/"), swap_payload(weight_version, self.kv), missing_ok=True)
        if answer is _NO_ROUTE:
            self.engine_step = False
            logger.warning("vLLM server %s has no POST %s (megatron_refit's endpoint plugin; start the server with "
                           "VLLM_PLUGINS=megatron_refit): the in_flight swap falls back to /pause?mode=keep, which "
                           "holds requests for the step under way and the pause's fixed 20 ms sleep",
                           self.base_url, SWAP_PATH)
            return False
        self.last_swap = answer
        self.engine_step = True
        return True

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The serving probe (``refit.verify_serving``) through the server's own completions
        route: one ``/v1/completions`` request (token-id prompts, ``prompt_logprobs: 0``) whose
        answer holds the log-prob of every prompt token after the first."""
        body = {"prompt": [list(s) for s in sequences], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        answer = self._post("v1/completions", body)
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise ValueError(f"vLLM server {self.base_url}: {len(choices)} completions for {len(sequences)} prompts")
        return [prompt_token_logprobs(list(s), c.get("prompt_logprobs") or []) for s, c in zip(sequences, choices)]

    def hold(self) -> None:
        """Stop serving (``/pause``): the server failed its serving check; the next complete
        update resumes it."""
        self._post(f"pause?mode={self.pause_mode}&clear_cache=true")

    def speculation(self) -> dict[str, int]:
        """The server's speculative decoding so far (``GET /metrics``): the draft tokens it proposed
        and those the model accepted, summed over its engines (0 and 0 without a draft). Their
        change between two calls is the acceptance over that interval, e.g. a GRPO step's rollouts
        (:func:`speculation_counts`)."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=self.timeout) as response:
            return speculation_counts(response.read().decode(errors="replace"))


SPECULATION_METRICS = {"draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                       "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}
"""vLLM's counters of speculative decoding, as its Prometheus exposition names them."""


def speculation_counts(text: str) -> dict[str, int]:
    """``{"draft_tokens", "accepted_tokens"}`` from vLLM's Prometheus text (each counter summed
    over its label sets: one per engine)."""
    names = {metric: key for key, metric in SPECULATION_METRICS.items()}
    out = dict.fromkeys(SPECULATION_METRICS, 0)
    for line in text.splitlines():  # "<name>{<labels>} <value>" or "<name> <value>"
        key = names.get(re.split(r"[{ ]", line, maxsplit=1)[0])
        if key is not None:
            out[key] += int(float(line.rsplit(" ", 1)[-1]))
    return out


class ReplicaClients:
    """The clients of independent vLLM engines, one per replica (replica ``i`` = ``clients[i]``):
    the ``client`` the trainer engine takes for several engines. Each engine's calls run apart,
    in its lane (:class:`~megatron_refit.engines.vllm.trainer.control.VllmControl`), so one engine's
    failure stays with it; :meth:`~megatron_refit.engines.vllm.trainer.engine.MegatronRefitTrainerEngine.add_engine`
    takes in another while the trainer runs."""

    def __init__(self, clients: list) -> None:
        if not clients:
            raise ValueError("ReplicaClients needs at least one client")
        self.clients = list(clients)
