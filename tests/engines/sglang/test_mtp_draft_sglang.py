"""#67: the trainer's MTP layer into SGLang 0.5.23's real NextN draft, on CPU over gloo.

The engine is SGLang's speculative decoding with the model's own MTP layer as its draft
(``--speculative-algorithm NEXTN``, which SGLang resolves to ``EAGLE``): each engine rank (one engine
at TP2) builds SGLang's ``DeepseekV3ForCausalLM`` and, from the draft model config SGLang derives from
the same checkpoint, its ``DeepseekV3ForCausalLMNextN``, the target's embedding and LM head shared
into it by SGLang's own EAGLE-worker steps (:func:`.sglang_cpu.build_draft`). The refit goes through
SGLang's real weight-update path (the scheduler's ``SchedulerWeightUpdaterManager`` with a target
and a draft worker, each runner's ``WeightUpdater`` calling the custom weight loader), driven by the
trainer's control clients (:mod:`.engine_standins`: over HTTP, and over an ``Engine``'s methods).

Train TP2 x PP2 ranks with sequence parallelism under the recipe's pipeline layout, the MTP layer on
the last stage (Bridge's real local shards of a tiny DeepSeek-V3 with one MTP layer, made in
``.venv``) send into engine TP2. Under ``refit.gen_draft`` (selector ``all``),
after every refit each engine rank's main model must equal SGLang's own ``load_weights`` of Bridge's
export on a fresh model, its draft's own parameters a fresh NextN draft's ``load_weights`` of the same
export (bit for bit, parameters and the MLA absorb's ``w_kc`` / ``w_vc`` that both post-load steps
derive), the draft must have moved between the versions, the bytes sent are the minimal ones and
nothing is skipped. Without ``gen_draft`` (selector ``target``) the draft stays as it was; a refit
that starts before the draft was handed over is refused by name in the handshake.

The model directory written for SGLang has two fields the tiny preset lacks and SGLang's DeepSeek
reads (:func:`_sglang_config`); the weights' shapes are the preset's.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned
from tests.engines.vllm.bridge_shards import make

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs SGLang (make setup-sglang: .venv-sglang)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
BRIDGE_SHARDS = ROOT / "tests" / "engines" / "vllm" / "bridge_shards.py"
MODEL = "deepseek-v3-mtp"  # made by bridge_shards.py: one MTP layer, train TP2 with SP and PP2 (4 ranks)
FIRST_MTP = 3  # the preset's num_hidden_layers: the MTP layer is model.layers.3
NUM_TRAIN = 4
TP = 2
VERSIONS = (1, 2)
# (case, gen_draft, how the trainer's client reaches the engine)
CASES = (("draft", True, "http"), ("untouched", False, "engine"), ("not-handed-over", True, "manual"))
"""``draft``: the whole version into the target and its draft, through HTTP (selector ``all``);
``untouched``: without ``gen_draft``, through an ``Engine``'s methods (selector ``target``), then
one ``close`` to every runner (selector ``all``): the loader leaves the draft as it was;
``not-handed-over``: ``gen_draft`` connected to the target runner alone, so the draft is never
handed over: the refit is refused in the handshake."""
SELF_ATTN_DERIVED = ("w_kc", "w_vc")
"""What SGLang's MLA post-load derives from ``kv_b_proj`` (its absorbed projections)."""


