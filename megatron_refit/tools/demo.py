"""``python -m megatron_refit.demo``: refit a tiny Megatron model into generation ranks.

Train ranks build the model through Megatron-Bridge and take a real optimizer step
before every refit; generation ranks hold a Hugging Face transformers model (gen TP 1)
or vLLM-shaped storage (gen TP > 1); everything runs on gloo. After each refit the
generation weights are checked bit for bit against Bridge's ``export_hf_weights`` and,
where a rank holds a whole model, its logits against the Megatron forward.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace

from megatron_refit.families import FAMILIES, PRESETS
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.tools.cli import USER_ERRORS, plain
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, hf_config_for, run
from megatron_refit.local.launch import SpawnError

MODELS = [name for family in FAMILIES for name in family.demo]
MOE_MODELS = tuple(name for name in MODELS if PRESETS[name].get("num_experts") or PRESETS[name].get("n_routed_experts"))

LOGIT_TOLERANCE = {"float32": 1e-5}
"""Logits must match the Megatron forward this closely; in bf16 two implementations of the
same weights differ by bf16 rounding, so the difference is reported, not judged."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and every option's default (unless its help says it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megatron_refit.demo", description=plain(__doc__),
                                formatter_class=_HelpFormatter)
    p.add_argument("--model", default="qwen3", choices=MODELS,
                   help="tiny preset (one per model family)")
    for flag in ("hidden", "layers", "heads", "kv-heads", "experts", "vocab", "ffn"):
        p.add_argument(f"--{flag}", type=int, default=None,
                       help=f"override the preset's {flag} (default: the preset's)")
    p.add_argument("--train-tp", type=int, default=2, help="trainer tensor parallelism")
    p.add_argument("--train-pp", type=int, default=1, help="trainer pipeline stages")
    p.add_argument("--train-ep", type=int, default=1, help="trainer expert parallelism (MoE presets)")
    p.add_argument("--train-dp", type=int, default=None, help="trainer data parallelism (default: the smallest that "
                                                              "fits EP)")
    p.add_argument("--gen-tp", type=int, default=1, help="generation tensor parallelism (1: a transformers model, "
                                                         ">1: vLLM-shaped storage)")
    p.add_argument("--gen-dp", type=int, default=2, help="generation replicas")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size in MiB")
    p.add_argument("--refits", type=int, default=3, help="refits, each after a real optimizer step")
    p.add_argument("--dtype", default=None, choices=["float32", "fp32", "bfloat16", "bf16"],
                   help="training dtype (default float32; bfloat16 with --fp8)")
    p.add_argument("--fp8", default=None, choices=["trainer", "te"],
                   help="trainer: quantize linear weights to 128x128-block FP8 on the train ranks (also runs "
                        "the same refit in bf16 and reports the byte ratio); te: Transformer Engine pass-through "
                        "(needs a GPU)")
    p.add_argument("--colocated", action="store_true",
                   help="bucket bytes through shared staging buffers (CUDA IPC on GPU, shared memory on CPU)")
    p.add_argument("--offload", action="store_true", help="trainer parameters in host memory between steps")
    p.add_argument("--lora", type=int, default=0, metavar="RANK",
                   help="train LoRA adapters of this rank (Bridge PEFT): refit 1 moves base + adapters, later "
                        "refits only the adapters, merged on the generation side (gen TP 1)")
    p.add_argument("--lr", type=float, default=1e-2,
                   help="learning rate of the optimizer step before each refit (bf16: Megatron's distributed "
                        "optimizer over fp32 main params)")
    p.add_argument("--delta", default="off", choices=["off", "on", "auto"],
                   help="refit.delta: after the first refit send only the elements that changed")
    p.add_argument("--swap", default="in_place", choices=["in_place", "staged"],
                   help="refit.swap: staged streams each refit into a copy while the engine serves, then swaps "
                        "(gen TP 1)")
    p.add_argument("--fanout", default="off", choices=["off", "chain", "tree", "auto"],
                   help="refit.fanout: the train ranks send each byte once, to the first replica, and the "
                        "replicas forward it (bytes sent: one replica's; relayed: the others')")
    p.add_argument("--fail-replica", default=None, metavar="R@V",
                   help="engine replica R raises while refit V lands (an engine error, as a CUDA fault would): "
                        "the other replicas land V, the report names R, and refit V+1 brings it back "
                        "(refit.on_replica_failure: continue)")
    p.add_argument("--json", action="store_true", help="last line printed: one JSON object")
    p.add_argument("--verbose", action="store_true",
                   help="also show the ranks' third-party warnings and logs (Apex / TE fallbacks, deprecations)")
    return p.parse_args(argv)


FP8_SHAPE = dict(hidden=512, heads=4, kv_heads=2, head_dim=128, ffn=1536, vocab=256, layers=6)
"""Demo shape with ``--fp8`` (unless shape flags are given): every shard edge on the 128
grid, and linear weights dominating the bytes as in real models (embeddings stay bf16)."""


