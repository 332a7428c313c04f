"""The train ranks of the running-server swap suite (``swap: staged``, ``HTTPClient(policy=...)``):
Megatron TP2 ranks (Bridge, real optimizer steps) refit a running ``vllm`` API server while
``CLIENTS`` threads of train rank 0 keep asking it for greedy continuations through vLLM's own
``/inference/v1/generate``, which reports the weight versions that sampled each answer's tokens.

Per phase (:data:`PHASES`: ``drain``; ``in_flight`` with ``kv: recompute``, the swap one step of
vLLM's engine core through megatron_refit's endpoint plugin; the same with ``kv: keep``): one refit
to start (full), then one held open by a slow train rank under load. Under ``in_flight`` a staged
refit that fails inside the engine (its preparation beside the live model raises:
``tests/engines/vllm_server/breaks``) follows, under load too, then one that lands. Every rank
computes the Megatron model's greedy decodes the tests compare with, and, for every answer whose
tokens two versions sampled, the new version's continuation of the old version's first tokens.
"""

from __future__ import annotations

import os
import time

import torch

from megatron_refit.local.faults import slow_next_refit
from megatron_refit.testing.vllm_server import (GenerateLoad, generate, is_paused, process_alive, timed_client,
                                             wait_healthy, weight_version)
from tests.engines.vllm_server.session import TRAIN_TP, _connect, _error, _trainer

PHASES = {"drain": dict(policy="drain"), "in_flight": dict(policy="in_flight"),
          "keep": dict(policy="in_flight", kv="keep")}
"""The ``HTTPClient`` arguments of each phase."""
CLIENTS = 4
LENGTHS = tuple(48 + 8 * i for i in range(CLIENTS))
"""Tokens per request of each client: each spans many scheduler steps, and requests of different
lengths never run in lockstep (the engine batches them), so some are always in flight."""
LONG = max(LENGTHS)
SLOW_S = 1.0
"""A train rank this slow holds the staged refit open under load."""
DECODE_TRIES = 4
"""Rounds of training (two steps each) a new version may take until its greedy decode moves."""
ATTEMPTS = 3
"""``in_flight``: refits under load until a request spans the swap (on a busy machine one may
not: every request part-way then had no token yet); the last one's answers are checked."""


def _under_load(url: str, prompt: list[int], rank: int, refit) -> tuple[list, object]:
    """``refit()`` while the clients ask (train rank 0), held open by a slow train rank 1. Train
    rank 0 starts it once every client has had an answer: the server is generating (on a busy
    machine its first tokens can come after a short refit's swap, which then no request spans)
    and the clients' requests are out of step, so some is always part-way at the swap."""
    clients = GenerateLoad(url, prompt, list(LENGTHS)) if rank == 0 else None
    if clients is None or not clients.await_answers(CLIENTS, timeout_s=40.0):
        time.sleep(0.5)
    try:
        result = refit()
    finally:
        time.sleep(0.5)
        done = clients.stop() if clients is not None else []
    return done, result


def session_swap(rank: int, world: int, port: int, url: str, server_pid: int, ports: list[int], break_file: str):
    from conversion.testing.train_step import greedy_decode, train_step

    cfg, built, tokens, prompt, optimizer = _trainer(rank, world, port, seed=5)
    wait_healthy(url, alive=process_alive(server_pid))
    refit = dict(engine="vllm", gen_tp=1, timeout_s=60, delta="on", swap="staged")
    ports, out, step = iter(ports), {}, 0

    def train() -> None:
        for _ in range(2):
            train_step(built, optimizer, tokens)

    def moved(old: list[int]) -> list[int]:
        """Train until the greedy decode moves off ``old`` (the same on every rank): a model this far
        along can keep its argmax over a step, and two versions of one decode would tell the tests
        nothing about which one served (a flake: versions 8 and 9 once decoded alike)."""
        for _ in range(DECODE_TRIES):
            train()
            new = greedy_decode(built, prompt, LONG)
            if new != old:
                break
        return new

    for phase, kwargs in PHASES.items():
        client = timed_client(url, swap="staged", **kwargs)
        engine = _connect({**refit, "port": next(ports)}, rank, built, cfg, client)
        train()
        step += 1
        engine.send_weights(step)  # the engine's first: full, its serving checked
        old = greedy_decode(built, prompt, LONG)
        new = moved(old)
        for attempt in range(ATTEMPTS):
            if rank == 1:
                slow_next_refit(engine.source.weights, SLOW_S)
            client.calls.clear()
            step += 1
            done, _ = _under_load(url, prompt, rank, lambda: engine.send_weights(step))
            cuts = [sorted({spans[1][1] for *_, spans, error in done if error is None and len(spans) == 2})]
            torch.distributed.broadcast_object_list(cuts, src=0)  # every rank decodes the same continuations
            if phase == "drain" or cuts[0] or attempt == ATTEMPTS - 1:
                break
            old = new  # no request spanned the swap (a busy machine): again, from the version now served
            new = moved(old)
        continuations = {k: greedy_decode(built, prompt + old[:k], LONG - k) for k in cuts[0]} \
            if phase == "in_flight" else {}
        out[phase] = dict(old=old, new=new, versions=[str(step - 1), str(step)], completions=done,
                          calls=client.calls, continuations=continuations, last_swap=client.last_swap,
                          version=weight_version(url) if rank == 0 else None)
        if phase == "in_flight":
            out["failed"] = _failed_then_landed(engine, url, prompt, rank, break_file, train, step, built)
            step += 2
        engine.shutdown()
    torch.distributed.destroy_process_group()
    return out


def _failed_then_landed(engine, url: str, prompt: list[int], rank: int, break_file: str, train, step: int,
                        built) -> dict:
    """A staged refit whose preparation raises in the engine, under load; then one that lands."""
    from conversion.testing.train_step import greedy_decode

    serving = greedy_decode(built, prompt, LONG)
    if rank == 0:
        with open(break_file, "w") as f:
            f.write("staged_raise")
    torch.distributed.barrier()
    train()
    done, error = _under_load(url, prompt, rank, lambda: _error(lambda: engine.send_weights(step + 1)))
    out = dict(serving=serving, error=error, completions=done)
    if rank == 0:
        out.update(version=weight_version(url), paused=is_paused(url))
        os.remove(break_file)
    torch.distributed.barrier()
    engine.send_weights(step + 2)
    out["after"] = dict(megatron=greedy_decode(built, prompt, LONG))
    if rank == 0:
        out["after"].update(zip(("tokens", "spans"), generate(url, prompt, LONG)), version=weight_version(url))
    return out


__all__ = ["TRAIN_TP", "session_swap"]
