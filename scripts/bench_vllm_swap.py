"""Zero-downtime refits into a running vLLM server under load: how long requests are blocked.

A ``vllm`` API server (``.venv-vllm-cpu``: vLLM's real engine on CPU, ``--weight-transfer-config
'{"backend": "megatron_refit"}'``) serves a Qwen3 of ``--hidden`` / ``--layers``; Megatron train
ranks (TP ``--train-tp``, Bridge, real optimizer steps) refit it ``--refits`` times per policy with
``swap: staged`` and deltas on, while ``--clients`` threads ask it for ``--tokens`` greedy tokens
each through ``/inference/v1/generate``. The policies of ``HTTPClient`` (docs/guide-swap.md), one
after the other on the same server (started with ``VLLM_PLUGINS=megatron_refit``):

- ``drain``: the server pauses new requests and waits for those in flight, then swaps;
- ``in_flight``: the swap is one pause of vLLM's engine core between two steps
  (``POST /megatron_refit/swap``, no ``/pause``); the requests in flight recompute their KV under
  the new version (``kv: recompute``);
- ``in_flight_keep``: the same with ``kv: keep`` (they go on over their old KV).

``blocked_over_refit_<policy>``: the time the server did not schedule requests over the refits'
wall time (``send_weights``). Under ``drain``: ``/pause`` sent to ``/resume`` answered (the
client's clock); under ``in_flight*``: the route's ``held_s``, from vLLM's level-0 sleep (the
scheduler paused, requests kept) answered to the resume answered: the time no step ran (the API
server's clock), beside ``bound_s``, the route's ``blocked_s`` (from the sleep sent: the step
under way added, in which requests progress) and ``route_s``, the whole HTTP call.
``p99_latency_ratio`` and ``max_latency_ratio``: request latency of the requests that overlap a
refit, against the same load's before the refits (per policy). ``bit_exact``: after each
policy's last refit the server's greedy tokens equal the Megatron model's greedy decode.
``prepared_all``: every measured refit's version was prepared beside the live model
(``refit/swap_unprepared`` 0: none fell back to loading under the pause). Under
``in_flight_keep`` the prefix cache may still hold prompts the old version computed (vLLM resets
it only when no request holds blocks), so ``bit_exact`` is checked after ``/reset_prefix_cache``.
``--json``: one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from bench_vllm_server import add_model_arguments, argument_error, saved_model, train_rank  # noqa: E402
from machine import cpu_model  # noqa: E402

POLICIES = {"drain": dict(policy="drain"), "in_flight": dict(policy="in_flight"),
            "in_flight_keep": dict(policy="in_flight", kv="keep")}
"""The ``HTTPClient`` arguments of each measured policy."""


def _p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def _latencies(done: list, windows: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Latencies of the requests that overlap a window, and of those before the first."""
    during = [t1 - t0 for t0, t1, *_ in done if any(t0 < b and t1 > a for a, b in windows)]
    before = [t1 - t0 for t0, t1, *_ in done if t1 <= windows[0][0]]
    return during, before


