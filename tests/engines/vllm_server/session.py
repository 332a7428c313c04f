"""The train ranks of the running-server suite: Megatron TP2 ranks built through Bridge,
real optimizer steps, refitting a running ``vllm`` API server through vLLM's trainer contract
(``MegatronRefitTrainerEngine.trainer_init`` / ``send_weights``) and our ``HTTPClient``.

One spawned session runs the whole scenario against one server, phase after phase (a
Megatron start-up and a server start are the suite's largest costs), and returns what each
phase saw; the tests read it. Train rank 0 asks the server (greedy ``/v1/completions``,
``/weight_info``); every rank computes the Megatron model's own greedy decode.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch

from megatron_refit.engines.vllm.trainer.clients import HTTPClient
from megatron_refit.local.faults import slow_next_refit
from megatron_refit.testing.vllm_server import (VllmServer, complete, is_paused, process_alive, timed_client,
                                             wait_healthy, weight_version)

TRAIN_TP = 2
PROMPT_LEN = 4
NEW_TOKENS = 8
LORA_DIM, LORA_ALPHA = 4, 8.0
TP2_BREAKS = ("unload_layer", "permute_experts")
"""The post-load breaks the gen TP2 session's server goes through (``tests/engines/vllm_server/breaks``).
(vLLM's fused-MoE reload without megatron_refit's fix is not among them: at TP2 the experts'
intermediate dim is padded for the CPU kernel, and without the fix the reload fails outright,
copying unpadded experts into padded storage, rather than serving another model.)"""
LOAD_LENGTHS = (NEW_TOKENS, NEW_TOKENS - 3)
"""The MoE session's clients: tokens per request (each answer a prefix of a version's greedy decode)."""
SLOW_RANK_S = 3.0
"""Staged phase: train rank 1 reads its first piece this slowly (``slow_next_refit``), so the
engine's update stays open (its worker receiving) that long while the server keeps answering."""


def model_config(model: str = "qwen3"):
    from conversion.presets import hf_config

    return hf_config(model, head_dim=32)  # vLLM's CPU attention needs head_dim >= 32


def sequence(cfg) -> torch.Tensor:
    """The sequence the model learns (next-token loss); the prompt is its head."""
    return torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(0))[:24].unsqueeze(0)


class NoPauseClient(HTTPClient):
    """A client that never pauses the server (vLLM's own HTTP client does not)."""

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version})


