"""GPU check of the speculative draft's refit (#67) with a real ``vllm.LLM`` decoding with it (never in CI).

On one GPU, in the vLLM environment (``.venv-vllm``): a tiny DeepSeek-V3 with one MTP layer (its
config written here, vLLM's dummy weights: no hub) served by a real ``vllm.LLM`` (eager) that
decodes speculatively with the model's own MTP layer as its draft (``speculative_config=
{"method": "deepseek_mtp", "num_speculative_tokens": 1}``: vLLM's ``DeepSeekMTP``) and
``weight_transfer_config=WeightTransferConfig(backend="megatron_refit")``. A Megatron trainer
process in ``.venv`` on the same GPU (TP1 through Bridge, bf16, Adam steps that train the MTP
layer with Megatron's MTP loss) refits it under ``refit.gen_draft`` through vLLM's draft session
(``start_draft_weight_update``, ``LLMClient``) over CUDA IPC. After each of 3 refits:

- ``bit_exact``: the main model's parameters equal Bridge's export in vLLM's layout;
  ``draft_bit_exact``: the draft's own (its MTP layer, read on the worker with ``collective_rpc``
  under the checkpoint's names) too. A post-load step that re-packs for its kernel makes these
  false while serving stays right: ``tokens_match`` decides;
- ``draft_shares``: the draft still shares the target's embedding and LM head (``""``, else why
  not), as vLLM's proposer made it and the refit relies on;
- ``draft_moved``: the draft's weights changed since the last check (the trainer's MTP layer
  trained: a draft the refit left behind would not move);
- ``tokens_match``: the engine's greedy tokens, decoded with the draft, equal Hugging Face
  transformers' greedy tokens with the trainer's exported weights (speculative decoding verifies
  every proposal, so a wrong draft changes acceptance, not tokens: the draft is proven by its
  bytes above);
- ``speculation``: the draft tokens vLLM proposed and the model accepted while decoding them
  (``LLMClient.speculation``, vLLM's ``vllm:spec_decode_*`` counters: ``acceptance`` =
  accepted / drafted), as the GRPO loop reads them.

``ok`` when the trainer finished, every refit was checked, its tokens matched, the draft shares
the target's embedding and head, moved at every refit, and vLLM proposed draft tokens. It runs
twice: ``in_place`` (the engine eager) and ``staged`` (``refit.swap: staged``, the engine with its
CUDA graphs captured: the model's and the draft's versions prepared beside them and swapped
together; ``ok`` needs every version prepared, ``refit/swap_unprepared`` 0).

    .venv-vllm/bin/python scripts/gpu_check_vllm_draft.py [--out results/gpu_check_vllm_draft.json]

The lent GPU machines of this project's workplace have neither vLLM nor a network (and vLLM
0.33 needs torch 2.14): run this where both environments exist.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_check_vllm import _check, _ControllerClient  # noqa: E402
from gpu_check_vllm import trainer as vllm_trainer  # noqa: E402
from gpu_engine_check import (  # noqa: E402
    main,
    serve_trainer,
    summary,
    tiny_config,
)

MODEL = "deepseek-v3-mtp"
SPECULATIVE = {"method": "deepseek_mtp", "num_speculative_tokens": 1}


# -- the controller (vLLM environment) ----------------------------------------------------

def draft_params(worker, first_layer: int) -> tuple[dict, str]:
    """On the vLLM worker: its draft's own parameters on the CPU under the checkpoint's names, and
    ``""`` when the draft shares the target's embedding and LM head (else why not)."""
    from megatron_refit.engines.vllm.worker.draft import vllm_draft

    with_draft = vllm_draft(worker.get_model(), first_layer)
    try:
        with_draft.hand_over(worker.get_draft_model())
    except ValueError as exc:
        return {}, str(exc)
    return {n: p.detach().cpu() for n, p in with_draft.named_parameters() if with_draft.is_draft(n)}, ""


def _expected_draft(export: dict, cfg) -> dict:
    """The draft's parameters as Bridge's export gives them in vLLM's layout (checkpoint names)."""
    from megatron_refit.engines.fused.layout import expected_storage
    from megatron_refit.engines.hf.checkpoint import hf_param_table, model_shape
    from megatron_refit.plan.gen_layout import GenLayout, gen_target_specs

    def in_draft(name: str) -> bool:
        match = re.match(r"model\.layers\.(\d+)\.", name)
        return match is not None and int(match.group(1)) >= cfg.num_hidden_layers

    table = {n: v for n, v in hf_param_table(cfg, "bfloat16", draft=True).items() if in_draft(n)}
    pieces = gen_target_specs(table, GenLayout(tp=1), model_shape(cfg), style="vllm")[0]
    return expected_storage(export, pieces, model_shape(cfg), 1)