def spec_from_args(args) -> RunSpec:
    if args.fp8 == "te":
        raise ValueError("--fp8 te sends Transformer Engine Float8Blockwise params as they are; TE needs CUDA "
                         "(not available on this CPU demo): run it on a GPU node, or use --fp8 trainer")
    if args.refits < 1:
        raise ValueError(f"--refits must be >= 1, got {args.refits}")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be positive, got {args.bucket_mb}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr}")
    dp = args.train_dp or args.train_ep // math.gcd(args.train_tp, args.train_ep)
    overrides = {k: getattr(args, k.replace("-", "_")) for k in
                 ("hidden", "layers", "heads", "kv_heads", "experts", "vocab", "ffn")}
    if args.model not in MOE_MODELS and overrides["experts"]:
        raise ValueError(f"--experts needs an MoE model ({', '.join(MOE_MODELS)}), got --model {args.model}")
    if args.fp8 and args.model not in ("qwen3", "qwen3-moe"):
        # The FP8 demo shape and the quantized-role rules are Qwen3's; MLA / Llama FP8 untried.
        raise ValueError(f"--fp8 is tried with --model qwen3 / qwen3-moe only, got --model {args.model}")
    if args.fp8 and all(v is None for v in overrides.values()):
        overrides.update(FP8_SHAPE)
    fail_replica = None
    if args.fail_replica is not None:
        replica, at, version = args.fail_replica.partition("@")
        if not (at and replica.isdigit() and version.isdigit()):
            raise ValueError(f"--fail-replica takes REPLICA@VERSION (e.g. 1@2), got {args.fail_replica!r}")
        fail_replica = (int(replica), int(version))
    dtype = args.dtype or ("bfloat16" if args.fp8 else "float32")
    dtype = {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)
    return RunSpec(
        model=args.model,
        fp8=args.fp8 or "",
        colocated=args.colocated,
        offload=args.offload,
        lora_rank=args.lora,
        overrides={k: v for k, v in overrides.items() if v is not None},
        train=TrainLayout(tp=args.train_tp, pp=args.train_pp, ep=args.train_ep, dp=dp),
        gen=GenLayout(tp=args.gen_tp, dp=args.gen_dp),
        bucket_bytes=int(args.bucket_mb * (1 << 20)),
        refits=args.refits,
        dtype=dtype,
        progress=True,
        lr=args.lr,
        delta=args.delta,
        swap=args.swap,
        fanout=args.fanout,
        fail_replica=fail_replica,
        verify_serving="on" if args.gen_tp == 1 else "off",  # HF replicas score the probe with their forward
    )


def _from_trainers(refit: dict, spec: RunSpec) -> int:
    """What a full refit's train ranks send: every replica's minimal bytes, or under fan-out (no
    relay routed around) one replica's."""
    if spec.fanout == "off" or not refit["bytes_relayed"] or refit["relay_fallbacks"]:
        return refit["bytes_minimal"]
    return refit["bytes_minimal"] // spec.gen.dp


def plan_line(summary: dict, replicas: int) -> str:
    """The plan's figures as a sentence (``RefitPlan.summary()`` of train rank 0's plan: one
    replica's group, the train ranks and that replica's gen ranks)."""
    s = summary
    each = s["bytes_sent"]
    total = f" ({each * replicas:,} to all {replicas})" if replicas > 1 else ""
    return (f"plan, built once per replica group ({s['num_train_ranks']} train + {s['num_gen_ranks']} gen ranks): "
            f"{s['num_transfers']} transfers, {each:,} bytes to each replica{total}, "
            f"{s['min_bytes_from_one_train_rank']:,}-{s['max_bytes_from_one_train_rank']:,} bytes from each train "
            f"rank; train rank 0 sends {s['num_buckets']} bucket(s) of at most {s['max_bucket_bytes']:,} bytes")