class Load:
    """Greedy completions in a loop on a thread of train rank 0, each with its start and end."""

    def __init__(self, url: str, prompt: list[int]):
        self.url, self.prompt, self.done = url, prompt, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            tokens = complete(self.url, self.prompt, NEW_TOKENS)
            self.done.append((t0, time.monotonic(), tokens))

    def wait(self, count: int = 1, timeout_s: float = 60.0) -> None:
        """Until ``count`` completions have ended (at most ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while len(self.done) < count and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.05)

    def stop(self, after: float | None = None, count: int = 0, timeout_s: float = 60.0) -> list:
        """Stop once ``count`` completions have started after monotonic time ``after`` (at most
        ``timeout_s`` more: a slow machine answers fewer requests in a window, never none)."""
        deadline = time.monotonic() + timeout_s
        while after is not None and time.monotonic() < deadline and self._thread.is_alive() \
                and sum(t0 >= after for t0, _, _ in list(self.done)) < count:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=120)
        return self.done


def _connect(refit: dict, rank: int, built, cfg, client):
    from conversion.refit import local_shard_source
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo

    return MegatronRefitTrainerEngine.trainer_init(
        MegatronRefitTrainerInitInfo(refit=refit, num_train=TRAIN_TP, rank=rank), client=client,
        source=local_shard_source(built.bridge, built.model, cfg))


def _trainer(rank: int, world: int, port: int, seed: int, model: str = "qwen3", ep: int = 1):
    """This train rank's Megatron model (Bridge, TP2; MoE: TP2xEP2), its training sequence,
    prompt and optimizer."""
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from megatron_refit.plan.layout import TrainLayout

    init_gloo(rank, world, port)
    layout = TrainLayout(tp=TRAIN_TP, ep=ep)
    init_model_parallel(layout)
    cfg = model_config(model)
    built = build_model(cfg, layout, seed=seed)
    tokens = sequence(cfg)
    optimizer = torch.optim.Adam(built.model[0].parameters(), lr=1e-2)
    return cfg, built, tokens, tokens[0, :PROMPT_LEN].tolist(), optimizer


def _error(fn) -> dict | None:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # what a train rank saw, and how fast
        return dict(type=type(exc).__name__, message=str(exc), seconds=time.monotonic() - t0)
    return None


def session(rank: int, world: int, port: int, url: str, server_pid: int, restart: dict, ports: list[int]):
    from dataclasses import replace

    from conversion.lora import apply_lora
    from conversion.testing.train_step import greedy_decode, train_step

    cfg, built, tokens, prompt, optimizer = _trainer(rank, world, port, seed=1)
    refit = dict(engine="vllm", gen_tp=1, timeout_s=60, delta="on")
    out: dict = dict(prompt=prompt)
    ports = iter(ports)
    wait_healthy(url, alive=process_alive(server_pid))  # the server started with this session

    def ask() -> dict:
        return dict(tokens=complete(url, prompt, NEW_TOKENS), version=weight_version(url)) if rank == 0 else {}

    def refit_once(engine, step: int, steps: int = 2) -> dict:
        for _ in range(steps):
            train_step(built, optimizer, tokens)
        report = engine.send_weights(step)
        return dict(step=step, delta=report.delta, engine_load=report.engine_load, bytes_sent=report.bytes_sent,
                    megatron=greedy_decode(built, prompt, NEW_TOKENS), **ask())

    # 1. three refits, in place (engine_load auto: vLLM's CPU build re-packs its linear
    #    weights, so it loads through its own loaders); refits 2 and 3 are deltas
    out["before"] = ask()
    engine = _connect({**refit, "port": next(ports)}, rank, built, cfg, HTTPClient(url))
    out["refits"] = [refit_once(engine, step) for step in (1, 2, 3)]
    engine.shutdown()

    # 2. swap: staged, requests in flight: the server answers while the update is open
    client = timed_client(url, swap="staged")
    engine = _connect({**refit, "swap": "staged", "port": next(ports)}, rank, built, cfg, client)
    first = refit_once(engine, 4)
    train_step(built, optimizer, tokens)
    new = greedy_decode(built, prompt, NEW_TOKENS)
    load = Load(url, prompt) if rank == 0 else None
    time.sleep(1.0)
    if rank == 1:
        slow_next_refit(engine.source.weights, SLOW_RANK_S)
    report = engine.send_weights(5)
    time.sleep(1.0)
    out["staged"] = dict(old=first["megatron"], new=new, first=first, delta=report.delta,
                         completions=load.stop() if load else [], calls=client.calls if rank == 0 else [],
                         **ask())
    engine.shutdown()

    # 2b. a client without /pause: requests keep arriving through a refit held open by a slow
    #     rank; the engine makes the version whole inside update_weights, so none of them fails
    engine = _connect({**refit, "port": next(ports)}, rank, built, cfg, NoPauseClient(url))
    other = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:20].unsqueeze(0)
    for _ in range(3):  # the decode has settled on the sequence: teach the prompt another continuation
        train_step(built, optimizer, torch.cat([tokens[:, :PROMPT_LEN], other], dim=1))
    old, new = out["staged"]["new"], greedy_decode(built, prompt, NEW_TOKENS)
    load = Load(url, prompt) if rank == 0 else None
    if load is not None:  # one whole answer of the old version before the refit starts (a slow machine: >0.5 s)
        load.wait(1)
    else:
        time.sleep(0.5)
    if rank == 1:
        slow_next_refit(engine.source.weights, SLOW_RANK_S)
    window = [time.monotonic()]
    engine.send_weights(6)
    window.append(time.monotonic())
    out["no_pause"] = dict(old=old, new=new, window=window,
                           completions=load.stop(after=window[1], count=3) if load else [], **ask())
    engine.shutdown()

    # 3. engine-side errors at init reach every train rank within seconds
    out["init_errors"] = {
        "gen_tp": _error(lambda: _connect({**refit, "gen_tp": 2, "port": next(ports)}, rank, built, cfg,
                                          HTTPClient(url))),
        "in_place": _error(lambda: _connect({**refit, "engine_load": "in_place", "port": next(ports)}, rank, built,
                                            cfg, HTTPClient(url))),
    }

    # 4. LoRA: adapters on the trained model; the first refit is full, later ones adapters only
    built = replace(built, model=apply_lora(built.model, dim=LORA_DIM, alpha=LORA_ALPHA))
    optimizer = torch.optim.Adam([p for p in built.model[0].parameters() if p.requires_grad], lr=1e-2)
    engine = _connect({**refit, "port": next(ports)}, rank, built, cfg, HTTPClient(url))
    out["lora"] = [refit_once(engine, step) for step in (7, 8)]

    # 5. the server killed: the next refit fails on every train rank at once; a restarted
    #    server joins as replica 0 again and the refit after lands in full
    if rank == 0:
        os.killpg(server_pid, signal.SIGKILL)
        time.sleep(1.0)
    out["killed"] = _error(lambda: refit_once(engine, 9, steps=1))
    if rank == 0:
        server = VllmServer(**restart).start()
        Path(restart["log"]).with_suffix(".pid").write_text(str(server.process.pid))  # serves on: see conftest
        out["restart_s"] = server.wait_ready()
        out["rejoined"] = engine.add_engine(HTTPClient(url), replica=0)
    out["after_restart"] = refit_once(engine, 10)
    engine.shutdown()
    torch.distributed.destroy_process_group()
    return out


def session_tp2(rank: int, world: int, port: int, url: str, server_pid: int, refit_port: int, save_dir: str,
                break_file: str):
    """Gen TP2 in one server (two vLLM workers) of a tiny Qwen3-MoE trained at TP2xEP2,
    ``verify_serving: on``: two refits (the second a delta); then one refit for each way
    ``tests/engines/vllm_server/breaks`` breaks the server's post-load step (:data:`TP2_BREAKS`), each of
    which the serving check must catch on replica 0, the refit after each a full one; a last one,
    right again; then this rank's pieces of the last version saved for the offline ``LLM`` run
    (``offline.py``)."""
    from conversion.refit import local_pieces
    from conversion.serving import trainer_forward
    from conversion.testing.train_step import greedy_decode, train_step
    from megatron_refit.plan.probe import make_probe

    cfg, built, tokens, prompt, optimizer = _trainer(rank, world, port, seed=2, model="qwen3-moe", ep=2)
    wait_healthy(url, alive=process_alive(server_pid))
    engine = _connect(dict(engine="vllm", gen_tp=2, timeout_s=60, delta="on", verify_serving="on", port=refit_port),
                      rank, built, cfg, HTTPClient(url))

    def refit_once(step: int) -> dict:
        train_step(built, optimizer, tokens)
        report = engine.send_weights(step)
        served = dict(tokens=complete(url, prompt, NEW_TOKENS), version=weight_version(url)) if rank == 0 else {}
        return dict(step=step, delta=report.delta, megatron=greedy_decode(built, prompt, NEW_TOKENS),
                    checked=report.summary["refit/serving_checked"],
                    dlogprob=report.summary["refit/serving_max_dlogprob"],
                    calibrated=report.summary["refit/serving_calibrated"],
                    serving_s=report.summary["refit/serving_s"], refit_s=report.summary["refit/total_s"], **served)

    refits = [refit_once(step) for step in (1, 2)]
    broken = {}
    for step, how in enumerate(TP2_BREAKS, start=3):
        if rank == 0:
            with open(break_file, "w") as f:
                f.write(how)
        torch.distributed.barrier()
        broken[how] = _error(lambda: refit_once(step))  # noqa: B023 -- called at once
        if rank == 0:
            os.remove(break_file)
        torch.distributed.barrier()
    refits.append(refit_once(3 + len(TP2_BREAKS)))
    engine.shutdown()
    train_step(built, optimizer, tokens)  # a version the offline engine has not seen
    weights, adapters = local_pieces(built.bridge, built.model, cfg)
    probe = make_probe(None, cfg.vocab_size).sequences  # what the offline run's serving check asks LLMClient
    forward = trainer_forward(built.model, cfg)
    logprobs = forward(probe)
    torch.save(dict(weights=[(p.spec, p.tensor().detach().clone()) for p in weights], prompt=prompt,
                    megatron=greedy_decode(built, prompt, NEW_TOKENS), probe=[list(q) for q in probe],
                    logprobs=logprobs, scale=forward.scale, vocab_size=cfg.vocab_size),
               os.path.join(save_dir, f"rank{rank}.pt"))
    torch.distributed.destroy_process_group()
    return dict(refits=refits, broken=broken)


def session_moe(rank: int, world: int, port: int, url: str, server_pid: int, refit_port: int, break_file: str):
    """A tiny Qwen3-MoE (4 experts, top-2) trained at TP2xEP2 into a running server at gen TP1,
    deltas, ``swap: staged`` (``drain``) and ``verify_serving: on``: three refits, each while
    clients keep asking the server (``LOAD_LENGTHS``; every answer with the weight version that
    sampled it) and each compared by what the server serves (its greedy tokens and its
    ``prompt_logprobs`` on the probe) with Megatron's own; then one made live by vLLM's fused-MoE
    reload as it is without megatron_refit's fix (``tests/engines/vllm_server/breaks``: the experts
    left unpacked), which the serving check must catch on replica 0; then one after it, which
    cannot be prepared beside the live model (injected) and so loads under the pause."""
    from conversion.serving import trainer_forward
    from conversion.testing.train_step import greedy_decode, train_step
    from megatron_refit.testing.vllm_server import GenerateLoad

    cfg, built, tokens, prompt, optimizer = _trainer(rank, world, port, seed=3, model="qwen3-moe", ep=2)
    wait_healthy(url, alive=process_alive(server_pid))
    refit = dict(engine="vllm", gen_tp=1, timeout_s=60, delta="on", verify_serving="on", swap="staged",
                 port=refit_port)
    engine = _connect(refit, rank, built, cfg, HTTPClient(url, swap="staged"))
    probe = engine.fleet.serving.probe.sequences
    forward = trainer_forward(built.model, cfg)

    def refit_once(step: int, loaded: bool = True) -> dict:
        for _ in range(2):
            train_step(built, optimizer, tokens)
        # (not while a refit fails its check: the server is then held, and a request waits in it)
        load = GenerateLoad(url, prompt, list(LOAD_LENGTHS)) if rank == 0 and loaded else None
        try:
            report = engine.send_weights(step)
        finally:
            answers = load.stop() if load is not None else []
        out = dict(step=step, delta=report.delta, megatron=greedy_decode(built, prompt, NEW_TOKENS),
                   megatron_logprobs=forward(probe), answers=answers,
                   unprepared=report.summary["refit/swap_unprepared"],
                   serving={k: v for k, v in report.summary.items() if k.startswith("refit/serving")})
        if rank == 0:
            out.update(tokens=complete(url, prompt, NEW_TOKENS), logprobs=HTTPClient(url).score(probe),
                       version=weight_version(url))
        return out

    out = dict(refits=[refit_once(step) for step in (1, 2, 3)])
    if rank == 0:
        with open(break_file, "w") as f:
            f.write("moe_reload")
    torch.distributed.barrier()
    out["broken"] = _error(lambda: refit_once(4, loaded=False))
    if rank == 0:
        out["paused_after_broken"] = is_paused(url)
        os.remove(break_file)
    torch.distributed.barrier()
    if rank == 0:  # the version after it cannot be prepared: it loads under the pause, warned
        with open(break_file, "w") as f:
            f.write("not_preparable")
    torch.distributed.barrier()
    out["after"] = refit_once(5, loaded=False)
    engine.shutdown()
    torch.distributed.destroy_process_group()
    return out
