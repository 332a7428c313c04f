"""#67: the trainer's MTP layer into vLLM 0.33's real ``DeepSeekMTP`` draft, on CPU over gloo.

The engine is vLLM's speculative decoding with the model's own MTP layer
(``SpeculativeConfig(method="deepseek_mtp")``, which vLLM names ``mtp``): vLLM's real ``Worker``
holds our weight-transfer engine (as in test_weight_transfer.py) and its model runner holds the
draft as vLLM's proposer loads it (``DeepSeekMTP`` built from the speculative config's draft model
config, the target's embedding and LM head shared into it by the proposer's own
``_maybe_share_embeddings`` / ``_maybe_share_lm_head``). The trainer's client refits through
vLLM's draft session (``start_draft_weight_update``), in which the worker hands the draft to the
engine.

Train TP2 x PP2 ranks with sequence parallelism under the recipe's pipeline layout, the MTP layer on
the last stage (Bridge's real local shards of a tiny DeepSeek-V3 with one MTP layer, made in
``.venv``) send through vLLM's trainer contract into engine TP2. After every
refit each engine rank's main model must equal vLLM's own ``load_weights`` of Bridge's export, its
draft must equal vLLM's own ``DeepSeekMTP.load_weights`` of the same export (bit for bit), the draft
must have moved between the versions, vLLM's post-load step ran on both models, and the bytes sent
are the minimal ones (the embedding and the LM head once). A plain ``start_weight_update`` under
``refit.gen_draft`` is refused by name. Then a new trainer connection to the same engine without
``gen_draft`` (a draft the trainer does not train, as an external EAGLE head is) leaves the draft
untouched, its post-load step included, skips the trainer's MTP layer by name, and refuses a draft
session: the engine forgot the first connection's draft.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

pytest.importorskip("vllm")

from tests.engines.vllm.bridge_shards import make  # noqa: E402
from tests.engines.vllm.test_weight_transfer import (HERE, VERSIONS, _Engine, _init_vllm,  # noqa: E402
                                                     _QueueClient, _Runner, _vllm_config, same_bytes, serve_calls)

TP = 2
MODEL = "deepseek-v3-mtp"  # made by bridge_shards.py: one MTP layer, train TP2 with SP and PP2 (4 ranks)
NUM_TRAIN = 4
FIRST_MTP = 3  # the preset's num_hidden_layers: the MTP layer is model.layers.3
CASES = {"draft": {"gen_draft": True}, "untouched": {"gen_draft": False}}
"""Case -> its ``refit:`` keys: one engine (a DeepSeekMTP draft) refitted with ``gen_draft``, then,
after that trainer connection's shutdown, by a new one without it (the engine forgets the first's
draft)."""
ENGINE = "engine"
"""The one engine both cases drive (the test's own calls build and check it by this name)."""


def _with_draft(vcfg):
    """``vcfg`` with vLLM's speculative config of the model's MTP layer as its draft."""
    from vllm.config import SpeculativeConfig

    vcfg.speculative_config = SpeculativeConfig(method="deepseek_mtp", num_speculative_tokens=1,
                                                target_model_config=vcfg.model_config,
                                                target_parallel_config=vcfg.parallel_config)
    return vcfg


def _draft(vcfg, target, loader_weights=None, post_load: bool = False):
    """vLLM's draft as its proposer loads it: ``DeepSeekMTP`` of the draft model config (dummy
    weights, or ``loader_weights`` through its own ``load_weights``; ``post_load``: then vLLM's
    post-load step, as its loader runs it: not for MoE on CPU), the target's embedding and LM head
    shared into it by the proposer's own code."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.spec_decode.eagle import EagleProposer

    draft_config = vcfg.speculative_config.draft_model_config
    with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
        draft = initialize_model(vllm_config=vcfg, model_config=draft_config)
    if loader_weights is None:
        get_model_loader(vcfg.load_config).load_weights(draft, draft_config)
    else:
        draft.load_weights(loader_weights)
    if post_load:
        process_weights_after_loading(draft, draft_config, torch.device("cpu"))
    proposer = EagleProposer.__new__(EagleProposer)  # its sharing steps only (no device, no runner)
    proposer.model, proposer.vllm_config, proposer.use_local_argmax_reduction = draft, vcfg, False
    proposer._maybe_share_embeddings(target)
    proposer._maybe_share_lm_head(target)
    return draft


class _DraftRunner(_Runner):
    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights)
        self.draft = _draft(self.vcfg, self.model, post_load=not self.moe)

    def get_draft_model(self):
        return self.draft


def _own(draft) -> dict[str, torch.Tensor]:
    """The draft's own parameters (not the target's shared embedding and LM head)."""
    return {n: p.data for n, p in draft.named_parameters()
            if n.startswith(f"model.layers.{FIRST_MTP}.") and ".shared_head.head." not in n}


class _DraftEngine(_Engine):
    def __init__(self, case, tp_rank, workdir, bridge_dir, model: str = MODEL, quant: dict | None = None,
                 moe: bool = True):
        """``quant``: an FP8 engine's ``quantization_config`` (its checkpoint then FP8 too); ``moe``:
        vLLM's post-load step is skipped (its MoE one cannot run on CPU) and counted, else run."""
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu_worker import Worker

        load_general_plugins()
        self.case, self.bridge_name, self.bridge_dir, self.moe, self.quant = case, model, bridge_dir, moe, quant
        self.vcfg = _with_draft(_vllm_config(model, TP, os.path.join(workdir, case), engine=True, quant=quant))
        self.worker = Worker(self.vcfg, local_rank=tp_rank, rank=tp_rank, distributed_init_method="unused",
                             is_driver_worker=tp_rank == 0)
        self.worker.device = torch.device("cpu")
        self.worker.model_runner = _DraftRunner(self.vcfg, moe)
        self.worker.load_model()
        self.before = {n: t.clone() for n, t in _own(self.worker.get_draft_model()).items()}
        self.post_loaded: list[str] = []
        """The classes vLLM's post-load step ran on, since the last check."""

    def _no_moe_post_load(self, call, **kwargs):
        from unittest import mock

        from vllm.model_executor.model_loader import utils

        real = None if self.moe else utils.process_weights_after_loading
        with mock.patch("vllm.model_executor.model_loader.utils.process_weights_after_loading", wraps=real) as post:
            out = call(**kwargs)
        self.post_loaded += [type(c.args[0]).__name__ for c in post.call_args_list]
        return out

    def check(self, version: int) -> dict:
        """The main model as test_weight_transfer checks it, and the draft against vLLM's own
        ``DeepSeekMTP.load_weights`` of Bridge's export (beside the main model's reference)."""
        from vllm.config import set_current_vllm_config

        from bridge_shards import load

        out = super().check(version)
        export = load(self.bridge_dir, self.bridge_name, version, 0)["export"]
        with set_current_vllm_config(self.vcfg):
            ref = _draft(self.vcfg, self.model, iter(self.checkpoint(export).items()), post_load=not self.moe)
        mine, theirs = _own(self.worker.get_draft_model()), _own(ref)
        out.update(draft_names=sorted(mine) == sorted(theirs) and len(mine) > 0, draft_params=len(mine),
                   draft_diff=sorted(n for n in mine if not same_bytes(mine[n], theirs[n])),
                   draft_moved=sorted(n for n in mine if not same_bytes(mine[n], self.before[n])),
                   draft_fp8=sorted(n for n in mine if mine[n].dtype == torch.float8_e4m3fn),
                   shared_head=all(layer.shared_head.head is self.model.lm_head
                                   for layer in self.worker.get_draft_model().model.layers.values()),
                   post_loaded=self.post_loaded)
        self.before, self.post_loaded = {n: t.clone() for n, t in mine.items()}, []
        return out

    def checkpoint(self, export: dict) -> dict:
        from megatron_refit.endpoint.fp8 import fp8_checkpoint

        return fp8_checkpoint(export) if self.quant else export


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    sys.path.insert(0, str(HERE))
    gen = rank - NUM_TRAIN
    _init_vllm(TP, gen, vllm_port, _vllm_config(MODEL, TP, os.path.join(workdir, "x"), False))
    serve_calls(requests[gen], replies[gen], lambda case: _DraftEngine(case, gen, workdir, bridge_dir))


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir):
    return train_cases(rank, world, requests, replies, refit_ports, bridge_dir, CASES)


