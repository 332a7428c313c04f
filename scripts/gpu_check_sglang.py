"""GPU check of the SGLang hook with a real ``sglang.Engine`` (never in CI).

On one GPU, for Qwen3 and Qwen3-MoE in turn (``--models``): this script, in the SGLang
environment (``.venv-sglang``), writes a tiny model (config and random weights as
safetensors, no hub), starts a real ``sglang.Engine`` (TP1, no CUDA graphs) with
``custom_weight_loader=[megatron_refit.engines.sglang.worker.loader.LOADER, this module's probe]`` and
starts a Megatron trainer process in the Megatron environment (``.venv``) on the same GPU:
Megatron TP1 built through Bridge in bf16, real Adam steps, bucket bytes to the engine
through CUDA IPC (``mode: colocated``; one GPU cannot run NCCL between two processes). The
trainer runs the guide's loop (``SglangControl``: ``connect``, ``fleet.refit`` per version, ``close``)
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

import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_engine_check import (  # noqa: E402
    NEW_TOKENS,
    PROMPT,
    ControllerConnection,
    hf_greedy,
    main,
    refit_loop,
    serve_trainer,
    summary,
    tiny_config,
    train_model,
)

PROBE = "gpu_check_sglang.probe_loader"
"""The probe's import path in the engine's workers (``scripts/`` on their ``PYTHONPATH``)."""


# -- the probe (in the engine's TP worker) ------------------------------------------------

def probe_loader(model, named_tensors) -> None:
    """Custom weight loader: compares the worker's parameters with Bridge's export (path and
    result file in the message's name) in the engine's fused layout; writes the result."""
    import torch
    from safetensors.torch import load_file

    from megatron_refit.plan.gen_layout import GenLayout, gen_target_specs
    from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
    from megatron_refit.engines.fused.live import resolve_names
    from megatron_refit.engines.fused.layout import expected_storage

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
    hf_tokens = hf_greedy(load_file(export_path), cfg)
    return dict(**probe, tokens_match=engine_tokens == hf_tokens, engine_tokens=engine_tokens, hf_tokens=hf_tokens)


def controller(args, model: str) -> dict:
    import sglang
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_refit.engines.sglang.messages import LOADER
    from megatron_refit.engines.sglang.trainer.client import EngineClient

    workdir = tempfile.mkdtemp(prefix="gpu_check_sglang_")
    cfg = tiny_config(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(workdir)
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "scripts"), os.environ.get("PYTHONPATH", "")])
    engine = sglang.Engine(model_path=workdir, skip_tokenizer_init=True, dtype="bfloat16", tp_size=1,
                           mem_fraction_static=0.3, disable_cuda_graph=True, context_length=128,
                           custom_weight_loader=[LOADER, PROBE])
    client = EngineClient(engine)

    def answer(method, payload):
        if method == "check":
            return _check(engine, cfg, payload, workdir)
        args, kwargs = payload
        return getattr(client, method)(*args, **kwargs)

    run = serve_trainer(__file__, args.trainer_python, model, workdir, answer)
    engine.shutdown()
    return summary(run)


# -- the trainer (Megatron environment) ---------------------------------------------------

class _ControllerClient(ControllerConnection):
    """An SGLang control client whose calls run on the controller's ``EngineClient``."""

    def connect(self, refit, *, num_train, replica=0):
        self.call("connect", ((refit,), dict(num_train=num_train, replica=replica)))

    def refit(self, version, *, full=False):
        self.call("refit", ((version,), dict(full=full)))

    def resume(self, version):
        self.call("resume", ((version,), {}))

    def close(self):
        self.call("close", ((), {}))


def trainer(model: str, workdir: str, port: int) -> None:
    from megatron_refit.config import RefitConfig
    from conversion.refit import trainer_refit
    from megatron_refit.engines.sglang.trainer.control import SglangControl
    from megatron_refit.local.launch import free_port

    client = _ControllerClient(port)
    built, optimizer, cfg = train_model(model)
    section = {"enabled": True, "engine": "sglang", "mode": "colocated", "gen_tp": 1, "port": free_port()}
    refit_cfg = RefitConfig.from_dict(section)
    control = SglangControl([client], refit_cfg)
    fleet = trainer_refit(refit_cfg, built.bridge, built.model, cfg, rank=0, num_train=1, control=control)
    reports = refit_loop(client, built, optimizer, workdir, fleet.refit)
    fleet.close()
    client.call("done", reports)


if __name__ == "__main__":
    sys.exit(main(__doc__, __file__, "gpu_check_sglang", controller, trainer))
