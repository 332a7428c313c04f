"""``vllm.endpoint_plugins`` entry point: a staged swap as one step of vLLM's engine core, no ``/pause``.

vLLM's engine core runs every utility call (``collective_rpc`` to the workers, the scheduler's
``reset_prefix_cache``, ``set_weight_version``, the scheduler's pause state) between two
scheduler steps. ``POST /megatron_refit/swap`` (``{"weight_version": "4", "kv": "recompute"}``;
:data:`~megatron_refit.engines.vllm.payload.SWAP_ROUTE`) sends the calls of one swap to the
engine core in one burst, so they fall between the same two steps:

1. the scheduler's pause state ``keep`` (requests in flight stay where they are, no cache
   cleared), sent first: the fence that keeps any step out until the burst is done, whenever its
   later messages reach the engine core;
2. the workers' ``finish_weight_update`` (``collective_rpc``): the version prepared beside the live
   model (``swap: staged``) becomes live; if it raises, the engine stays paused (its weights may
   be no complete version; the next complete update resumes it) with the version label it had;
3. ``kv: recompute``: the requests in flight are preempted, their KV recomputed under the new
   version (``reset_prefix_cache(reset_running_requests=True)``); ``kv: keep`` (PipelineRL's
   in-flight update): they go on over the KV the old version computed, and the prefix cache is
   dropped only when no request holds blocks of it (vLLM resets it whole or not at all);
4. ``set_weight_version``: the tokens of every later step are tagged with the new version
   (``weight_versions`` of ``/inference/v1/generate``);
5. ``resume``, once the engine core answered 2-4.

The answer holds ``held_s``: from the engine core's answer to a no-op worker call sent right
after the pause (``check_health``: it answers once the fence is in place) to the resume answered,
the time the scheduler was held (give or take one message's way back); and ``blocked_s``, from
the first message sent, which adds the scheduler step under way when the burst arrived (requests
progress in it). What vLLM does not expose: one utility call that runs a worker
RPC and scheduler actions together (hence the fence), and a pause that answers when the step
under way is out without the fixed 20 ms sleep of ``AsyncLLM.pause_generation``: under async
scheduling or pipeline parallelism (a batch may be in flight at a utility call) the swap waits
for that pause, sleep included (``settled`` in the answer).

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and that list then filters
``vllm.general_plugins`` too: start the server with ``VLLM_PLUGINS=megatron_refit``, which
loads both of this project's entry points. Without the route, ``HTTPClient`` falls back to
``/pause`` with a WARNING (docs/guide-swap.md).
"""

from __future__ import annotations

import asyncio
import time

from megatron_refit.engines.vllm import BACKEND
from megatron_refit.engines.vllm.payload import SWAP_ROUTE, parse_swap_payload

PAUSE_ANSWER_S = 30.0
"""How long the pause (the fence) may take to answer once the swap is done: it answers when the
engine core is next idle, at once under the pause state, so a longer wait is an engine that hangs."""


async def engine_step_swap(client, weight_version: str | None, kv: str, *, settle: bool = False) -> dict:
    """One staged swap through ``client`` (vLLM's ``EngineClient``) in one burst of engine-core
    utility calls (the module's docstring). ``settle``: wait for the pause to complete before the
    swap (a batch may be in flight at a utility call). Raises what the swap raised; the engine
    then stays paused, its version label the one it served."""
    prior = await client.get_weight_version() if weight_version is not None else None
    start = time.perf_counter()
    pause = asyncio.ensure_future(client.pause_generation(mode="keep", clear_cache=False))
    fenced = asyncio.ensure_future(_answered_at(client.collective_rpc("check_health")))
    await asyncio.sleep(0)  # the pause's message out first, then the mark of its being taken (both sent at once)
    try:
        if settle:
            await pause
        burst = [client.collective_rpc("finish_weight_update"),
                 client.reset_prefix_cache(reset_running_requests=kv == "recompute")]
        if weight_version is not None:
            burst.append(client.update_weight_version(weight_version))
        answers = await asyncio.gather(*burst, return_exceptions=True)
        try:
            failed = next((a for a in answers if isinstance(a, BaseException)), None)
            if failed is not None:
                raise failed
            reset = answers[1]
            if kv == "recompute" and not reset:
                raise RuntimeError("the prefix cache could not be reset after the swap (the requests in flight would "
                                   "reuse KV of the old version); the engine stays paused")
        except BaseException:
            if weight_version is not None:  # it serves nothing while paused; its label stays the last one served
                await client.update_weight_version(prior)
            raise
        await client.resume_generation()
        resumed = time.perf_counter()
    finally:  # the pause's own fixed sleep ends after the resume
        paused, fenced_at = await asyncio.gather(asyncio.wait_for(pause, PAUSE_ANSWER_S), fenced,
                                                 return_exceptions=True)
    if isinstance(paused, BaseException):
        raise RuntimeError(f"the swap's pause (the fence) failed: {paused!r}") from paused
    held = resumed - fenced_at if isinstance(fenced_at, float) else None
    return dict(blocked_s=round(resumed - start, 6), held_s=None if held is None else round(held, 6), kv=kv,
                weight_version=weight_version, settled=settle, prefix_cache_reset=bool(reset))


async def _answered_at(call) -> float:
    await call
    return time.perf_counter()


def needs_settle(vllm_config) -> bool:
    """A batch may be in flight when a utility call runs: async scheduling or pipeline stages."""
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)) or \
        vllm_config.parallel_config.pipeline_parallel_size > 1


class SwapEndpoint:
    """The ``vllm.endpoint_plugins`` factory's product (vLLM's ``EndpointPlugin`` protocol)."""

    name = BACKEND
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.client = None
        self.settle = False
        self._lock: asyncio.Lock | None = None

    def attach_router(self, app) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse

        router = APIRouter()

        async def swap(raw_request):
            try:
                version, kv = parse_swap_payload(await raw_request.json())
            except ValueError as exc:
                return JSONResponse({"error": str(exc)}, status_code=400)
            if self.client is None:
                return JSONResponse({"error": f"{SWAP_ROUTE}: this server has no engine"}, status_code=503)
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:  # one swap at a time
                try:
                    answer = await engine_step_swap(self.client, version, kv, settle=self.settle)
                except Exception as exc:
                    return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
            return JSONResponse(answer)

        swap.__annotations__ = {"raw_request": Request}  # the class itself: this module's annotations are strings
        router.post(SWAP_ROUTE)(swap)
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.client = engine_client
        if engine_client is not None:
            self.settle = needs_settle(engine_client.vllm_config)


def endpoint() -> SwapEndpoint:
    """The entry point (pyproject.toml, ``vllm.endpoint_plugins``)."""
    return SwapEndpoint()