def train_cases(rank, world, requests, replies, refit_ports, bridge_dir, cases: dict, model: str = MODEL) -> dict:
    """Train rank ``rank``: the engine ranks build their engine, each of ``cases`` (case -> its
    ``refit:`` keys) refits it over a trainer connection of its own (``refit_ports`` in order), then
    the engine ranks stop. Each case's :func:`_refits`."""
    sys.path.insert(0, str(HERE))
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    gens = list(range(world - NUM_TRAIN))
    if rank == 0:
        _QueueClient(requests, replies, gens, ENGINE).call("case")
    out = {case: _refits(rank, requests, replies, gens, case, port, bridge_dir, model=model, **keys)
           for (case, keys), port in zip(cases.items(), refit_ports)}
    if rank == 0:
        for g in gens:
            requests[g].put((-1, "stop", {}))
    return out


def _refits(rank, requests, replies, gens, case, port, bridge_dir, model: str = MODEL, **refit_keys) -> dict:
    """``case``'s refits from train rank ``rank`` (``refit_keys``: more of the ``refit:`` section)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from bridge_shards import load, next_version
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo
    from megatron_refit.families import is_mtp_param

    client = _QueueClient(requests, replies, gens, ENGINE)
    # the MTP layer's pieces are optional, as Bridge's local shards mark them (an engine may hold no draft)
    weights = [TensorPiece(spec, t, optional="mtp" if is_mtp_param(spec.name, FIRST_MTP) else None)
               for spec, t in load(bridge_dir, model, 1, rank)["weights"]]
    refit = dict(dict(gen_tp=TP, gen_dp=1, gen_draft=True, port=port, bucket_mb=0.25, timeout_s=120), **refit_keys)
    engine = WeightTransferTrainerFactory.trainer_init(
        MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank), client=client,
        source=LocalShardSource(weights))
    out = []
    for version in VERSIONS:
        if version > 1:
            next_version(weights, bridge_dir, model, version, rank)
        report = engine.send_weights()
        out.append(dict(report=report.as_dict(), checks=client.call("check", version=version) if rank == 0 else None))
    wrong = None
    if rank == 0:  # the other session than the config's: refused before any byte moves
        try:
            client.start_weight_update() if refit["gen_draft"] else client.start_draft_weight_update()
        except RuntimeError as exc:
            wrong = str(exc)
    engine.shutdown()
    return dict(refits=out, wrong=wrong)


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _serve)(rank, world, port, *args)


def spawn(tmp_path_factory, rank_fn, model: str, connections: int) -> list:
    """Bridge's shards of ``model``, then :data:`NUM_TRAIN` train ranks and :data:`TP` engine ranks
    running ``rank_fn(rank, world, port, requests, replies, vllm_port, refit_ports, workdir,
    bridge_dir)`` (``connections`` refit ports): their results."""
    import multiprocessing as mp

    bridge = make(tmp_path_factory.mktemp("bridge"), model)
    ctx = mp.get_context("spawn")
    requests, replies = [ctx.Queue() for _ in range(TP)], [ctx.Queue() for _ in range(TP)]
    vllm_port, *refit_ports = free_ports(1 + connections)
    return run_spawned(rank_fn, NUM_TRAIN + TP, requests, replies, vllm_port, refit_ports,
                       str(tmp_path_factory.mktemp("engine")), str(bridge), timeout_s=600,
                       env={"VLLM_TARGET_DEVICE": "cpu"})


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    return spawn(tmp_path_factory, _rank, MODEL, len(CASES))


def assert_landed(check: dict, version: int, *where) -> None:
    """An engine rank's check of refit ``version`` (:meth:`_DraftEngine.check`): the main model and
    the draft bit-exact against vLLM's own loads, the engine ready at that version."""
    assert check["names_equal"] and check["diff"] == [], (*where, version, check["diff"][:5])
    assert check["draft_names"] and check["draft_diff"] == [], (*where, version, check["draft_diff"][:5])
    assert check["state"] == "ready" and check["weights_version"] == version


