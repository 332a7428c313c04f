"""What the engine GPU checks share (``gpu_check_vllm.py``, ``gpu_check_sglang.py``).

Each check runs a controller in the engine's environment (it holds the engine, answers the
trainer's control calls, checks the engine after every refit) and a Megatron trainer process
in the Megatron environment on the same GPU, connected by a local
``multiprocessing.connection``: the trainer sends ``(method, payload)``, the controller
answers ``("ok", result)`` or ``("error", message)``; ``"check"`` asks for the checks of the
refit just made, ``"done"`` ends the run with the trainer's reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Client, Listener

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
             vocab_size=1024, num_hidden_layers=2)
MOE_SHAPE = dict(moe_intermediate_size=256)
MTP_SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512,
                 qk_nope_head_dim=64, qk_rope_head_dim=64, head_dim=64, v_head_dim=64, intermediate_size=512,
                 moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                 vocab_size=1024, num_hidden_layers=2, num_nextn_predict_layers=1)
"""A tiny DeepSeek-V3 with one MTP layer (``model.layers.2``, MoE like the last decoder layer): vLLM's
MLA takes ``kv_lora_rank`` 512 with ``qk_rope_head_dim`` 64 on every backend."""
MODELS = ("qwen3", "qwen3-moe")
PROMPT = [list(range(5, 21)), list(range(100, 116))]
STEPS_PER_REFIT, REFITS, NEW_TOKENS = 5, 3, 8
AUTH = b"megatron-refit-gpu-check"


def tiny_config(model: str):
    from conversion.presets import hf_config

    if model == "deepseek-v3-mtp":
        return hf_config("deepseek-v3", **MTP_SHAPE)
    return hf_config(model, **SHAPE, **(MOE_SHAPE if "moe" in model else {}))


def hf_greedy(export: dict, cfg) -> list[list[int]]:
    """Hugging Face transformers' greedy tokens for :data:`PROMPT` with ``export``'s weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(export, strict=False)
    out = model.generate(torch.tensor(PROMPT).cuda(), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, len(PROMPT[0]):].tolist()


def serve_trainer(script: str, trainer_python: str, model: str, workdir: str,
                  answer: Callable[[str, object], object]) -> dict:
    """Start ``script --trainer model workdir port`` in the Megatron environment and answer
    its calls with ``answer(method, payload)`` until it is done. Returns the trainer's
    result, its exit code, the checks' answers and the seconds of every call."""
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    trainer = subprocess.Popen([trainer_python, os.path.abspath(script), "--trainer", model, workdir,
                                str(listener.address[1])], cwd=ROOT)
    phases: dict[str, list[float]] = {}
    checks = []
    with listener.accept() as conn:
        while True:
            method, payload = conn.recv()
            if method == "done":
                conn.send(("ok", None))
                result = payload
                break
            t0 = time.perf_counter()
            try:
                reply = answer(method, payload)
                conn.send(("ok", reply))
            except Exception as exc:  # noqa: BLE001 -- handed to the trainer, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            phases.setdefault(method, []).append(time.perf_counter() - t0)
            if method == "check":
                checks.append(reply)
    trainer.wait(timeout=300)
    return dict(result=result, returncode=trainer.returncode, checks=checks, phases=phases)


class ControllerConnection:
    """The trainer's end of the connection (one call at a time)."""

    def __init__(self, port: int):
        import threading

        self._conn, self._lock = Client(("127.0.0.1", port), authkey=AUTH), threading.Lock()

    def call(self, method: str, payload=None):
        with self._lock:
            self._conn.send((method, payload))
            status, answer = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {method}: {answer}")
        return answer


def train_model(model: str):
    """A Megatron TP1 model through Bridge in bf16 on GPU 0 and its Adam: ``(built, optimizer,
    hf_config)``; a model with MTP layers trains them (Megatron's MTP loss)."""
    import torch

    from conversion.testing.build import build_model, init_gloo, init_model_parallel
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.local.launch import free_port

    torch.cuda.set_device(0)
    init_gloo(0, 1, free_port())
    cfg = tiny_config(model)
    layout = TrainLayout(mtp_layers=getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    init_model_parallel(layout)
    built = build_model(cfg, layout, dtype=torch.bfloat16)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    for chunk in built.model:
        chunk.cuda()
    optimizer = torch.optim.Adam([p for c in built.model for p in c.parameters()], lr=1e-2)
    return built, optimizer, cfg


def train_steps(built, optimizer) -> None:
    import torch

    from conversion.testing.train_step import train_step

    for _ in range(STEPS_PER_REFIT):
        train_step(built, optimizer, torch.tensor(PROMPT))


def refit_loop(client: ControllerConnection, built, optimizer, workdir: str, send: Callable) -> list[dict]:
    """:data:`REFITS` times: train, refit (``send(version)``: its report), and ask the controller
    for its checks of the refit. The reports, with each call's seconds."""
    reports = []
    for version in range(1, REFITS + 1):
        train_steps(built, optimizer)
        t0 = time.perf_counter()
        report = send(version)
        reports.append(dict(call_seconds=time.perf_counter() - t0, report=report.as_dict()))
        client.call("check", save_export(built, workdir, version))
    return reports


def save_export(built, workdir: str, version: int) -> str:
    """Bridge's export of the trainer's weights, as safetensors for the controller."""
    from safetensors.torch import save_file

    path = os.path.join(workdir, f"export_v{version}.safetensors")
    save_file({n: t.detach().cpu().contiguous() for n, t in built.bridge.export_hf_weights(
        built.model, cpu=True, show_progress=False)}, path)
    return path


def main(doc: str, script: str, name: str, controller: Callable, trainer: Callable, argv=None,
         models: tuple[str, ...] = MODELS) -> int:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results", f"{name}.json"))
    parser.add_argument("--trainer-python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                        help="Python of the Megatron environment (default: .venv)")
    parser.add_argument("--models", nargs="+", default=list(models), choices=models)
    parser.add_argument("--trainer", nargs=3, metavar=("MODEL", "WORKDIR", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trainer:
        trainer(args.trainer[0], args.trainer[1], int(args.trainer[2]))
        return 0
    result = {model: controller(args, model) for model in args.models}
    result["ok"] = all(r["ok"] for r in result.values())
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def summary(run: dict, **extra) -> dict:
    """A model's result: ``ok`` when the trainer finished, every refit was checked and every
    check's tokens matched."""
    import torch

    checks = run["checks"]
    return dict(ok=run["returncode"] == 0 and len(checks) == REFITS and all(c["tokens_match"] for c in checks),
                bit_exact=all(c["bit_exact"] for c in checks), gpu=torch.cuda.get_device_name(), checks=checks,
                control_plane_seconds=run["phases"], trainer=run["result"], **extra)


if __name__ == "__main__":
    sys.exit("run gpu_check_vllm.py or gpu_check_sglang.py")