def format_table(result: dict) -> str:
    t, g = result["train"], result["gen"]
    deltas = result.get("delta", "off") != "off"
    fanout = result.get("fanout", "off") != "off"
    offload = bool(result.get("offload"))
    staged = any(r.get("pause_s") is not None for r in result["refits"])
    failures = any(r.get("failed_replicas") for r in result["refits"])
    lines = [
        f"model {result['model']} ({result['dtype']}{', FP8 ' + result['fp8'] if result.get('fp8') else ''}), "
        f"train TP{t['tp']}xPP{t['pp']}xEP{t['ep']}xDP{t['dp']}"
        f" -> gen TP{g['tp']}xDP{g['dp']}",
        plan_line(result["summary"], g["dp"]),
        f"{'ver':>3} {'bit-exact':>9} {'max|dlogit|':>11} {'served':>8} {'bytes sent':>11} {'minimal':>11} "
        f"{'total s':>8} {'pack s':>8} {'xfer s':>8} {'load s':>8} {'check s':>8} {'GB/s':>6}"
        + (f" {'full bytes':>11} {'sent/full':>9} {'density':>8}" if deltas else "")
        + (f" {'relayed':>11}" if fanout else "")
        + (f" {'onload s':>8} {'offload s':>9}" if offload else "")
        + (f" {'pause s':>8}" if staged else "")
        + (f" {'failed':>8}" if failures else ""),
    ]
    for r in result["refits"]:
        s = r["seconds"]
        diff = "n/a" if r["max_logit_diff"] is None else f"{r['max_logit_diff']:.2e}"
        checked = r.get("serving", {}).get("checked")
        served = f"{r['serving']['max_dlogprob']:.1e}" if checked else "n/a"
        check = f"{r['serving']['s']:.4f}" if checked else "n/a"
        gbps = r["bytes_sent"] / r["refit_s"] / 1e9 if r.get("refit_s") else 0.0
        lines.append(
            f"{r['version']:>3} {str(r['bit_exact']):>9} {diff:>11} {served:>8} {r['bytes_sent']:>11,} "
            f"{r['bytes_minimal']:>11,} "
            f"{s['total']:>8.4f} {s['pack']:>8.4f} {s['transfer']:>8.4f} {s['load']:>8.4f} {check:>8} {gbps:>6.2f}"
            + (f" {r['bytes_full']:>11,} {r['bytes_sent'] / r['bytes_full']:>9.3f} {r['density']:>8.4f}"
               if deltas else "")
            + (f" {r['bytes_relayed']:>11,}" if fanout else "")
            + (f" {s['onload']:>8.4f} {s['offload']:>9.4f}" if offload else "")
            + (f" {r['pause_s']:>8.4f}" if staged else "")
            + (f" {','.join(map(str, sorted(r['failed_replicas']))) or '-':>8}" if failures else "")
        )
    for r in result["refits"]:
        for replica, why in r.get("failed_replicas", {}).items():
            lines.append(f"refit {r['version']}: engine replica {replica} lost it ({why}); the other "
                         f"{r['replicas_ok']} replica(s) hold it, bit-exact: {r['bit_exact']}")
    if not any(r.get("serving", {}).get("checked") for r in result["refits"]) and result["gen"]["tp"] > 1:
        lines.append(f"served / check s / max|dlogit|: n/a at gen TP{result['gen']['tp']}: the demo's gen TP > 1 "
                     "receiver holds vLLM's layout and has no forward of its own (the running vLLM server's tests "
                     "check serving there: docs/guide-serving.md)")
    if "bytes_ratio_vs_bf16" in result:
        lines.append(f"FP8 bytes / bf16 bytes (same model and layout, measured): {result['refits'][-1]['bytes_sent']:,}"
                     f" / {result['bf16_bytes_sent']:,} = {result['bytes_ratio_vs_bf16']:.4f}")
    lines.append(f"ok: {result['ok']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        spec = spec_from_args(args)
        from conversion.validate import check_train_layout

        check_train_layout(hf_config_for(spec), spec.train)  # before any rank starts
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    quiet = not args.verbose
    try:
        result = evaluate(spec, run(spec, quiet=quiet)) | {"offload": spec.offload}
        if spec.fp8:
            # the same model and layout refit in bf16, for the byte ratio
            bf16 = replace(spec, fp8="", dtype="bfloat16", refits=1, collect=False)
            result["bf16_bytes_sent"] = evaluate(bf16, run(bf16, quiet=quiet))["refits"][0]["bytes_sent"]
            result["bytes_ratio_vs_bf16"] = result["refits"][-1]["bytes_sent"] / result["bf16_bytes_sent"]
    except SpawnError as exc:  # a bad layout or model found in a rank: one line, as for the parent's checks
        inner = exc.innermost
        if inner is None or inner[0] not in USER_ERRORS:
            raise
        print(f"error: {inner[1]}", file=sys.stderr)
        return 2
    diff = result["max_logit_diff"]
    tolerance = LOGIT_TOLERANCE.get(spec.dtype)
    # a full refit sends exactly the minimal bytes (under fan-out the train ranks send one replica's of
    # them, the replicas relay the others'); a delta refit less than a full one; and no replica lost a
    # refit, but the one --fail-replica names
    lost = [(r["version"], sorted(r["failed_replicas"])) for r in result["refits"] if r["failed_replicas"]]
    wanted = [] if spec.fail_replica is None else [(spec.fail_replica[1], [spec.fail_replica[0]])]
    result["ok"] = bool(result["bit_exact"]) and (diff is None or tolerance is None or diff <= tolerance) and all(
        r["bytes_sent"] <= r["bytes_full"] if r["delta"] else r["bytes_sent"] == _from_trainers(r, spec)
        for r in result["refits"]) and lost == wanted
    print(format_table(result))
    if args.json:
        out = {k: v for k, v in result.items() if k != "summary"}
        out["refits"] = [{k: v for k, v in r.items() if k != "loss"} for r in result["refits"]]
        print(json.dumps(out))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