def _sglang_config(hf_config):
    """The preset's config as SGLang's DeepSeek reads it: ``rope_scaling`` (SGLang's CPU rotary
    embedding for MLA takes DeepSeek's YaRN only: "Only deepseek_yarn is supported for CPU for
    now"; factor 1) and ``moe_layer_freq`` (every layer past the dense ones is MoE, as in the
    preset). No weight's name or shape changes."""
    hf_config.rope_scaling = {"type": "yarn", "rope_type": "yarn", "factor": 1.0,
                              "original_max_position_embeddings": hf_config.max_position_embeddings,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    hf_config.moe_layer_freq = 1
    return hf_config


def _refit_section(port: int, gen_draft: bool) -> dict:
    return dict(gen_tp=TP, gen_dp=1, gen_draft=gen_draft, port=port, bucket_mb=0.25, timeout_s=120)


# -- the generation ranks ------------------------------------------------------------


def _own(draft) -> dict[str, torch.Tensor]:
    """The draft's own parameters (not the target's embedding and LM head it shares)."""
    return {n: p.data for n, p in draft.named_parameters() if n not in ("model.embed_tokens.weight", "lm_head.weight")}


def _derived(model) -> dict[str, torch.Tensor]:
    """The MLA absorb's tensors SGLang's post-load derives, per attention module."""
    return {f"{name}.{attr}": getattr(module, attr) for name, module in model.named_modules()
            for attr in SELF_ATTN_DERIVED if isinstance(getattr(module, attr, None), torch.Tensor)}


def _diff(mine: dict, theirs: dict) -> list[str]:
    return sorted(n for n in mine if n not in theirs or not torch.equal(mine[n], theirs[n]))


def _nan_filled(*models) -> None:
    with torch.no_grad():  # every element a load leaves unwritten stays NaN (and fails torch.equal)
        for model in models:
            for param in model.parameters():
                param.fill_(float("nan"))


def _session(manager, message, selector: str) -> None:
    """One weight-update session on this TP worker's scheduler manager, as SGLang's tokenizer
    manager sends it, with ``selector``."""
    from sglang.srt.managers.io_struct import (BeginWeightUpdateReqInput, EndWeightUpdateReqInput,
                                               UpdateWeightsFromTensorReqInput)
    from sglang.srt.utils import MultiprocessingSerializer

    from megatron_refit.engines.sglang.messages import LOADER
    from megatron_refit.engines.sglang.trainer.client import torch_reductions

    assert manager.begin_weight_update(BeginWeightUpdateReqInput(selector=selector)).success
    with torch_reductions():
        payloads = [MultiprocessingSerializer.serialize(message) for _ in range(TP)]
    out = manager.update_weights_from_tensor(UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=payloads, load_format=LOADER, flush_cache=False, selector=selector))
    assert out.success, out.message
    assert manager.end_weight_update(EndWeightUpdateReqInput()).success


