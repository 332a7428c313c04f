"""#67: an external EAGLE draft (one the trainer does not train) is left untouched by the refits, on CPU over gloo.

The engine is vLLM 0.33's speculative decoding with an EAGLE head of its own: a tiny EAGLE-1
head's checkpoint config (``LlamaForCausalLM``, one decoder layer, the target's sizes) in a
directory, given as ``SpeculativeConfig(method="eagle", model=<that directory>)``; vLLM's config
turns it into ``EagleLlamaForCausalLM``. vLLM's real ``Worker`` holds our weight-transfer engine
(as in test_weight_transfer.py) and its model runner holds the draft as vLLM's proposer loads it
(``get_model`` of the draft model config with vLLM's dummy loader, then the proposer's own
``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: the dummy loader reads no checkpoint
tensor, so the head has no embedding or LM head of its own and takes the target's modules).

Train TP2 ranks (Bridge's real local shards of the tiny ``llama3``, made in ``.venv``) connect to
engine TP2 twice. First with ``refit.gen_draft: true``: the engine refuses it by name at
``init_weight_transfer_engine`` (vLLM's method is ``eagle``, not the model's MTP layers), every
train rank gets that error from ``trainer_init`` and no byte moved. Then without it, for two
refits: after each the main model equals vLLM's own ``load_weights`` of Bridge's export bit for bit
(the embedding and LM head the draft shares included), every parameter of the draft's own
(``fc`` and its decoder layer) holds the bytes it held when the engine was built, the draft still
shares the target's modules, and vLLM's post-load step ran on the main model alone.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron_refit.local.launch import free_ports, run_spawned

pytest.importorskip("vllm")

from tests.engines.vllm.bridge_shards import make, model_config  # noqa: E402
from tests.engines.vllm.test_weight_transfer import (HERE, VERSIONS, _Engine, _init_vllm,  # noqa: E402
                                                     _QueueClient, _Runner, _vllm_config, same_bytes, serve_calls)

TP = 2
MODEL = "llama3"  # made by bridge_shards.py at train TP2; vLLM 0.33's EAGLE head for it: EagleLlamaForCausalLM
NUM_TRAIN = 2
ENGINE = "engine"
CONNECTIONS = {"gen_draft": True, "untouched": False}
"""Connection -> ``refit.gen_draft``: the same engine, refused with it, then refitted without it."""
DRAFT_OWN = 6
"""The EAGLE head's own parameters once it shares the target's embedding and LM head: ``fc`` and its
decoder layer's ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` and
``post_attention_layernorm`` (EAGLE-1 drops the layer's input norm)."""


def _write_eagle_checkpoint(path: str) -> str:
    """A tiny EAGLE-1 head's checkpoint config for ``MODEL`` (no weights: vLLM's dummy loader fills them)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(dict(model_config(MODEL).to_dict(), num_hidden_layers=1), f)
    return path


def _with_eagle(vcfg, draft_dir: str):
    """``vcfg`` with vLLM's speculative config of the EAGLE head in ``draft_dir`` as its draft."""
    from vllm.config import SpeculativeConfig

    vcfg.speculative_config = SpeculativeConfig(method="eagle", model=draft_dir, num_speculative_tokens=1,
                                                target_model_config=vcfg.model_config,
                                                target_parallel_config=vcfg.parallel_config)
    return vcfg


def _eagle(vcfg, target):
    """vLLM's EAGLE draft as its proposer loads it: ``get_model`` of the draft model config (vLLM's
    dummy loader and post-load), then the proposer's own sharing of the target's embedding and LM head."""
    from vllm.model_executor.model_loader import get_model
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.v1.spec_decode.eagle import EagleProposer

    draft = get_model(vllm_config=vcfg, model_config=vcfg.speculative_config.draft_model_config,
                      load_config=get_draft_load_config(vcfg))
    proposer = EagleProposer.__new__(EagleProposer)  # its sharing steps only (no device, no runner)
    proposer.model, proposer.vllm_config, proposer.use_local_argmax_reduction = draft, vcfg, False
    proposer._maybe_share_embeddings(target)
    proposer._maybe_share_lm_head(target)
    return draft


class _EagleRunner(_Runner):
    def load_model(self, load_dummy_weights: bool = False) -> None:
        super().load_model(load_dummy_weights)
        self.draft = _eagle(self.vcfg, self.model)

    def get_draft_model(self):
        return self.draft


def _own(draft, target) -> dict[str, torch.Tensor]:
    """The draft's own parameters (not the target's modules it shares)."""
    shared = {id(p) for p in target.parameters()}
    return {n: p.data for n, p in draft.named_parameters() if id(p) not in shared}


class _EagleEngine(_Engine):
    def __init__(self, case, tp_rank, workdir, bridge_dir, draft_dir):
        from vllm.plugins import load_general_plugins
        from vllm.v1.worker.gpu_worker import Worker

        load_general_plugins()
        self.case, self.bridge_name, self.bridge_dir, self.moe = case, MODEL, bridge_dir, False
        self.vcfg = _with_eagle(_vllm_config(MODEL, TP, os.path.join(workdir, case), engine=True), draft_dir)
        self.worker = Worker(self.vcfg, local_rank=tp_rank, rank=tp_rank, distributed_init_method="unused",
                             is_driver_worker=tp_rank == 0)
        self.worker.device = torch.device("cpu")
        self.worker.model_runner = _EagleRunner(self.vcfg, False)
        self.worker.load_model()
        self.draft_before = {n: t.clone() for n, t in self._draft_own().items()}
        self.main_before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.post_loaded: list[str] = []
        """The classes vLLM's post-load step ran on, since the last check."""

    def _draft_own(self) -> dict[str, torch.Tensor]:
        return _own(self.worker.get_draft_model(), self.model)

    def _no_moe_post_load(self, call, **kwargs):
        """``call`` with vLLM's post-load step run as it is, and counted by the class it ran on."""
        from unittest import mock

        from vllm.model_executor.model_loader import utils

        with mock.patch.object(utils, "process_weights_after_loading",
                               wraps=utils.process_weights_after_loading) as post:
            out = call(**kwargs)
        self.post_loaded += [type(c.args[0]).__name__ for c in post.call_args_list]
        return out

    def _draft_state(self) -> dict:
        draft, mine = self.worker.get_draft_model(), self._draft_own()
        return dict(draft_class=type(draft).__name__, draft_params=len(mine),
                    draft_names=sorted(mine) == sorted(self.draft_before),
                    draft_moved=sorted(n for n in mine if not same_bytes(mine[n], self.draft_before[n])),
                    shared=draft.model.embed_tokens is self.model.model.embed_tokens
                    and draft.lm_head is self.model.lm_head)

    def check(self, version: int) -> dict:
        """The main model as test_weight_transfer checks it; the draft against its bytes at construction."""
        out = dict(super().check(version), **self._draft_state(), post_loaded=self.post_loaded)
        self.post_loaded = []
        return out

    def connection_state(self) -> dict:
        """The engine's side after a refused connection: no member, nothing moved."""
        engine = self.worker.weight_transfer_engine
        return dict(self._draft_state(), member=engine.member is not None, state=engine.state,
                    weights_version=engine.weights_version,
                    main_moved=sorted(n for n, p in self.model.named_parameters()
                                      if not same_bytes(p, self.main_before[n])))


def _serve(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir, draft_dir):
    sys.path.insert(0, str(HERE))
    gen = rank - NUM_TRAIN
    _init_vllm(TP, gen, vllm_port, _vllm_config(MODEL, TP, os.path.join(workdir, "x"), False))
    serve_calls(requests[gen], replies[gen], lambda case: _EagleEngine(case, gen, workdir, bridge_dir, draft_dir))


def _train(rank, world, port, requests, replies, vllm_port, refit_ports, workdir, bridge_dir, draft_dir):
    sys.path.insert(0, str(HERE))
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from bridge_shards import load, next_version
    from megatron_refit.endpoint.sender import TensorPiece
    from megatron_refit.engines.vllm.trainer.engine import LocalShardSource, MegatronRefitTrainerInitInfo

    load_general_plugins()
    gens = list(range(world - NUM_TRAIN))
    client = _QueueClient(requests, replies, gens, ENGINE)
    if rank == 0:
        client.call("case")
    weights = [TensorPiece(spec, t) for spec, t in load(bridge_dir, MODEL, 1, rank)["weights"]]

    def connect(name: str, port: int):
        refit = dict(gen_tp=TP, gen_dp=1, gen_draft=CONNECTIONS[name], port=port, bucket_mb=0.25, timeout_s=60)
        return WeightTransferTrainerFactory.trainer_init(
            MegatronRefitTrainerInitInfo(refit=refit, num_train=NUM_TRAIN, rank=rank), client=client,
            source=LocalShardSource(weights))

    out = dict(refused=None, after_refusal=None, refits=[])
    try:
        connect("gen_draft", refit_ports[0]).shutdown()
    except Exception as exc:  # noqa: BLE001 -- the test reads which error each rank saw
        out["refused"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        out["after_refusal"] = client.call("connection_state")
    engine = connect("untouched", refit_ports[1])
    for version in VERSIONS:
        if version > 1:
            next_version(weights, bridge_dir, MODEL, version, rank)
        report = engine.send_weights()
        out["refits"].append(dict(report=report.as_dict(),
                                  checks=client.call("check", version=version) if rank == 0 else None))
    engine.shutdown()
    if rank == 0:
        for g in gens:
            requests[g].put((-1, "stop", {}))
    return out


def _rank(rank, world, port, *args):
    return (_train if rank < NUM_TRAIN else _serve)(rank, world, port, *args)


@pytest.fixture(scope="module")
def refitted(tmp_path_factory):
    bridge = make(tmp_path_factory.mktemp("bridge"), MODEL)
    draft_dir = _write_eagle_checkpoint(str(tmp_path_factory.mktemp("eagle-head")))
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    requests = [ctx.Queue() for _ in range(TP)]
    replies = [ctx.Queue() for _ in range(TP)]
    vllm_port, *refit_ports = free_ports(1 + len(CONNECTIONS))
    return run_spawned(_rank, NUM_TRAIN + TP, requests, replies, vllm_port, refit_ports,
                       str(tmp_path_factory.mktemp("engine")), str(bridge), draft_dir, timeout_s=600,
                       env={"VLLM_TARGET_DEVICE": "cpu"})


@pytest.mark.slow
def test_an_external_eagle_draft_is_left_untouched_by_the_refits_its_post_load_included(refitted):
    train = [out["refits"] for out in refitted[:NUM_TRAIN]]
    for version, items in zip(VERSIONS, zip(*train)):
        checks = items[0]["checks"]
        assert len(checks) == TP
        for check in checks:
            assert check["names_equal"] and check["diff"] == [], (version, check["diff"][:5])
            assert check["state"] == "ready" and check["weights_version"] == version
            assert check["draft_class"] == "EagleLlamaForCausalLM"
            assert check["draft_names"] and check["draft_params"] == DRAFT_OWN
            assert check["draft_moved"] == [], (version, check["draft_moved"])  # byte for byte as built
            assert check["shared"]  # its embedding and LM head still the target's (refitted as the target's)
            assert check["post_loaded"] == ["LlamaForCausalLM"]  # never on EagleLlamaForCausalLM
        reports = [item["report"] for item in items]
        assert sum(r["bytes_sent"] for r in reports) == reports[0]["bytes_minimal"] > 0


@pytest.mark.slow
def test_gen_draft_on_an_eagle_engine_is_refused_by_name_before_any_byte_moves(refitted):
    for out in refitted[:NUM_TRAIN]:  # every train rank: a named error from trainer_init, no hang
        assert out["refused"] is not None
        assert ("refit.gen_draft: this vLLM engine's speculative method is 'eagle', not one of ['mtp']"
                in out["refused"]), out["refused"]
        assert "a draft the trainer does not train is left untouched with gen_draft: false" in out["refused"]
    for state in refitted[0]["after_refusal"]:
        assert not state["member"] and state["state"] == "stale" and state["weights_version"] is None
        assert state["main_moved"] == [] and state["draft_moved"] == [] and state["shared"]
