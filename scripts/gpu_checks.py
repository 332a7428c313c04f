"""Every GPU check from one command (``make gpu-check``), on a machine with one NVIDIA GPU.

Runs, each in its own process with a time limit, and records one JSON line per check in
``results/gpu_checks_<date>.jsonl`` (``--out``), then prints one table:

- ``scripts/gpu_check.py`` (Megatron environment, ``.venv``): trainer-side FP8 on the device,
  colocated CUDA IPC into HF and vLLM-layout storage, its speed, NCCL on one GPU, an overlapped
  refit (``refit.overlap``: device snapshot, its own CUDA stream), Bridge's
  ``pretrain()`` with the refit callback; one line per check;
- ``scripts/gpu_check_vllm.py`` (``.venv-vllm``) and ``scripts/gpu_check_sglang.py``
  (``.venv-sglang``): the real engines, and ``scripts/gpu_check_vllm_draft.py``: vLLM decoding
  with the model's MTP layer as its speculative draft (``deepseek_mtp``), the draft refitted with
  the model (#67); each where its environment exists (a line saying ``skipped`` and why where it
  does not).

Nothing here needs two GPUs. Without a GPU (``torch.cuda.is_available()`` false in
``.venv``) it refuses with one line and exit code 2, before running anything.

    make gpu-check                      # or: .venv/bin/python scripts/gpu_checks.py [--only fp8 vllm]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("fp8", "colocated", "colocated_speed", "nccl_one_gpu", "overlap", "pretrain_callback")
"""``scripts/gpu_check.py``'s checks."""
ENGINES = {"vllm": (".venv-vllm", "gpu_check_vllm.py"), "vllm_draft": (".venv-vllm", "gpu_check_vllm_draft.py"),
           "sglang": (".venv-sglang", "gpu_check_sglang.py")}
CHECKS = (*CORE, *ENGINES)
LIMIT_S = {"colocated": 300, "pretrain_callback": 240, "vllm": 300, "vllm_draft": 420, "sglang": 300}
"""Seconds each check may run (others: :data:`DEFAULT_LIMIT_S`). On an H200 (2026-11-28) fp8 took
6 s, nccl_one_gpu 9, overlap 39; colocated (four cases, each spawning its ranks) ran past 120 s."""
DEFAULT_LIMIT_S = 120


def gpu_name() -> str | None:
    """The GPU's name, or None where torch sees none."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _run(cmd: list[str], limit_s: float, out_json: str) -> tuple[dict, float]:
    """Run one check's command; its result from ``out_json``. Its output goes to ``out_json``'s
    name with ``.log`` (what a check that ran past its limit got through)."""
    start = time.perf_counter()
    log = os.path.splitext(out_json)[0] + ".log"
    if os.path.exists(out_json):
        os.remove(out_json)  # an earlier run's
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            return dict(ok=False, error=f"ran past its limit of {limit_s:g} s (its output: {log})"), \
                time.perf_counter() - start
    seconds = time.perf_counter() - start
    try:
        with open(out_json) as f:
            return json.load(f), seconds
    except (OSError, ValueError):
        with open(log) as f:
            return dict(ok=False, error=f"exit code {code}: {f.read()[-1500:]}"), seconds


VERDICTS = {
    "fp8": lambda r: bool(r.get("bit_exact")),
    "colocated": lambda r: bool(r) and all(case.get("ok") for case in r.values() if isinstance(case, dict)),
    "colocated_speed": lambda r: r.get("gb_per_s", 0) > 0,
    "nccl_one_gpu": lambda r: "accepted" in r,  # informational: either answer is the device's
}
"""``scripts/gpu_check.py``'s checks whose result has no ``ok`` of its own: when they pass."""


def run_check(name: str, scratch: str) -> tuple[dict, float]:
    if name in CORE:
        out = os.path.join(scratch, f"{name}.json")
        result, seconds = _run([os.path.join(ROOT, ".venv", "bin", "python"), "scripts/gpu_check.py", "--only", name,
                                "--out", out], LIMIT_S.get(name, DEFAULT_LIMIT_S), out)
        result = result.get(name, result)
        if "ok" not in result:
            result = dict(result, ok=VERDICTS[name](result))
        return result, seconds
    venv, script = ENGINES[name]
    python = os.path.join(ROOT, venv, "bin", "python")
    if not os.path.exists(python):
        return dict(ok=None, skipped=f"no {venv} (make setup-{name})"), 0.0
    out = os.path.join(scratch, f"{name}.json")
    return _run([python, f"scripts/{script}", "--out", out], LIMIT_S.get(name, DEFAULT_LIMIT_S), out)


def table(rows: list[dict]) -> str:
    lines = [f"{'check':<18} {'result':<8} {'seconds':>8}  note"]
    for row in rows:
        result = row["result"]
        verdict = "skipped" if result.get("ok") is None else ("ok" if result.get("ok") else "FAILED")
        note = result.get("skipped") or (result.get("error") or "").strip().splitlines()[-1:] or [""]
        lines.append(f"{row['check']:<18} {verdict:<8} {row['seconds']:>8.1f}  "
                     f"{note if isinstance(note, str) else note[0]}"[:160])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="these checks only")
    p.add_argument("--out", default=None, help="JSON lines file (default: results/gpu_checks_<date>.jsonl)")
    args = p.parse_args(argv)
    gpu = gpu_name()
    if gpu is None:
        print("error: make gpu-check needs an NVIDIA GPU, and torch sees none here (torch.cuda.is_available() is "
              "False); the CPU suite is make test", file=sys.stderr)
        return 2
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(ROOT, "results", f"gpu_checks_{date}.jsonl")
    scratch = os.path.join(ROOT, "results", ".gpu_checks")
    os.makedirs(scratch, exist_ok=True)
    rows = []
    for name in args.only:
        result, seconds = run_check(name, scratch)
        row = dict(check=name, date=date, gpu=gpu, seconds=round(seconds, 1), result=result)
        rows.append(row)
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"== {name}: {'ok' if result.get('ok') else result.get('skipped') or 'FAILED'} ({seconds:.1f} s)",
              flush=True)
    print(table(rows))
    return 0 if all(r["result"].get("ok") is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
