"""FP8 vs bf16 refit, side by side in one run: same processes, model, layout and plan code.

Train ranks hold a bf16 Megatron model; (a) refits it as bf16, (b) with trainer-side
128×128 FP8 quantization (quantizing is inside the timed refit). Generation ranks hold
vLLM-layout storage (bf16, resp. FP8 weights + scale tiles). Warm-up, then ``--reps``
repetitions, medians of the slowest rank. Reports seconds, bytes and seconds per byte;
``--json`` last line: ``{"ok", "bytes_ratio", "time_per_byte_ratio", "seconds", "bytes",
"layout", "model_params"}`` (ok: bytes ratio ≤ 0.51 and time per byte within 10 % of bf16).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_refit import _timed, check_args, layout_parser  # noqa: E402

from megatron_refit.plan.gen_layout import GenLayout  # noqa: E402
from megatron_refit.tools.cli import reports_user_errors  # noqa: E402
from megatron_refit.local.harness import RunSpec, check_layout  # noqa: E402
from megatron_refit.plan.layout import TrainLayout  # noqa: E402

# Qwen3-shaped, ~150M parameters, every TP2 shard edge on the 128 grid; a small vocabulary
# so that the linear weights carry the bytes, as in large models.
FP8_BENCH_SHAPE = dict(hidden=1024, layers=12, heads=8, kv_heads=4, head_dim=128, ffn=3072, vocab=1024)


def bench_rank(rank, world, port, spec: RunSpec, reps: int):
    from megatron_refit.endpoint.receiver import Receiver
    from megatron_refit.endpoint.sender import Refitter
    from megatron_refit.endpoint.fp8_pieces import quantize_pieces
    from megatron_refit.local.harness import hf_config_for, make_gen_backend
    from megatron_refit.transport import ProcessGroupTransport

    torch.set_num_threads(1)  # 4+ processes share the cores: intra-op threads would oversubscribe them
    cfg = hf_config_for(spec)
    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=600)
    kw = dict(num_train=spec.num_train, num_gen=spec.num_gen, bucket_bytes=spec.bucket_bytes)
    is_train = rank < spec.num_train
    endpoints = {}
    if is_train:
        from conversion.testing.build import build_model, init_gloo, init_model_parallel
        from conversion.local_shards import enumerate_local_shards

        init_gloo(rank, spec.num_train, spec.megatron_port, timeout_s=600)
        init_model_parallel(spec.train)
        built = build_model(cfg, spec.train, dtype=torch.bfloat16)
        shards = enumerate_local_shards(built.bridge, built.model, cfg)
        endpoints["bf16"] = Refitter(group, shards, **kw)
        endpoints["fp8"] = Refitter(group, quantize_pieces(shards), **kw)
    else:
        gen_index = rank - spec.num_train
        endpoints["bf16"] = Receiver(group, make_gen_backend(replace(spec, fp8=""), cfg, gen_index), **kw)
        endpoints["fp8"] = Receiver(group, make_gen_backend(replace(spec, fp8="trainer"), cfg, gen_index), **kw)
    plans = {key: e.prepare() for key, e in endpoints.items()}
    times = {key: [] for key in endpoints}
    phases = {}
    for v in range(1, reps + 2):  # round 1 is the warm-up
        for key, e in endpoints.items():
            t = _timed(lambda: phases.__setitem__(key, (e.refit(v) if is_train else e.receive(v)).seconds), group)
            if v > 1:
                times[key].append(t)
    return dict(times=times, phases=phases, bytes={k: p.bytes_sent for k, p in plans.items()},
                num_params=sum(p.numel() for p in built.model[0].parameters()) if is_train else 0)


@reports_user_errors
def main(argv=None) -> int:
    p = layout_parser(__doc__)
    p.add_argument("--layers", type=int, default=FP8_BENCH_SHAPE["layers"])
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    check_args(args)
    from megatron_refit.local.launch import free_ports, run_spawned

    megatron_port, refit_port = free_ports(2)
    spec = RunSpec(model="qwen3", overrides=dict(FP8_BENCH_SHAPE, layers=args.layers),
                   train=TrainLayout(tp=args.train_tp), gen=GenLayout(tp=args.gen_tp, dp=args.gen_dp),
                   bucket_bytes=int(args.bucket_mb * (1 << 20)), dtype="bfloat16", megatron_port=megatron_port,
                   collect=False)
    check_layout(spec)  # before any rank starts
    out = run_spawned(bench_rank, spec.num_train + spec.num_gen, spec, args.reps, timeout_s=1800, port=refit_port)
    seconds = {k: statistics.median(max(r["times"][k][i] for r in out) for i in range(args.reps))
               for k in ("bf16", "fp8")}
    nbytes = out[0]["bytes"]
    per_byte = {k: seconds[k] / nbytes[k] for k in seconds}
    layout = f"train {spec.train.describe()} -> gen TP{spec.gen.tp}xDP{spec.gen.dp}"
    result = dict(bytes_ratio=nbytes["fp8"] / nbytes["bf16"], time_per_byte_ratio=per_byte["fp8"] / per_byte["bf16"],
                  seconds=seconds, bytes=nbytes, layout=layout,
                  model_params=sum(r["num_params"] for r in out[: spec.num_train]))
    result["ok"] = result["bytes_ratio"] <= 0.51 and result["time_per_byte_ratio"] <= 1.10
    print(f"{'':6s} {'seconds':>8} {'bytes':>14} {'ns/byte':>8}   ({layout}, ~{result['model_params'] / 1e6:.0f}M "
          f"params, median of {args.reps})")
    for k in ("bf16", "fp8"):
        print(f"{k:6s} {seconds[k]:8.3f} {nbytes[k]:14,} {per_byte[k] * 1e9:8.3f}")
    print(f"bytes fp8/bf16 = {result['bytes_ratio']:.4f} (target <= 0.51); time per byte fp8/bf16 = "
          f"{result['time_per_byte_ratio']:.3f} (target <= 1.10): {'met' if result['ok'] else 'NOT met'}")
    for r, rank in enumerate(out):
        print(f"rank {r} phase seconds (last rep): " + "; ".join(
            f"{k}: " + ", ".join(f"{p} {x:.3f}" for p, x in rank["phases"][k].items()) for k in ("bf16", "fp8")))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
