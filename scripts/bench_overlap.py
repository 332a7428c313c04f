"""What a refit every iteration costs the training loop, blocking and overlapped (``refit.overlap``).

Megatron-Bridge's own ``pretrain()`` on the CPU setup of the callback tests (two train ranks,
TP1 x DP2 with the distributed optimizer, bf16, mock data; one Hugging Face generation rank),
three arms in one run, each its own training run of ``--iters`` iterations:

- ``none``: no refit;
- ``blocking``: ``RefitCallback`` with ``overlap: off`` (the iteration waits for every byte);
- ``overlap``: ``RefitCallback`` with ``overlap: on`` (a snapshot, then the bytes move while
  the next iteration trains).

``iter_s_*`` is the median time between the ends of consecutive iterations on train rank 0
(the first ``--warmup`` left out); ``stall_s_*`` the median time the refit callback holds the
training loop at an iteration's end (the training-step stall per refit that ``costmodel
--overlap`` predicts at scale). ``bit_exact``: after training, the engine's weights equal
Bridge's export of the trainer's last weights, in both refitting arms. ``snapshot_s`` /
``snapshot_mb``: the overlap arm's copy at each step boundary (median seconds; the snapshot's
bytes, the extra memory it holds). ``--json``: the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

from megatron_refit.tools.cli import reports_user_errors

LARGER = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=4096)
"""``--larger``: about 5M parameters, a refit costs a third of an iteration here (the
default is the callback tests' model: ``qwen3`` of ``conversion.presets``)."""
ARMS = ("none", "blocking", "overlap")


def _train(rank, args, arm, refit):
    from conversion.refit_callback import RefitCallback
    from conversion.te_shim import import_bridge
    from conversion.presets import hf_config
    from conversion.testing.tiny_pretrain import run_tiny_pretrain

    import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.callbacks import Callback

    cfg = hf_config("qwen3", **args.shape)
    bridge = AutoBridge.from_hf_config(cfg)
    refit_callback = RefitCallback.from_config(refit, bridge) if refit is not None else None
    ends, out = [], {}

    stalls = []

    class After(Callback):  # after the refit callback: how long it held the training loop
        def on_train_step_end(self, context):
            stalls.append(time.perf_counter() - ends[-1])

    class Timing(Callback):
        def on_train_step_end(self, context):
            ends.append(time.perf_counter())

        def on_train_end(self, context):  # the last weights, as the last refit took them
            if refit_callback is not None:
                got = bridge.export_hf_weights(context.model, cpu=True, show_progress=False)
                out["export"] = {n: t.detach().clone() for n, t in got} if rank == 0 else None
                background = refit_callback.fleet.background
                if background is not None:
                    out["snapshot_mb"] = background.snapshot.nbytes / 1e6

    # Timing's on_train_end runs before the refit callback's (which closes the refit)
    callbacks = [Timing()] + ([refit_callback] if refit_callback else []) + [After()]
    snapshot_s = []
    if refit_callback is not None and refit.overlap == "on":
        from megatron_refit.fleet.overlap import Snapshot

        take = Snapshot.take

        def timed(self, names):
            snapshot_s.append(take(self, names))
            return snapshot_s[-1]

        Snapshot.take = timed
    run_tiny_pretrain(cfg, train_iters=args.iters, callbacks=callbacks, dp=2,
                      overlap_param_gather=args.overlap_param_gather)
    steps = [b - a for a, b in zip(ends, ends[1:])][args.warmup:]
    return dict(out, iter_s=statistics.median(steps), stall_s=statistics.median(stalls[args.warmup:]),
                snapshot_s=statistics.median(snapshot_s) if snapshot_s else None,
                last=refit_callback.last_report.version if refit_callback else None)


def _gen(refit, args):
    from conversion.presets import hf_config
    from megatron_refit.engines.hf.storage import HFStorage
    from megatron_refit.engine_side.entry import engine_refit

    if args.engine_nice:  # the engine's process yields these shared cores to the trainer's
        os.nice(args.engine_nice)
    backend = HFStorage.from_config(hf_config("qwen3", **args.shape), dtype=torch.bfloat16)
    member = engine_refit(refit, backend, gen_index=0, num_train=2)
    for version in range(args.iters + 1):
        member.receive(version)
    weights = {n: t.clone() for n, t in backend.state_dict_hf().items()}
    member.close()
    return dict(weights=weights)


def _rank(rank, world, port, args, arm, megatron_port):
    from megatron_refit.config import RefitConfig

    os.environ.update(WORLD_SIZE="2", MASTER_PORT=str(megatron_port))
    if not args.verbose:  # Bridge's own per-iteration log lines
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 -- for the rank's life
    refit = None if arm == "none" else RefitConfig(enabled=True, engine="hf", port=port, bucket_mb=args.bucket_mb,
                                                   timeout_s=300, overlap="on" if arm == "overlap" else "off")
    if rank < 2:
        return _train(rank, args, arm, refit)
    return _gen(refit, args)


def run_arm(args, arm: str) -> dict:
    from megatron_refit.local.launch import free_ports, run_spawned

    port, megatron_port = free_ports(2)
    with tempfile.TemporaryDirectory() as cwd:  # Bridge writes nothing we keep
        here = os.getcwd()
        os.chdir(cwd)
        try:
            out = run_spawned(_rank, 2 if arm == "none" else 3, args, arm, megatron_port, port=port, timeout_s=600)
        finally:
            os.chdir(here)
    train = out[0]
    result = dict(iter_s=train["iter_s"], stall_s=train["stall_s"], snapshot_s=train["snapshot_s"],
                  snapshot_mb=train.get("snapshot_mb"))
    if arm != "none":
        got, want = out[2]["weights"], train["export"]
        result["bit_exact"] = bool(got) and train["last"] == args.iters and all(
            torch.equal(t, want[n]) for n, t in got.items())
    return result


@reports_user_errors
def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20, help="training iterations per arm")
    parser.add_argument("--warmup", type=int, default=4, help="iterations left out of the median")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--larger", action="store_true", help="a 5M-parameter model instead of the tests' one")
    parser.add_argument("--overlap-param-gather", action="store_true",
                        help="DDP overlaps the param all-gather with the next forward (a refit then forces it "
                             "at the step boundary, in both refitting arms)")
    parser.add_argument("--engine-nice", type=int, default=0,
                        help="run the engine's process at this nice value (on a cluster it has its own machines)")
    parser.add_argument("--verbose", action="store_true", help="Bridge's own log lines from the ranks")
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    args = parser.parse_args(argv)
    args.shape = LARGER if args.larger else {}
    if args.iters < args.warmup + 3:
        raise ValueError(f"--iters {args.iters}: needs at least --warmup + 3 = {args.warmup + 3} iterations")
    if args.warmup < 1:
        raise ValueError(f"--warmup {args.warmup}: the first iteration (start-up) must be left out")
    arms = {}
    for arm in ARMS:
        t0 = time.perf_counter()
        arms[arm] = run_arm(args, arm)
        print(f"{arm:>9}: {arms[arm]['iter_s'] * 1e3:7.1f} ms per iteration, the refit callback holding it "
              f"{arms[arm]['stall_s'] * 1e3:5.1f} ms  ({time.perf_counter() - t0:.0f} s run)", flush=True)
    result = dict(iter_s_none=arms["none"]["iter_s"], iter_s_blocking=arms["blocking"]["iter_s"],
                  iter_s_overlap=arms["overlap"]["iter_s"],
                  bit_exact=arms["blocking"]["bit_exact"] and arms["overlap"]["bit_exact"],
                  overlap_over_none=arms["overlap"]["iter_s"] / arms["none"]["iter_s"],
                  blocking_over_none=arms["blocking"]["iter_s"] / arms["none"]["iter_s"],
                  stall_s_blocking=arms["blocking"]["stall_s"], stall_s_overlap=arms["overlap"]["stall_s"],
                  snapshot_s=arms["overlap"]["snapshot_s"], snapshot_mb=arms["overlap"]["snapshot_mb"],
                  iters=args.iters, shape=args.shape or "qwen3 (tests)",
                  overlap_param_gather=args.overlap_param_gather, engine_nice=args.engine_nice,
                  bucket_mb=args.bucket_mb)
    print(f"overlap / none {result['overlap_over_none']:.3f}, blocking / none {result['blocking_over_none']:.3f}, "
          f"snapshot {result['snapshot_s'] * 1e3:.2f} ms for {result['snapshot_mb']:.1f} MB, "
          f"bit_exact {result['bit_exact']}")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
