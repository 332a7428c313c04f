"""Checks that need an NVIDIA GPU (run by hand on a GPU machine; never in CI).

1. ``fp8``: blockwise FP8 quantization on the GPU equals the CPU reference bit for bit
   (data and ``weight_scale_inv``), and its throughput against a plain bf16 copy.
2. ``colocated``: refits with trainer (Megatron, via Bridge) and engine (HF transformers
   or vLLM-layout storage) on the same GPU, bucket bytes through CUDA IPC staging buffers;
   bit-exact against Bridge's export, logits against the Megatron forward.
3. ``colocated_speed``: the same on the benchmark's 215M-parameter shape, seconds and GB/s.
4. ``nccl_one_gpu``: whether NCCL accepts two ranks on one GPU (it is expected to refuse).
5. ``pretrain_callback``: Megatron-Bridge's real ``pretrain()`` (tiny Qwen3, mock data, bf16,
   DistributedOptimizer) with ``RefitCallback`` on the GPU, colocated with a generation
   process on the same GPU (CUDA IPC); bit-exact against Bridge's export at the start and
   after every iteration (``tests/megatron/test_refit_callback.run_pretrain_refit``).

Every check runs on its own; a failure is recorded, not fatal. ``--out FILE`` writes the
results as JSON (also printed, last line). ``--device cpu`` runs the same checks on CPU
(shared memory instead of CUDA IPC) to try the script without a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from bench_refit import BENCH_SHAPE  # scripts/: the benchmark's model shape
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run
from megatron_refit.plan.layout import TrainLayout


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(fn, device: str, reps: int = 10) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check_fp8(device: str) -> dict:
    from megatron_refit.endpoint.fp8 import quantize_blockwise

    g = torch.Generator().manual_seed(0)
    cases = []
    for shape in [(1, 1), (127, 300), (128, 128), (129, 257), (1024, 4096)]:
        for dtype in (torch.float32, torch.bfloat16):
            for pow2 in (False, True):
                x = (torch.randn(shape, generator=g) * 3).to(dtype)
                x.view(-1)[0] = 0.0
                q_cpu, s_cpu = quantize_blockwise(x, pow2_scales=pow2)
                q_dev, s_dev = quantize_blockwise(x.to(device), pow2_scales=pow2)
                same = torch.equal(q_cpu.view(torch.uint8), q_dev.cpu().view(torch.uint8)) and torch.equal(
                    s_cpu, s_dev.cpu())
                cases.append(dict(shape=shape, dtype=str(dtype), pow2=pow2, bit_exact=same))
    big = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(big)
    t_copy = _median_seconds(lambda: out.copy_(big), device)
    t_quant = _median_seconds(lambda: quantize_blockwise(big), device)
    nbytes = big.numel() * big.element_size()
    return dict(
        bit_exact=all(c["bit_exact"] for c in cases),
        cases=len(cases),
        failures=[c for c in cases if not c["bit_exact"]],
        shape=[8192, 8192],
        copy_seconds=t_copy,
        quantize_seconds=t_quant,
        quantize_vs_copy=t_quant / t_copy,
        quantize_gb_per_s=nbytes / t_quant / 1e9,
    )


def check_colocated(device: str) -> dict:
    cases = {
        "qwen3 TP2 -> TP1xDP2 (HF), offload": RunSpec(
            model="qwen3", train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=2), refits=2,
            colocated=True, offload=True, device=device),
        "qwen3 TP1 -> TP2 (vLLM layout)": RunSpec(
            model="qwen3", train=TrainLayout(tp=1), gen=GenLayout(tp=2, dp=1), refits=2,
            colocated=True, device=device),
        "qwen3-moe TP1xEP2 -> TP1 (HF)": RunSpec(
            model="qwen3-moe", train=TrainLayout(tp=1, ep=2, dp=2), gen=GenLayout(tp=1, dp=1), refits=2,
            colocated=True, device=device),
        "qwen3 bf16 FP8-trainer TP1 -> TP1 (HF)": RunSpec(
            model="qwen3", overrides=dict(hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=256), dtype="bfloat16",
            fp8="trainer", train=TrainLayout(tp=1), gen=GenLayout(tp=1, dp=1), refits=2,
            colocated=True, device=device),
    }
    out = {}
    for name, spec in cases.items():
        try:
            t0 = time.perf_counter()
            summary = evaluate(spec, run(spec))
            out[name] = dict(
                ok=bool(summary["bit_exact"]),
                bit_exact=summary["bit_exact"],
                max_logit_diff=summary["max_logit_diff"],
                bytes_shared=summary["bytes_shared"],
                bytes_sent=[r["bytes_sent"] for r in summary["refits"]],
                refit_seconds=[r["seconds"]["total"] for r in summary["refits"]],
                onload_seconds=[r["seconds"]["onload"] for r in summary["refits"]],
                offload_seconds=[r["seconds"]["offload"] for r in summary["refits"]],
                wall_seconds=time.perf_counter() - t0,
            )
        except Exception:  # noqa: BLE001 -- recorded, the other checks go on
            out[name] = dict(ok=False, error=traceback.format_exc()[-3000:])
        print(name, json.dumps(out[name])[:600], flush=True)
    return out


def check_colocated_speed(device: str, refits: int = 6) -> dict:
    spec = RunSpec(model="qwen3", overrides=dict(BENCH_SHAPE), dtype="bfloat16", train=TrainLayout(tp=1),
                   gen=GenLayout(tp=1, dp=1), refits=refits, collect=False, colocated=True, device=device,
                   bucket_bytes=64 << 20)
    summary = evaluate(spec, run(spec))
    later = summary["refits"][1:]  # the first refit allocates and maps the staging buffers
    seconds = statistics.median(r["seconds"]["total"] for r in later)
    nbytes = later[0]["bytes_sent"]
    return dict(bytes=nbytes, median_seconds=seconds, gb_per_s=nbytes / seconds / 1e9,
                seconds=[r["seconds"]["total"] for r in summary["refits"]],
                pack=[r["seconds"]["pack"] for r in summary["refits"]],
                load=[r["seconds"]["load"] for r in summary["refits"]])


def _nccl_rank(rank, world, port):
    from megatron_refit.transport import ProcessGroupTransport

    torch.cuda.set_device(0)
    group = ProcessGroupTransport.connect(host="127.0.0.1", port=port, rank=rank, world_size=world, backend="nccl",
                               timeout_s=30)
    t = torch.full((4,), float(rank), device="cuda")
    if rank == 0:
        group.wait(group.isend(t, 1, 0))
    else:
        group.wait(group.irecv(t, 0, 0))
    return t.tolist()


def check_nccl_one_gpu() -> dict:
    from megatron_refit.local.launch import run_spawned

    try:
        return dict(accepted=True, result=run_spawned(_nccl_rank, 2, timeout_s=90))
    except Exception as exc:  # noqa: BLE001
        return dict(accepted=False, error=str(exc)[-1500:])


def check_overlap(device: str) -> dict:
    """``refit.overlap: on`` on the device: the snapshot a device-to-device copy, the send on a
    CUDA stream of its own; every refit held until the next step changed the weights."""
    spec = RunSpec(model="qwen3", train=TrainLayout(tp=1), gen=GenLayout(tp=1, dp=1), refits=3, colocated=True,
                   device=device, overlap=True, hold_refits=True)
    results = run(spec)
    summary = evaluate(spec, results)
    overlapped = [item["overlapped"] for item in results[0]["refits"]]
    return dict(ok=bool(summary["bit_exact"]) and overlapped == [True, True, False], bit_exact=summary["bit_exact"],
                overlapped=overlapped, start_seconds=[item["start_s"] for item in results[0]["refits"]],
                refit_seconds=[r["seconds"]["total"] for r in summary["refits"]])


def check_pretrain_callback(device: str) -> dict:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.megatron.test_refit_callback import run_pretrain_refit

    result = run_pretrain_refit(tempfile.mkdtemp(prefix="pretrain_refit_"), num_train=1, device=device)
    result["ok"] = result["closed"] and all(c["bit_exact"] for c in result["checks"].values())
    for check in result["checks"].values():  # the received weights and RNG states: tensors, not a report's
        del check["weights"], check["rng"]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--only", nargs="*",
                   default=["fp8", "colocated", "colocated_speed", "nccl_one_gpu", "overlap", "pretrain_callback"])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    results: dict = dict(torch=torch.__version__, device=args.device)
    if args.device == "cuda":
        results["gpu"] = torch.cuda.get_device_name(0)
    checks = dict(fp8=lambda: check_fp8(args.device), colocated=lambda: check_colocated(args.device),
                  colocated_speed=lambda: check_colocated_speed(args.device), nccl_one_gpu=check_nccl_one_gpu,
                  overlap=lambda: check_overlap(args.device),
                  pretrain_callback=lambda: check_pretrain_callback(args.device))
    for name in args.only:
        t0 = time.perf_counter()
        try:
            results[name] = checks[name]()
        except Exception:  # noqa: BLE001
            results[name] = dict(ok=False, error=traceback.format_exc()[-3000:])
        print(f"== {name} ({time.perf_counter() - t0:.1f} s): {json.dumps(results[name])[:1500]}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