def _rank(rank, world, port, url, server_pid, hidden, layers, refits, clients, tokens, baseline_s, ports):
    import torch

    from conversion.refit import local_shard_source
    from conversion.testing.train_step import greedy_decode, train_step
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo
    from megatron_refit.testing.vllm_server import GenerateLoad, generate, post, timed_client

    cfg, built, sequence, prompt, optimizer = train_rank(rank, world, port, url, hidden, layers)
    rows, version = {}, 0
    for (policy, kwargs), refit_port in zip(POLICIES.items(), ports):
        client = timed_client(url, swap="staged", **kwargs)
        engine = MegatronRefitTrainerEngine.trainer_init(
            MegatronRefitTrainerInitInfo(refit=dict(engine="vllm", gen_tp=1, port=refit_port, timeout_s=300,
                                                    swap="staged", delta="on"), num_train=world, rank=rank),
            client=client, source=local_shard_source(built.bridge, built.model, cfg))
        version += 1
        engine.send_weights(version)  # the engine's first (full), outside the measurement
        load = GenerateLoad(url, prompt, [tokens] * clients) if rank == 0 else None
        time.sleep(baseline_s)  # the same load, no refit
        windows, blocked, bound_s, route_s, unprepared = [], [], [], [], 0
        for _ in range(refits):
            train_step(built, optimizer, sequence)
            version += 1
            torch.distributed.barrier()
            client.calls.clear()
            t0 = time.monotonic()
            unprepared += engine.send_weights(version).summary["refit/swap_unprepared"]
            windows.append((t0, time.monotonic()))
            calls = {route: (a, b) for route, a, b in client.calls}
            if rank == 0 and client.last_swap is not None:  # one step of the engine core
                blocked.append(client.last_swap["held_s"])
                bound_s.append(client.last_swap["blocked_s"])
                route_s.append(calls["megatron_refit/swap"][1] - calls["megatron_refit/swap"][0])
                routes = {"megatron_refit/swap": round(route_s[-1], 4)}
            elif rank == 0:
                if kwargs["policy"] == "in_flight":
                    raise RuntimeError(f"{policy}: the swap fell back to /pause (the server lacks the route)")
                blocked.append(calls["resume"][1] - calls["pause"][0])
                routes = {route: round(b - a, 4) for route, a, b in client.calls if a >= calls["pause"][0]}
            time.sleep(0.3)
        done = load.stop() if load is not None else []
        megatron = greedy_decode(built, prompt, tokens)
        if rank == 0:
            during, before = _latencies(done, windows)
            if kwargs.get("kv") == "keep" and not post(url, "reset_prefix_cache").get("success"):
                raise RuntimeError(f"{policy}: the server could not reset its prefix cache with no request running")
            served, spans = generate(url, prompt, tokens)
            refit_s = sum(b - a for a, b in windows)
            rows[policy] = dict(blocked_routes_s=routes, refit_s=[round(b - a, 4) for a, b in windows],
                                blocked_s=[round(b, 4) for b in blocked], route_s=[round(r, 4) for r in route_s],
                                bound_s=[round(b, 4) for b in bound_s],
                                blocked_over_refit=round(sum(blocked) / refit_s, 4),
                                requests=len(done), errors=sum(error is not None for *_, error in done),
                                p99_before_s=round(_p99(before), 4), p99_during_s=round(_p99(during), 4),
                                max_before_s=round(max(before, default=float("nan")), 4),
                                max_during_s=round(max(during, default=float("nan")), 4),
                                median_before_s=round(statistics.median(before), 4) if before else None,
                                bit_exact=served == megatron and spans == [(str(version), 0, tokens)],
                                prepared_all=unprepared == 0)
        engine.shutdown()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--refits", type=int, default=4, help="refits per policy")
    p.add_argument("--clients", type=int, default=6, help="concurrent client threads")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--baseline-s", type=float, default=3.0, help="seconds of the same load before the refits")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    args = p.parse_args(argv)
    error = argument_error(args, refits=args.refits, clients=args.clients, tokens=args.tokens,
                           baseline_s=args.baseline_s)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from megatron_refit.local.launch import free_ports
    from megatron_refit.testing.vllm_server import VllmServer
    with tempfile.TemporaryDirectory(prefix="bench_vllm_swap_") as workdir:
        model, model_mb = saved_model(workdir, args.hidden, args.layers)
        server_port, *ports = free_ports(1 + len(POLICIES))
        server = VllmServer(model=model, port=server_port, log=Path(workdir) / "server.log", start_timeout_s=600)
        rows = server.run_beside(_rank, args.train_tp, args.hidden, args.layers, args.refits, args.clients,
                                 args.tokens, args.baseline_s, ports, timeout_s=1800)[0]
    head = dict(bench="vllm_swap", engine="vllm-cpu 0.32.0 API server", model_mb=round(model_mb, 1),
                train_tp=args.train_tp, refits=args.refits, clients=args.clients, tokens=args.tokens,
                **{f"blocked_over_refit_{k}": rows[k]["blocked_over_refit"] for k in POLICIES},
                p99_latency_ratio={k: round(rows[k]["p99_during_s"] / rows[k]["p99_before_s"], 2) for k in POLICIES},
                max_latency_ratio={k: round(rows[k]["max_during_s"] / rows[k]["max_before_s"], 2) for k in POLICIES},
                errors=sum(rows[k]["errors"] for k in POLICIES),
                bit_exact=all(rows[k]["bit_exact"] for k in POLICIES),
                prepared_all=all(rows[k]["prepared_all"] for k in POLICIES), cpu=cpu_model(),
                date=time.strftime("%Y-%m-%d"), per_policy=rows)
    print(f"{'policy':>15} {'refit_s':>8} {'blocked_s':>10} {'blocked/refit':>14} {'p99 before':>11} "
          f"{'p99 during':>11} {'requests':>9} {'errors':>7} {'bit_exact':>10}")
    for k in POLICIES:
        r = rows[k]
        print(f"{k:>15} {statistics.median(r['refit_s']):>8.3f} {statistics.median(r['blocked_s']):>10.4f} "
              f"{r['blocked_over_refit']:>14.4f} {r['p99_before_s']:>11.3f} {r['p99_during_s']:>11.3f} "
              f"{r['requests']:>9} {r['errors']:>7} {str(r['bit_exact']):>10}")
    if args.json:
        print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
