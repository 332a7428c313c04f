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

Each model runs twice: ``in_place`` (the engine eager, as before) and ``staged`` (``refit.swap:
staged``, the engine with its CUDA graphs captured: each version prepared beside the live model
and copied into the live storage the graphs read, then the device synchronized;
docs/guide-swap.md). The staged case is ``ok`` when every version was prepared
(``refit/swap_unprepared`` 0), its tokens equal Hugging Face's with the exported weights, and
equal the in-place run's tokens after the same refit (``tokens_equal_in_place``; the same seeds
train the same model in both runs).

    .venv-vllm/bin/python scripts/gpu_check_vllm.py [--out results/gpu_check_vllm.json]

The lent GPU machines of this project's workplace have neither vLLM nor a network (and vLLM
0.33 needs torch 2.14): run this where both environments exist.
"""

from __future__ import annotations

import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_engine_check import (  # noqa: E402
    PROMPT,
    NEW_TOKENS,
    ControllerConnection,
    hf_greedy,
    main,
    refit_loop,
    serve_trainer,
    summary,
    tiny_config,
    train_model,
)


# -- the controller (vLLM environment) ----------------------------------------------------

def _engine_params(model):
    """On the vLLM worker: its parameters, on the CPU."""
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def _expected(export: dict, cfg) -> dict:
    from megatron_refit.plan.gen_layout import GenLayout, gen_target_specs
    from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
    from megatron_refit.engines.fused.layout import expected_storage

    pieces = gen_target_specs(hf_param_table(cfg, "bfloat16"), GenLayout(tp=1), model_shape(cfg), style="vllm")[0]
    return expected_storage(export, pieces, model_shape(cfg), 1)


def _check(llm, cfg, export_path: str) -> dict:
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from megatron_refit.engines.fused.live import resolve_names

    export = load_file(export_path)
    want = _expected(export, cfg)
    params = resolve_names(want, llm.apply_model(_engine_params)[0])  # vLLM's spellings (routed_experts)
    diff = sorted(n for n, t in want.items() if not params[n].equal(t.cpu()))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPT],
                        SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    engine_tokens = [list(o.outputs[0].token_ids) for o in outs]
    hf_tokens = hf_greedy(export, cfg)
    return dict(bit_exact=not diff, diff=diff[:5], tokens_match=engine_tokens == hf_tokens,
                engine_tokens=engine_tokens, hf_tokens=hf_tokens)


SWAPS = ("in_place", "staged")


def controller(args, model: str) -> dict:
    """Both swaps of ``model``; ``ok`` when both are and the staged run served the in-place run's tokens."""
    runs = {swap: _run(args, model, swap) for swap in SWAPS}
    staged, in_place = runs["staged"], runs["in_place"]
    staged["tokens_equal_in_place"] = [a["engine_tokens"] == b["engine_tokens"]
                                       for a, b in zip(staged["checks"], in_place["checks"])]
    staged["prepared_all"] = all(r["report"]["summary"].get("refit/swap_unprepared") == 0
                                 for r in (staged["trainer"] or []))
    ok = in_place["ok"] and staged["ok"] and staged["prepared_all"] and all(staged["tokens_equal_in_place"]) \
        and len(staged["tokens_equal_in_place"]) == len(in_place["checks"])
    return dict(ok=ok, **runs)


def _run(args, model: str, swap: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    from megatron_refit.engines.vllm.trainer.clients import LLMClient

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's function
    workdir = tempfile.mkdtemp(prefix=f"gpu_check_vllm_{swap}_")
    cfg = tiny_config(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(workdir)
    llm = LLM(model=workdir, skip_tokenizer_init=True, enforce_eager=swap == "in_place", dtype="bfloat16",
              gpu_memory_utilization=0.3, max_model_len=128,
              weight_transfer_config=WeightTransferConfig(backend="megatron_refit"))
    client = LLMClient(llm)                # each call from train rank 0 runs: getattr(client, method)(*payload)

    def answer(method, payload):
        if method == "settings":
            return {"swap": swap}
        return _check(llm, cfg, payload) if method == "check" else getattr(client, method)(*payload)

    run = serve_trainer(__file__, args.trainer_python, model, workdir, answer)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    torch.cuda.empty_cache()  # the next run's engine asks for its share of the device again
    return summary(run, swap=swap, cuda_graphs=swap != "in_place")


# -- the trainer (Megatron environment) ---------------------------------------------------

class _ControllerClient(ControllerConnection):
    """``VLLMWeightSyncClient`` to the controller's ``LLMClient``."""

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", (init_info,))

    def start_weight_update(self):
        self.call("start_weight_update", ())

    def update_weights(self, update_info):
        self.call("update_weights", (update_info,))

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update", (weight_version,))

    def shutdown_weight_transfer_engine(self):
        self.call("shutdown_weight_transfer_engine", ())


def trainer(model: str, workdir: str, port: int, client_class: type = _ControllerClient) -> None:
    from megatron_refit.local.launch import free_port
    from conversion.refit import local_shard_source
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo

    client = client_class(port)
    settings = client.call("settings", ())  # the controller's refit: keys (swap, gen_draft)
    built, optimizer, cfg = train_model(model)
    refit = {"mode": "colocated", "gen_tp": 1, "port": free_port(), **settings}
    engine = MegatronRefitTrainerEngine.trainer_init(MegatronRefitTrainerInitInfo(refit=refit, num_train=1, rank=0),
                                                     client=client,
                                                     source=local_shard_source(built.bridge, built.model, cfg))
    reports = refit_loop(client, built, optimizer, workdir, engine.send_weights)
    engine.shutdown()
    client.call("done", reports)


if __name__ == "__main__":
    sys.exit(main(__doc__, __file__, "gpu_check_vllm", controller, trainer))
