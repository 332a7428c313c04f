"""GPU check of the vLLM weight-transfer backend with a real ``vllm.LLM`` (never in CI).

On one GPU, for Qwen3 and Qwen3-MoE in turn (``--models``; vLLM's MoE post-load cannot run
on CPU, so the MoE case is this check's): this script, in the vLLM environment
(``.venv-vllm``), writes a tiny model (its
config and random weights as safetensors, no hub), starts a real ``vllm.LLM`` (eager) with
``weight_transfer_config=WeightTransferConfig(backend="megatron_refit")`` and starts a
Megatron trainer process in the Megatron environment (``.venv``) on the same GPU: Megatron
TP1 built through Bridge in bf16, real Adam steps, bucket bytes to the engine through CUDA
IPC (colocated). The trainer drives the backend with the vLLM trainer contract
(``MegatronRefitTrainerEngine.trainer_init`` / ``send_weights``); its client reaches the
``LLM`` in this process over a local connection (a single controller, as NeMo-RL and verl
drive engines) and is the guide's ``LLMClient``. After each of 3 refits:

- ``bit_exact``: every engine parameter equals what Bridge's export gives in vLLM's layout
  (read on the worker with ``LLM.apply_model``; a post-load step that re-packs MoE experts
  for its kernel makes this false while serving stays right: ``tokens_match`` decides);
- ``tokens_match``: the engine's greedy tokens equal Hugging Face transformers' greedy
  tokens with the trainer's exported weights;
- seconds per refit (trainer's report) and per control-plane phase.

    .venv-vllm/bin/python scripts/gpu_check_vllm.py [--out results/gpu_check_vllm.json]

The lent GPU machines of this project's workplace have neither vLLM nor a network (and vLLM
0.33 needs torch 2.14): run this where both environments exist.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Client, Listener

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
             vocab_size=1024, num_hidden_layers=2)
MOE_SHAPE = dict(moe_intermediate_size=256)
MODELS = ("qwen3", "qwen3-moe")
PROMPT = [list(range(5, 21)), list(range(100, 116))]
STEPS_PER_REFIT, REFITS, NEW_TOKENS = 5, 3, 8
AUTH = b"megatron-refit-gpu-check"


def _training_tokens():
    import torch

    return torch.tensor(PROMPT)


# -- the controller (vLLM environment) ----------------------------------------------------

def _engine_params(model):
    """On the vLLM worker: its parameters, on the CPU."""
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def _config(model: str):
    from conversion.hf_configs import hf_config

    return hf_config(model, **SHAPE, **(MOE_SHAPE if "moe" in model else {}))


def _expected(export: dict, cfg) -> dict:
    from megatron_refit.gen_layout import GenLayout, gen_target_specs
    from megatron_refit.hf_model import hf_param_table, model_shape
    from megatron_refit.receivers.vllm_layout import expected_storage

    pieces = gen_target_specs(hf_param_table(cfg, "bfloat16"), GenLayout(tp=1), model_shape(cfg), style="vllm")[0]
    return expected_storage(export, pieces, model_shape(cfg), 1)


def _hf_greedy(export: dict, cfg) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(export, strict=False)
    out = model.generate(torch.tensor(PROMPT).cuda(), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, len(PROMPT[0]):].tolist()


def _check(llm, cfg, export_path: str) -> dict:
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from megatron_refit.receivers.engine import resolve_names

    export = load_file(export_path)
    want = _expected(export, cfg)
    params = resolve_names(want, llm.apply_model(_engine_params)[0])  # vLLM's spellings (routed_experts)
    diff = sorted(n for n, t in want.items() if not params[n].equal(t.cpu()))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPT],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    engine_tokens = [list(o.outputs[0].token_ids) for o in outs]
    hf_tokens = _hf_greedy(export, cfg)
    return dict(bit_exact=not diff, diff=diff[:5], tokens_match=engine_tokens == hf_tokens,
                engine_tokens=engine_tokens, hf_tokens=hf_tokens)


def controller(args, model: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    from megatron_refit.weight_transfer.clients import LLMClient

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
    workdir = tempfile.mkdtemp(prefix="gpu_check_vllm_")
    cfg = _config(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(workdir)
    llm = LLM(model=workdir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              gpu_memory_utilization=0.3, max_model_len=128,
              weight_transfer_config=WeightTransferConfig(backend="megatron_refit"))
    client = LLMClient(llm)
    listener = Listener(("127.0.0.1", 0), authkey=AUTH)
    trainer = subprocess.Popen([args.trainer_python, os.path.abspath(__file__), "--trainer", model, workdir,
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
                answer = _check(llm, cfg, payload) if method == "check" else getattr(client, method)(*payload)
                conn.send(("ok", answer))
            except Exception as exc:  # noqa: BLE001 -- handed to the trainer, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            phases.setdefault(method, []).append(time.perf_counter() - t0)
            if method == "check":
                checks.append(answer)
    trainer.wait(timeout=300)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    return dict(ok=trainer.returncode == 0 and len(checks) == REFITS and all(c["tokens_match"] for c in checks),
                bit_exact=all(c["bit_exact"] for c in checks), gpu=torch.cuda.get_device_name(), checks=checks,
                control_plane_seconds=phases, trainer=result)


# -- the trainer (Megatron environment) ---------------------------------------------------

class _ControllerClient:
    """``VLLMWeightSyncClient`` to the controller's ``LLMClient`` (one call at a time)."""

    def __init__(self, port: int):
        import threading

        self._conn, self._lock = Client(("127.0.0.1", port), authkey=AUTH), threading.Lock()

    def call(self, method: str, *payload):
        with self._lock:
            self._conn.send((method, payload))
            status, answer = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {method}: {answer}")
        return answer

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", init_info)

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", update_info)

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update", weight_version)

    def shutdown_weight_transfer_engine(self):
        self.call("shutdown_weight_transfer_engine")