@pytest.mark.slow
def test_the_trainers_mtp_layer_lands_in_vllms_deepseek_mtp_draft_bit_exact(refitted):
    train = [out["draft"]["refits"] for out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == TP
        for check in checks:
            assert_landed(check, version)
            if version > 1:  # version 2's step moved every draft parameter (version 1's norms are the dummy's ones)
                assert len(check["draft_moved"]) == check["draft_params"] == 18, (version, check["draft_moved"])
            assert check["shared_head"]  # the draft's LM head is still the target's, written once
            assert sorted(check["post_loaded"]) == ["DeepSeekMTP", "DeepseekV3ForCausalLM"]
        reports = [item["report"] for item in items]
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0
        assert reports[0]["summary"]["refit/skipped_params"] == 0  # the MTP layer is held: sent, not skipped


@pytest.mark.slow
def test_a_draft_the_trainer_does_not_refit_is_left_untouched_its_post_load_included(refitted):
    train = [out["untouched"]["refits"] for out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        for check in items[0]["checks"]:
            assert check["names_equal"] and check["diff"] == [], (version, check["diff"][:5])
            assert check["draft_moved"] == [] and check["draft_params"] == 18  # as the last refit with it left it
            assert check["post_loaded"] == ["DeepseekV3ForCausalLM"]
        summary = items[0]["report"]["summary"]
        assert summary["refit/skipped_params"] > 0  # the trainer's MTP layer: skipped by name, counted


@pytest.mark.slow
def test_a_refit_in_the_other_session_than_the_config_says_is_refused_by_name(refitted):
    assert "refit.gen_draft is on: refit through vLLM's start_draft_weight_update" in refitted[0]["draft"]["wrong"]
    assert "start_draft_weight_update, but refit.gen_draft is off" in refitted[0]["untouched"]["wrong"]
