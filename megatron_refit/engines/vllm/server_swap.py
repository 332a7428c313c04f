"""``vllm.endpoint_plugins`` entry point: a staged swap as one step of vLLM's engine core, no ``/pause``.

vLLM's engine core runs every utility call (``collective_rpc`` to the workers, the scheduler's
``reset_prefix_cache``, ``set_weight_version``, its pause state) between two scheduler steps.
``POST /megatron_refit/swap`` (``{"weight_version": "4", "kv": "recompute"}``;
:data:`~megatron_refit.engines.vllm.payload.SWAP_PATH`) makes one swap a single pause of the
scheduler between two steps, with no ``/pause``:

1. vLLM's sleep level 0 in mode ``keep`` (``EngineClient.sleep``: the scheduler paused, the
   requests in flight kept where they are, no cache cleared): it takes effect between two steps
   and answers once no step runs; unlike ``/pause`` (``AsyncLLM.pause_generation``) no fixed
   20 ms sleep follows;
2. right behind it, in one burst: the workers' ``finish_weight_update`` (``collective_rpc``: the
   version prepared beside the live model, ``swap: staged``, becomes live); ``kv: recompute``:
   the requests in flight preempted, their KV recomputed under the new version
   (``reset_prefix_cache(reset_running_requests=True)``), ``kv: keep`` (PipelineRL's in-flight
   update): they go on over the KV the old version computed, and the prefix cache is dropped only
   if no request holds blocks of it (vLLM resets it whole or not at all); ``set_weight_version``
   (the tokens of every later step tagged with the new version, ``weight_versions`` of
   ``/inference/v1/generate``). Where a batch may still be in flight when a utility call runs
   (async scheduling, pipeline stages) or several engine cores pause together (data parallel),
   the burst waits for the pause's answer (``settled``), so that no batch of the old weights is
   tagged with the new version;
3. ``wake_up(tags=["scheduling"])``: the scheduler resumes.

If the swap or the reset fails, the engine stays paused (its weights may be no complete version;
the next complete update resumes it) with the version label it served. The answer holds
``held_s``, the sleep answered to the resume answered: the time no step ran (give or take one
message's way back); and ``blocked_s``, from the sleep sent, which adds the step under way, in
which requests still progress. vLLM's sleep level 0 is its documented "pause scheduling only";
what it does not expose is one utility call that runs a worker RPC and scheduler actions
together, hence the pause around them.

vLLM loads endpoint plugins only when ``VLLM_PLUGINS`` names them, and that list then filters
``vllm.general_plugins`` too: start the server with ``VLLM_PLUGINS=megatron_refit``, which
loads both of this project's entry points. Without the route, ``HTTPClient`` falls back to
``/pause`` with a WARNING (docs/guide-swap.md).
"""

from __future__ import annotations

import asyncio
import time

from megatron_refit.engines.vllm import BACKEND
from megatron_refit.engines.vllm.payload import SWAP_PATH, parse_swap_payload


async def engine_step_swap(client, weight_version: str | None, kv: str, *, settle: bool = False) -> dict:
    """One staged swap through ``client`` (vLLM's ``EngineClient``) as one pause of its engine
    core (the module's docstring). ``settle``: send the swap only once the pause answered (a batch
    may be in flight when a utility call runs). Raises what the swap raised; the engine then stays
    paused, its version label the one it served."""
    prior = await client.get_weight_version() if weight_version is not None else None
    start = time.perf_counter()
    paused = asyncio.ensure_future(_answered_at(client.sleep(level=0, mode="keep")))
    await asyncio.sleep(0)  # the pause's message goes out first
    if settle:
        await paused
    burst = [client.collective_rpc("finish_weight_update"),
             client.reset_prefix_cache(reset_running_requests=kv == "recompute")]
    if weight_version is not None:
        burst.append(client.update_weight_version(weight_version))
    held_from, *answers = await asyncio.gather(paused, *burst, return_exceptions=True)
    try:
        failed = next((a for a in (held_from, *answers) if isinstance(a, BaseException)), None)
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
    if not await client.wake_up(tags=["scheduling"]):
        raise RuntimeError("the engine did not resume scheduling after the swap: its executor sleeps "
                           "(vLLM's sleep level 1 or 2); wake it up before refitting")
    resumed = time.perf_counter()
    return dict(held_s=round(resumed - held_from, 6), blocked_s=round(resumed - start, 6), kv=kv,
                weight_version=weight_version, settled=settle, prefix_cache_reset=bool(reset))


async def _answered_at(call) -> float:
    await call
    return time.perf_counter()


def needs_settle(vllm_config) -> bool:
    """Whether the swap must wait for the pause to answer before it is sent: a batch may be in
    flight when a utility call runs (async scheduling, pipeline stages), or several engine cores
    pause together (data parallel: vLLM's coordinator steps them in waves)."""
    parallel = vllm_config.parallel_config
    return bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)) or \
        parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1


class SwapPlugin:
    """The ``vllm.endpoint_plugins`` factory's product (vLLM's ``EndpointPlugin`` protocol)."""

    name = BACKEND
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.client = None
        self.settle = False
        self._lock = asyncio.Lock()  # one swap at a time (a lock binds to the loop that first waits on it)

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
                return JSONResponse({"error": f"{SWAP_PATH}: this server has no engine"}, status_code=503)
            async with self._lock:
                try:
                    answer = await engine_step_swap(self.client, version, kv, settle=self.settle)
                except Exception as exc:
                    return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
            return JSONResponse(answer)

        swap.__annotations__ = {"raw_request": Request}  # the class itself: this module's annotations are strings
        router.post(SWAP_PATH)(swap)
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.client = engine_client
        if engine_client is not None:
            self.settle = needs_settle(engine_client.vllm_config)


def endpoint() -> SwapPlugin:
    """The entry point (pyproject.toml, ``vllm.endpoint_plugins``)."""
    return SwapPlugin()