def trainer(model: str, workdir: str, port: int) -> None:
    import torch
    from safetensors.torch import save_file

    from conversion.build import build_model, init_gloo, init_model_parallel
    from conversion.train_step import train_step
    from megatron_refit.tools.launch import free_port
    from megatron_refit.layout import TrainLayout
    from megatron_refit.weight_transfer.trainer import (
        LocalShardSource,
        MegatronRefitTrainerEngine,
        MegatronRefitTrainerInitInfo,
    )

    client = _ControllerClient(port)
    torch.cuda.set_device(0)
    init_gloo(0, 1, free_port())
    init_model_parallel(TrainLayout())
    cfg = _config(model)
    built = build_model(cfg, TrainLayout(), dtype=torch.bfloat16)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    for chunk in built.model:
        chunk.cuda()
    optimizer = torch.optim.Adam([p for c in built.model for p in c.parameters()], lr=1e-2)
    refit = {"mode": "colocated", "gen_tp": 1, "port": free_port()}
    engine = MegatronRefitTrainerEngine.trainer_init(MegatronRefitTrainerInitInfo(refit=refit, num_train=1, rank=0),
                                                     client=client,
                                                     source=LocalShardSource.from_bridge(built.bridge, built.model,
                                                                                         cfg))
    reports = []
    for version in range(1, REFITS + 1):
        for _ in range(STEPS_PER_REFIT):
            train_step(built, optimizer, _training_tokens())
        t0 = time.perf_counter()
        report = engine.send_weights(version)
        reports.append(dict(call_seconds=time.perf_counter() - t0, report=report.as_dict()))
        path = os.path.join(workdir, f"export_v{version}.safetensors")
        save_file({n: t.detach().cpu().contiguous() for n, t in built.bridge.export_hf_weights(
            built.model, cpu=True, show_progress=False)}, path)
        client.call("check", path)
    engine.shutdown()
    client.call("done", reports)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_check_vllm.json"))
    parser.add_argument("--trainer-python", default=os.path.join(ROOT, ".venv", "bin", "python"),
                        help="Python of the Megatron environment (default: .venv)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
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


if __name__ == "__main__":
    sys.exit(main())