def draft_checks(params: dict, shares: str, export: dict, cfg, before: dict) -> dict:
    """The checks of the draft's weights ``params`` (:func:`draft_params`) against Bridge's
    ``export`` and the weights it held at the check ``before``."""
    from megatron_refit.engines.fused.live import resolve_names

    want = _expected_draft(export, cfg)
    try:
        mine = resolve_names(want, params)
        diff = sorted(n for n, t in want.items() if not mine[n].equal(t))
    except ValueError as exc:
        diff = [str(exc)]
    moved = bool(params) and any(n not in before or not t.equal(before[n]) for n, t in params.items())
    return dict(draft_bit_exact=bool(params) and not diff, draft_diff=diff[:5], draft_params=len(params),
                draft_shares=shares, draft_moved=moved)


class _Draft:
    """The checks of the draft after each refit (the weights it held at the last check, or before
    the first refit, kept for ``draft_moved``)."""

    def __init__(self, llm, cfg):
        self.llm, self.cfg = llm, cfg
        self.before = self._read()[0]

    def _read(self) -> tuple[dict, str]:
        return self.llm.collective_rpc(draft_params, args=(self.cfg.num_hidden_layers,))[0]

    def check(self, export_path: str) -> dict:
        from safetensors.torch import load_file

        params, shares = self._read()
        out = draft_checks(params, shares, load_file(export_path), self.cfg, self.before)
        self.before = params
        return out


SWAPS = ("in_place", "staged")


def controller(args, model: str) -> dict:
    """Both swaps of ``model``: in place (the engine eager), and staged (its CUDA graphs captured:
    the model's and the draft's versions prepared beside them, swapped together); ``ok`` when both
    are and every staged version was prepared."""
    runs = {swap: _run(args, model, swap) for swap in SWAPS}
    runs["staged"]["prepared_all"] = all(r["report"]["summary"].get("refit/swap_unprepared") == 0
                                         for r in (runs["staged"]["trainer"] or []))
    return dict(ok=all(run["ok"] for run in runs.values()) and runs["staged"]["prepared_all"], **runs)


def _run(args, model: str, swap: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM
    from vllm.config.weight_transfer import WeightTransferConfig

    from megatron_refit.engines.vllm.trainer.clients import LLMClient

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc's and apply_model's functions
    workdir = tempfile.mkdtemp(prefix=f"gpu_check_vllm_draft_{swap}_")
    cfg = tiny_config(model)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(workdir)  # its config; weights dummy
    llm = LLM(model=workdir, skip_tokenizer_init=True, enforce_eager=swap == "in_place", dtype="bfloat16",
              load_format="dummy",
              gpu_memory_utilization=0.3, max_model_len=128, speculative_config=SPECULATIVE,
              disable_log_stats=False,  # the spec-decode counters
              weight_transfer_config=WeightTransferConfig(backend="megatron_refit"))
    client, draft = LLMClient(llm), _Draft(llm, cfg)

    def answer(method, payload):
        if method == "settings":
            return {"swap": swap, "gen_draft": True}
        if method != "check":
            return getattr(client, method)(*payload)
        before = client.speculation()
        out = _check(llm, cfg, payload)  # the main model's bytes, and the tokens decoded with the draft
        after = client.speculation()
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        out.update(draft.check(payload), speculation=dict(draft_tokens=drafted, accepted_tokens=accepted,
                                                          acceptance=accepted / drafted if drafted else None))
        return out

    run = serve_trainer(__file__, args.trainer_python, model, workdir, answer)
    llm.shutdown() if hasattr(llm, "shutdown") else None
    torch.cuda.empty_cache()  # the next run's engine asks for its share of the device again
    result = summary(run, speculative_config=SPECULATIVE, swap=swap, cuda_graphs=swap != "in_place")
    checks = run["checks"]
    result["draft_bit_exact"] = all(c["draft_bit_exact"] for c in checks)
    result["ok"] = result["ok"] and all(c["draft_shares"] == "" and c["draft_moved"]
                                        and c["speculation"]["draft_tokens"] > 0 for c in checks)
    return result


# -- the trainer (Megatron environment) ---------------------------------------------------

class _DraftControllerClient(_ControllerClient):
    """``VLLMWeightSyncClient`` with vLLM's draft session (``refit.gen_draft``)."""

    def start_draft_weight_update(self):
        self.call("start_draft_weight_update", ())


def trainer(model: str, workdir: str, port: int) -> None:
    vllm_trainer(model, workdir, port, client_class=_DraftControllerClient)


if __name__ == "__main__":
    sys.exit(main(__doc__, __file__, "gpu_check_vllm_draft", controller, trainer, models=(MODEL,)))