class _Log(logging.Handler):
    """The loader's log lines in this rank."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        logging.disable(logging.NOTSET)  # a quiet spawned rank disables everything below WARNING
        logger = logging.getLogger("megatron_refit.engines.sglang.worker.loader")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())

    def take(self) -> list[str]:
        out, self.lines = self.lines, []
        return out


def _gen(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, model_config

    from megatron_refit.engines.sglang.messages import close_message, connect_message, refit_message
    from megatron_refit.engines.sglang.trainer.client import EngineClient, HTTPClient
    from megatron_refit.engines.sglang.worker.loader import refit_member, refit_state

    from .engine_standins import RankEngine, scheduler_updater, serve_http
    from .sglang_cpu import build_draft, build_model, init_sglang, write_model_dir

    tp_rank = rank - NUM_TRAIN
    model_dir = write_model_dir(_sglang_config(model_config(MODEL)), os.path.join(workdir, f"gen{tp_rank}"))
    init_sglang(TP, tp_rank, sglang_port, model_dir, speculative_algorithm="NEXTN")
    log = _Log()
    results = {}
    for n, (case, gen_draft, path) in enumerate(CASES):
        model = build_model(model_dir)
        draft = build_draft(model_dir, model)
        _nan_filled(model, *([draft] if gen_draft else []))  # without gen_draft the draft keeps its own
        before = {k: t.clone() for k, t in _own(draft).items()}
        types = (type(model).__name__, type(draft).__name__)

        def check(version: int) -> dict:
            """This rank's target and draft against SGLang's own load_weights of Bridge's export into
            a fresh target and a fresh NextN draft (sharing its embedding and head as SGLang does)."""
            export = load(bridge_dir, MODEL, version, 0)["export"]
            ref = build_model(model_dir)
            ref_draft = build_draft(model_dir, ref)
            _nan_filled(ref, ref_draft)
            ref.load_weights(iter(export.items()))
            ref_draft.load_weights(iter(export.items()))
            mine, theirs = dict(model.named_parameters()), dict(ref.named_parameters())
            member = refit_member(model)
            return dict(names_equal=set(mine) == set(theirs), num_params=len(mine), diff=_diff(mine, theirs),
                        derived=len(_derived(model)), derived_diff=_diff(_derived(model), _derived(ref)),
                        draft_names=sorted(_own(draft)) == sorted(_own(ref_draft)), draft_params=len(_own(draft)),
                        draft_diff=_diff(_own(draft), _own(ref_draft)), draft_derived=len(_derived(draft)),
                        draft_derived_diff=_diff(_derived(draft), _derived(ref_draft)),
                        shared=draft.lm_head.weight is model.lm_head.weight
                        and draft.model.embed_tokens.weight is model.model.embed_tokens.weight,
                        state=member.state, weights_version=member.full.weights_version)

        refit = _refit_section(refit_ports[n], gen_draft)
        manager = scheduler_updater(model, model_dir, draft=draft)
        server = None
        out = dict(types=types)
        if path == "manual":  # connect reaches the target runner alone: the draft is never handed over
            _session(manager, connect_message(refit, num_train=NUM_TRAIN), "target")
            out["connect_log"] = log.take()
            _session(manager, refit_message(1), "target")
            out["refused"] = refit_state(model)
            _session(manager, close_message(), "all")
            out["close_log"] = log.take()
            results[case] = out
            continue
        if path == "engine":
            client = EngineClient(RankEngine(manager, TP))
        else:
            url, _, server = serve_http(manager)
            client = HTTPClient(url, tp=TP, timeout=120)
        client.connect(refit, num_train=NUM_TRAIN)
        out.update(selector=client.selector, connect_log=log.take(), checks=[], refit_logs=[])
        for version in VERSIONS:
            client.refit(version)
            client.resume(version)
            out["refit_logs"].append(log.take())
            check_out = check(version)
            check_out.update(draft_moved=sorted(k for k, t in _own(draft).items() if not torch.equal(t, before[k])),
                             draft_error=refit_state(draft)["error"])
            before = {k: t.clone() for k, t in _own(draft).items()}
            out["checks"].append(check_out)
        if gen_draft:
            client.close()
        else:  # a close through every runner, the draft's included: the loader leaves the draft alone
            _session(manager, close_message(), "all")
        out.update(close_log=log.take(), closed=refit_state(model), draft_state=refit_state(draft))
        if server is not None:
            server.shutdown()
        results[case] = out
    return results


# -- the train ranks ------------------------------------------------------------------


def _train(rank, sglang_port, refit_ports, bridge_dir, workdir):
    sys.path.insert(0, str(BRIDGE_SHARDS.parent))
    from bridge_shards import load, next_version

    from megatron_refit.config import RefitConfig
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.errors import RefitAbortedError
    from megatron_refit.families import is_mtp_param
    from megatron_refit.refit import trainer_refit_from_pieces

    results = {}
    for n, (case, gen_draft, path) in enumerate(CASES):
        # the MTP layer's pieces are optional, as Bridge's local shards mark them (the saved specs do not)
        pieces = [TensorPiece(spec, tensor, optional="mtp" if is_mtp_param(spec.name, FIRST_MTP) else None)
                  for spec, tensor in load(bridge_dir, MODEL, 1, rank)["weights"]]
        cfg = RefitConfig.from_dict({"enabled": True, "engine": "sglang", **_refit_section(refit_ports[n], gen_draft)})
        fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
        out = dict(reports=[])
        if path == "manual":
            try:
                fleet.refit(1)
            except RefitAbortedError as exc:
                out["refused"] = str(exc)
        else:
            for version in VERSIONS:
                if version > 1:  # the next step's weights, in place of the old (as a live model's)
                    next_version(pieces, bridge_dir, MODEL, version, rank)
                out["reports"].append(fleet.refit(version).as_dict())
        fleet.close()
        results[case] = out
    return results


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _gen)(rank, *args)


# -- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    """Every rank's results (train ranks first), from Bridge's shards made in ``.venv``."""
    bridge = make(tmp_path_factory.mktemp("bridge"), MODEL)  # in .venv
    sglang_port, *refit_ports = free_ports(1 + len(CASES))
    return run_spawned(_rank, NUM_TRAIN + TP, sglang_port, refit_ports, str(bridge),
                       str(tmp_path_factory.mktemp("sglang-draft")), timeout_s=300)


def _gens(refitted, case):
    return [r[case] for r in refitted[NUM_TRAIN:]]


@pytest.mark.slow
def test_the_trainers_mtp_layer_lands_in_sglangs_nextn_draft_bit_exact(refitted):
    gens = _gens(refitted, "draft")
    train = [r["draft"]["reports"] for r in refitted[:NUM_TRAIN]]
    for gen in gens:
        assert gen["types"] == ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMNextN")
        assert gen["selector"] == "all"
        assert any("draft DeepseekV3ForCausalLMNextN handed over" in line for line in gen["connect_log"])
    for i, version in enumerate(VERSIONS):
        for gen in gens:
            check = gen["checks"][i]
            assert check["names_equal"] and check["num_params"] > 0
            assert check["diff"] == [], (version, check["diff"][:5])
            assert check["derived"] == 6 and check["derived_diff"] == [], (version, check["derived_diff"])
            assert check["draft_names"] and check["draft_diff"] == [], (version, check["draft_diff"][:5])
            assert check["draft_derived"] == 2 and check["draft_derived_diff"] == []
            assert check["shared"]  # the draft's embedding and head are still the target's, written once
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["draft_error"] is None
            # SGLang's NextN: model.decoder.* (12), enorm, hnorm, eh_proj, shared_head.norm; each
            # written at version 1 (from NaN) and moved by version 2's step
            assert len(check["draft_moved"]) == check["draft_params"] == 18, (version, check["draft_moved"])
            assert any("nothing more to do" in line for line in gen["refit_logs"][i])
        reports = [r[i] for r in train]
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0
        assert reports[0]["summary"]["refit/skipped_params"] == 0  # the MTP layer is held: sent, not skipped
    for gen in gens:
        assert gen["closed"] == dict(connected=False, state=None, weights_version=None, error=None)


@pytest.mark.slow
def test_without_gen_draft_the_draft_is_left_untouched(refitted):
    """Selector ``target``: the draft's runner never sees a refit; a close sent to every runner
    reaches the draft's loader call, which leaves it alone, without an error."""
    train = [r["untouched"]["reports"] for r in refitted[:NUM_TRAIN]]
    for gen in _gens(refitted, "untouched"):
        assert gen["selector"] == "target"
        assert gen["connect_log"] == [] and gen["refit_logs"] == [[], []]  # the draft's runner was not called
        for i, version in enumerate(VERSIONS):
            check = gen["checks"][i]
            assert check["names_equal"] and check["diff"] == [] and check["derived_diff"] == [], version
            assert check["draft_moved"] == [] and check["shared"]
            assert check["state"] == "ready" and check["weights_version"] == version
        assert any("left untouched" in line for line in gen["close_log"]), gen["close_log"]
        assert gen["draft_state"]["error"] is None and gen["closed"]["error"] is None
    for reports in zip(*train):
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0
        assert reports[0]["summary"]["refit/skipped_params"] > 0  # the MTP layer: no engine rank holds it


@pytest.mark.slow
def test_a_refit_before_the_draft_is_handed_over_is_refused_by_name(refitted):
    for train in refitted[:NUM_TRAIN]:
        assert "failed their checks before any byte moved" in train["not-handed-over"]["refused"]
    for gen in _gens(refitted, "not-handed-over"):
        assert gen["connect_log"] == []
        assert "SGLang's draft was never handed over" in gen["refused"]["error"]
        assert gen["refused"]["weights_version"] is None


def test_gen_draft_without_a_nextn_draft_is_refused_by_name():
    from megatron_refit.config import RefitConfig
    from megatron_refit.engines.sglang.worker.draft import check_draft_server

    cfg = RefitConfig.from_dict({"enabled": True, "engine": "sglang", "gen_draft": True})
    check_draft_server(cfg, "EAGLE", 1)
    with pytest.raises(ValueError, match="speculative_algorithm is None, not one of"):
        check_draft_server(cfg, None, 1)
    with pytest.raises(ValueError, match="num_nextn_predict_layers=2"):
        check_draft_server(cfg, "EAGLE", 2)
