"""Zero-downtime refits: the engine generates while refits arrive (``refit.swap``).

A Megatron trainer (TP ``--train-tp``) takes a real optimizer step before each refit; one
generation rank (Hugging Face transformers) runs greedy forward passes in a thread of its
own the whole time, each tagged with the version of the weights it used. Per refit:

- ``transfer_s``: the refit on the generation rank, from the handshake (the trainer's step
  done) to every byte moved, checked and applied;
- ``pause_s``: the time generation could not run because of the refit (``staged``: the
  swap; ``in_place``: the whole refit, the engine being ``updating``);
- ``tokens_during_transfer``: forward passes that ran entirely inside the transfer;
- ``bit_exact``: the served weights after the swap equal Bridge's export of that version.

Every forward pass's logits are then recomputed from the exact weights of the version it
was tagged with: ``tags_consistent`` says each one matches, i.e. no pass mixed versions.
``--json``: the last line is one JSON object (``pause_s``, ``transfer_s``,
``tokens_during_transfer``, ``bit_exact``, ``tags_consistent``, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.tools.cli import reports_user_errors
from megatron_refit.local.harness import RunSpec, check_layout

SHAPE = dict(hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn=1536, vocab=4096)
"""About 30M parameters: a refit takes long enough on this CPU to generate during it."""
PROMPT = torch.arange(8).view(1, 8)


def _train(rank, spec: RunSpec, cfg, refit_cfg):
    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from conversion.testing.train_step import train_step
    from conversion.refit import trainer_refit
    from megatron_refit.local.harness import tokens_for

    init_gloo(rank, spec.num_train, spec.megatron_port)
    init_model_parallel(spec.train)
    built = build_model(cfg, spec.train, dtype=torch.float32)
    fleet = trainer_refit(refit_cfg, built.bridge, built.model, cfg, rank=rank, num_train=spec.num_train)
    optimizer = torch.optim.Adam([p for chunk in built.model for p in chunk.parameters()], lr=1e-4)
    exports = {}
    for version in range(1, spec.refits + 1):
        if version > 1:
            train_step(built, optimizer, tokens_for(version, cfg.vocab_size))
        fleet.refit(version)
        export = {n: t.detach().clone() for n, t in built.bridge.export_hf_weights(built.model, cpu=True,
                                                                                    show_progress=False)}
        exports[version] = export if rank == 0 else None
    fleet.close()
    return dict(role="train", exports=exports)


def _generate(backend, stop: threading.Event, passes: list) -> None:
    from megatron_refit.errors import StaleWeightsError

    while not stop.is_set():
        start = time.perf_counter()
        try:
            logits, version = backend.step(PROMPT)
        except StaleWeightsError:  # in place: nothing to serve while a refit writes the weights
            time.sleep(0.0005)
            continue
        passes.append((start, time.perf_counter(), version, logits[0, -1]))


def _hold_swap_for_a_pass(backend, passes: list, bound_s: float = 30.0) -> None:
    """Before each swap, wait (at most ``bound_s``) until a forward pass has started and ended
    after the swap was due: whatever the load on the machine, a staged engine then shows it
    serves the previous version inside the refit's window. An engine that cannot serve while a
    refit is open shows no such pass (the window then holds none of the previous version)."""
    finalize = backend.finalize

    def held():
        due, deadline = time.perf_counter(), time.perf_counter() + bound_s
        while time.perf_counter() < deadline and not any(p[0] >= due for p in passes[-3:]):
            time.sleep(0.002)
        finalize()

    backend.finalize = held


def _gen(spec: RunSpec, cfg, refit_cfg, hold_swap: bool):
    from megatron_refit.engine_side.entry import engine_refit
    from megatron_refit.local.harness import make_gen_backend

    backend = make_gen_backend(spec, cfg, 0)
    member = engine_refit(refit_cfg, backend, gen_index=0, num_train=spec.num_train)
    member.receive(1)  # the engine starts from the trainer's weights, then serves
    passes, refits, weights = [], [], {1: backend.state_dict_hf()}
    if hold_swap:
        _hold_swap_for_a_pass(backend, passes)
    stop = threading.Event()
    thread = threading.Thread(target=_generate, args=(backend, stop, passes), daemon=True)
    thread.start()
    try:
        for version in range(2, spec.refits + 1):
            time.sleep(0.05)  # serve a while between refits
            report = member.receive(version)
            end = time.perf_counter()
            transfer = report.seconds["total"]  # from the handshake (the trainer's step is done) to applied
            pause = getattr(backend, "last_pause_s", None)  # staged: the swap; in place: all of it
            refits.append(dict(version=version, start=end - transfer, end=end, transfer_s=transfer,
                               pause_s=transfer if pause is None else pause))
            weights[version] = backend.state_dict_hf()
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join()
    member.close()
    # every pass against a forward of exactly the weights of the version it was tagged with
    from megatron_refit.engines.hf.storage import HFStorage

    reference = HFStorage(backend.model.__class__(backend.model.config).eval())
    expected = {}
    for version, state in weights.items():
        for name, t in state.items():
            reference.buffer(name).copy_(t)
        reference.set_state("ready", version)
        expected[version] = reference.logits(PROMPT)[0, -1]
    consistent = all(torch.equal(logits, expected[version]) for _, _, version, logits in passes)
    for r in refits:
        inside = [p for p in passes if r["start"] <= p[0] and p[1] <= r["end"]]
        r["tokens_during_transfer"] = len(inside)
        r["versions_during_transfer"] = sorted({p[2] for p in inside})
    tags = [p[2] for p in passes]
    return dict(role="gen", refits=refits, weights=weights, passes=len(passes), tags_consistent=consistent,
                tags_monotonic=tags == sorted(tags), versions_served=sorted(set(tags)))


def swap_rank(rank, world, port, spec: RunSpec, hold_swap: bool = False):
    from megatron_refit.local.harness import hf_config_for, refit_config

    torch.manual_seed(0)
    cfg = hf_config_for(spec)
    refit_cfg = refit_config(spec, port)
    return _train(rank, spec, cfg, refit_cfg) if rank < spec.num_train else _gen(spec, cfg, refit_cfg, hold_swap)


def run_swap(spec: RunSpec, *, hold_swap: bool = False) -> dict:
    """``hold_swap`` (tests): each swap waits for one forward pass that starts after it was due
    (:func:`_hold_swap_for_a_pass`), so that a loaded machine cannot starve the generation thread
    of the whole window; it lengthens the transfers it measures, so the bench leaves it off."""
    from dataclasses import replace

    from megatron_refit.local.launch import free_ports, run_spawned

    megatron_port, refit_port = free_ports(2)
    spec = replace(spec, megatron_port=megatron_port)
    out = run_spawned(swap_rank, spec.num_train + 1, spec, hold_swap, timeout_s=600, port=refit_port)
    exports, gen = out[0]["exports"], out[-1]
    bit_exact = all(set(gen["weights"][v]) <= set(exports[v]) and
                    all(torch.equal(t, exports[v][n]) for n, t in gen["weights"][v].items()) for v in exports)
    refits = gen["refits"]
    pause = statistics.median(r["pause_s"] for r in refits)
    transfer = statistics.median(r["transfer_s"] for r in refits)
    return dict(swap=spec.swap, pause_s=pause, transfer_s=transfer, pause_ratio=pause / transfer,
                tokens_during_transfer=sum(r["tokens_during_transfer"] for r in refits), bit_exact=bit_exact,
                tags_consistent=gen["tags_consistent"], tags_monotonic=gen["tags_monotonic"],
                versions_served=gen["versions_served"], passes=gen["passes"],
                per_refit=[{k: r[k] for k in ("version", "transfer_s", "pause_s", "tokens_during_transfer",
                                              "versions_during_transfer")} for r in refits])


@reports_user_errors
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train-tp", type=int, default=2, help="trainer tensor parallelism")
    p.add_argument("--refits", type=int, default=6, help="refits while generating (the first precedes it)")
    p.add_argument("--budget-mb", type=float, default=None,
                   help="refit.swap_budget_mb: memory for the staged copy (default: the whole model)")
    p.add_argument("--also-in-place", action=argparse.BooleanOptionalAction, default=True,
                   help="also run refit.swap: in_place for comparison")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.refits < 2 or args.train_tp < 1:
        raise ValueError(f"--refits must be >= 2 and --train-tp >= 1, got {args.refits}, {args.train_tp}")
    if args.budget_mb is not None and not args.budget_mb >= 0:
        raise ValueError(f"--budget-mb must be >= 0, got {args.budget_mb}")
    budget = None if args.budget_mb is None else int(args.budget_mb * (1 << 20))
    rows = []
    for swap in ["staged"] + (["in_place"] if args.also_in_place else []):
        spec = RunSpec(model="qwen3", overrides=dict(SHAPE), train=TrainLayout(tp=args.train_tp),
                       gen=GenLayout(tp=1, dp=1), refits=args.refits, swap=swap, bucket_bytes=16 << 20,
                       swap_budget_bytes=budget if swap == "staged" else None)
        check_layout(spec)
        rows.append(run_swap(spec))
    print(f"{'swap':9} {'transfer s':>10} {'pause s':>9} {'pause/transfer':>14} {'tokens in transfer':>18} "
          f"{'bit-exact':>9} {'tags ok':>7}")
    for r in rows:
        print(f"{r['swap']:9} {r['transfer_s']:10.4f} {r['pause_s']:9.5f} {r['pause_ratio']:14.4f} "
              f"{r['tokens_during_transfer']:18} {str(r['bit_exact']):>9} {str(r['tags_consistent']):>7}")
    head = rows[0]
    head["ok"] = bool(head["pause_ratio"] <= 0.10 and head["tokens_during_transfer"] > 0 and head["bit_exact"]
                      and head["tags_consistent"] and head["tags_monotonic"])
    if len(rows) > 1:
        head["in_place"] = {k: rows[1][k] for k in ("pause_s", "transfer_s", "pause_ratio", "tokens_during_transfer",
                                                    "bit_exact", "tags_consistent")}
    print(f"staged: pause / transfer = {head['pause_ratio']:.4f} (target <= 0.10), "
          f"{head['tokens_during_transfer']} forward passes during transfers: {'ok' if head['ok'] else 'NOT ok'}")
    if args.json:
        print(json.dumps({k: v for k, v in head.items() if k != "per_refit"} | {"per_refit": head["per_refit"]}))
    return 0 if head["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
