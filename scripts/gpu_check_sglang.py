"""GPU check of the SGLang hook with a real ``sglang.Engine`` (never in CI).

On one GPU, for Qwen3 and Qwen3-MoE in turn (``--models``): this script, in the SGLang
environment (``.venv-sglang``), writes a tiny model (config and random weights as
safetensors, no hub), starts a real ``sglang.Engine`` (TP1, no CUDA graphs) with
``custom_weight_loader=[megatron_refit.receivers.sglang.LOADER, this module's probe]`` and
starts a Megatron trainer process in the Megatron environment (``.venv``) on the same GPU:
Megatron TP1 built through Bridge in bf16, real Adam steps, bucket bytes to the engine
through CUDA IPC (``mode: colocated``; one GPU cannot run NCCL between two processes). The
trainer runs the guide's loop (``connect_engines`` / ``refit_engines`` / ``close_engines``)
with one client that forwards each control call to this process's ``EngineClient`` over a
local connection. After each of 3 refits:

- ``bit_exact``: on the engine's TP worker, every parameter equals what Bridge's export
  gives in the engine's fused layout (the probe: a second custom weight loader, called with
  the export's path through the same ``update_weights_from_tensor`` route);
- ``tokens_match``: the engine's greedy tokens equal Hugging Face transformers' greedy
  tokens with the trainer's exported weights;
- seconds per refit (trainer's report) and per control call.

    .venv-sglang/bin/python scripts/gpu_check_sglang.py [--out results/gpu_check_sglang.json]
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
PROBE = "gpu_check_sglang.probe_loader"
"""The probe's import path in the engine's workers (``scripts/`` on their ``PYTHONPATH``)."""


def _config(model: str):
    from conversion.hf_configs import hf_config

    return hf_config(model, **SHAPE, **(MOE_SHAPE if "moe" in model else {}))


# -- the probe (in the engine's TP worker) ------------------------------------------------

def probe_loader(model, named_tensors) -> None:
    """Custom weight loader: compares the worker's parameters with Bridge's export (path and
    result file in the message's name) in the engine's fused layout; writes the result."""
    import torch
    from safetensors.torch import load_file

    from megatron_refit.gen_layout import GenLayout, gen_target_specs
    from megatron_refit.hf_model import hf_param_table, model_shape
    from megatron_refit.receivers.engine import resolve_names
    from megatron_refit.receivers.vllm_layout import expected_storage

    for name, _ in named_tensors:
        request = json.loads(name.removeprefix("probe:"))
        try:
            cfg = model.config
            export = load_file(request["export"])
            pieces = gen_target_specs(hf_param_table(cfg, "bfloat16"), GenLayout(tp=1), model_shape(cfg),
                                      style="vllm")[0]
            want = expected_storage(export, pieces, model_shape(cfg), 1)
            params = resolve_names(want, dict(model.named_parameters()))
            diff = sorted(n for n, t in want.items() if not torch.equal(params[n].cpu(), t.cpu()))
            result = dict(bit_exact=not diff, diff=diff[:5], checked=len(want))
        except Exception as exc:  # noqa: BLE001 -- reported, never raised into the scheduler
            result = dict(bit_exact=False, error=f"{type(exc).__name__}: {exc}")
        with open(request["out"], "w") as f:
            json.dump(result, f)


# -- the controller (SGLang environment) --------------------------------------------------

def _hf_greedy(export: dict, cfg) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    model.load_state_dict(export, strict=False)
    out = model.generate(torch.tensor(PROMPT).cuda(), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, len(PROMPT[0]):].tolist()


def _check(engine, cfg, export_path: str, workdir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    out = os.path.join(workdir, "probe.json")
    message = [("probe:" + json.dumps({"export": export_path, "out": out}), torch.empty(0, dtype=torch.uint8))]
    engine.begin_weight_update()
    try:
        engine.update_weights_from_tensor(message, load_format=PROBE, flush_cache=False)
    finally:
        engine.end_weight_update()
    with open(out) as f:
        probe = json.load(f)
    outs = engine.generate(input_ids=PROMPT, sampling_params=dict(temperature=0.0, max_new_tokens=NEW_TOKENS,
                                                                  ignore_eos=True))
    engine_tokens = [list(o["output_ids"]) for o in outs]
    hf_tokens = _hf_greedy(load_file(export_path), cfg)
    return dict(**probe, tokens_match=engine_tokens == hf_tokens, engine_tokens=engine_tokens, hf_tokens=hf_tokens)


def controller(args, model: str) -> dict:
    import sglang
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_refit.receivers.sglang import LOADER
    from megatron_refit.sglang_client import EngineClient

    workdir = tempfile.mkdtemp(prefix="gpu_check_sglang_")
    cfg = _config(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(workdir)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")])
    engine = sglang.Engine(model_path=workdir, skip_tokenizer_init=True, dtype="bfloat16", tp_size=1,
                           mem_fraction_static=0.3, disable_cuda_graph=True, context_length=128,
                           custom_weight_loader=[LOADER, PROBE])
    client = EngineClient(engine)
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
                answer = (_check(engine, cfg, payload[0][0], workdir) if method == "check"
                          else getattr(client, method)(*payload[0], **payload[1]))
                conn.send(("ok", answer))
            except Exception as exc:  # noqa: BLE001 -- handed to the trainer, which raises it
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            phases.setdefault(method, []).append(time.perf_counter() - t0)
            if method == "check":
                checks.append(answer)
    trainer.wait(timeout=300)
    engine.shutdown()
    return dict(ok=trainer.returncode == 0 and len(checks) == REFITS and all(c["tokens_match"] for c in checks),
                bit_exact=all(c["bit_exact"] for c in checks), gpu=torch.cuda.get_device_name(), checks=checks,
                control_plane_seconds=phases, trainer=result)


# -- the trainer (Megatron environment) ---------------------------------------------------

class _ControllerClient:
    """An SGLang control client whose calls run on the controller's ``EngineClient``."""

    def __init__(self, port: int):
        import threading

        self._conn, self._lock = Client(("127.0.0.1", port), authkey=AUTH), threading.Lock()

    def call(self, method: str, *args, **kwargs):
        with self._lock:
            self._conn.send((method, (args, kwargs)))
            status, answer = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine {method}: {answer}")
        return answer

    def connect(self, refit, *, num_train, replica=0):
        self.call("connect", refit, num_train=num_train, replica=replica)

    def refit(self, version, *, full=False):
        self.call("refit", version, full=full)

    def resume(self, version):
        self.call("resume", version)

    def close(self):
        self.call("close")


def trainer(model: str, workdir: str, port: int) -> None:
    import torch
    from safetensors.torch import save_file

    from conversion.build import build_model, init_gloo, init_model_parallel
    from conversion.train_step import train_step
    from megatron_refit.config import RefitConfig
    from megatron_refit.integration import trainer_refit
    from megatron_refit.layout import TrainLayout
    from megatron_refit.sglang_client import close_engines, connect_engines, refit_engines
    from megatron_refit.tools.launch import free_port

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
    section = {"enabled": True, "backend": "sglang", "mode": "colocated", "gen_tp": 1, "port": free_port()}
    refit_cfg = RefitConfig.from_dict(section)
    clients = [client]
    sync = connect_engines(lambda: trainer_refit(refit_cfg, built.bridge, built.model, cfg, rank=0, num_train=1),
                           clients, section, rank=0, num_train=1)
    reports = []
    for version in range(1, REFITS + 1):
        for _ in range(STEPS_PER_REFIT):
            train_step(built, optimizer, torch.tensor(PROMPT))
        t0 = time.perf_counter()
        report = refit_engines(sync, clients, version, rank=0)
        reports.append(dict(call_seconds=time.perf_counter() - t0, report=report.as_dict()))
        path = os.path.join(workdir, f"export_v{version}.safetensors")
        save_file({n: t.detach().cpu().contiguous() for n, t in built.bridge.export_hf_weights(
            built.model, cpu=True, show_progress=False)}, path)
        client.call("check", path)
    close_engines(sync, clients, rank=0)
    client.call("done", reports)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "gpu_check_sglang.json"))
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
