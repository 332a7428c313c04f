"""``swap: staged`` in vLLM's worker engine (vLLM 0.33, in one process): the version is prepared
beside the live model in the staging thread; its failures surface in the update's ``complete``
call, before any pause; a version that cannot be prepared so is named and loads under the pause.

(The preparation itself, vLLM's layerwise load on a shadow of a real model, is checked bit for
bit by ``test_weight_transfer.py``'s ``qwen3-staged`` case and, by what the server serves, by the
running-server suite: ``tests/engines/vllm_server``.)
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from tests.engines.vllm.test_weight_transfer import _vllm_config

pytest.importorskip("vllm")


class _Received:
    """What the refit group hands over: each version, every byte in (its group has no store)."""

    group = None

    def receive(self, version, full=False):
        from megatron_refit.endpoint.report import RefitReport

        return RefitReport(version=version, role="gen", rank=0)


class _Storage:
    """Staging buffers that record where they were loaded: the live model or a shadow."""

    nbytes = 1 << 20
    """The staging buffers' bytes."""

    def __init__(self):
        self.loads: list[str] = []
        self.targets: list = []
        """Each load's model (None: the live model's own reload)."""

    def load(self, model=None, only=None):
        self.loads.append("live" if model is None else "shadow")
        self.targets.append(model)


@pytest.fixture
def staged(tmp_path, monkeypatch):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's entry point registers our engine by name
    vcfg = _vllm_config("qwen3", 1, str(tmp_path), engine=True)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_refit"), vcfg,
                                                       torch.device("cpu"), torch.nn.Linear(1, 1))
    engine.member, engine._storage, engine._mode, engine._staged_swap = _Received(), _Storage(), "load_weights", True
    engine.member.group = types.SimpleNamespace(store=None)
    engine.gen_index = 0
    engine._timeout_s = 30.0
    return engine


def _prepare_raising(monkeypatch, exc: Exception) -> None:
    from megatron_refit.engines.vllm.worker import engine as worker

    def raising(*args, **kwargs):
        raise exc

    monkeypatch.setattr(worker, "prepare", raising)


def test_staged_version_that_cannot_be_prepared_beside_the_model_is_named_and_loads_under_the_pause(
        staged, monkeypatch, caplog):
    from megatron_refit.engines.vllm.worker.prepare import NotPreparableError

    why = "vLLM layer model.layers.0.self_attn.attn: an attention layer whose reload loads tensors (injected)"
    _prepare_raising(monkeypatch, NotPreparableError(why))
    staged.start_weight_update()
    staged.update_weights({"version": 1})
    with caplog.at_level(logging.WARNING, logger="megatron_refit"):
        staged.update_weights({"version": 1, "complete": True})
    assert staged._storage.loads == [] and staged.state == "stale"  # nothing live yet: it serves on
    assert any("loads under the pause" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    staged.finish_weight_update()
    assert staged._storage.loads == ["live"]  # vLLM's reload of the live model, under the pause
    assert staged.state == "ready" and staged.weights_version == 1
    assert staged.last_swap["prepared"] is False and staged.last_swap["why"] == why and staged.last_swap["swap_s"] >= 0


def test_staged_shadow_over_swap_budget_mb_is_not_made_the_version_loads_under_the_pause_named(staged, caplog):
    """refit.swap_budget_mb bounds the staging buffers and the shadow together: here the buffers
    (1 MiB) leave 4 bytes, and the shadow of the model (a Linear(1, 1): 8 bytes) does not fit."""
    staged._budget_bytes = staged._storage.nbytes + 4
    staged.start_weight_update()
    staged.update_weights({"version": 3})
    with caplog.at_level(logging.WARNING, logger="megatron_refit"):
        staged.update_weights({"version": 3, "complete": True})
    assert any("loads under the pause: its shadow would take about" in r.getMessage()
               and "refit.swap_budget_mb" in r.getMessage() for r in caplog.records), caplog.text
    staged.finish_weight_update()
    assert staged._storage.loads == ["live"] and staged.state == "ready"
    assert staged.last_swap["prepared"] is False and staged.last_swap["staging_bytes"] == 1 << 20


def test_staged_version_whose_preparation_fails_fails_its_update_weights_and_never_touches_the_live_model(
        staged, monkeypatch):
    _prepare_raising(monkeypatch, RuntimeError("engine error while preparing (injected)"))
    staged.start_weight_update()
    staged.update_weights({"version": 2})
    with pytest.raises(RuntimeError, match=r"engine error while preparing \(injected\)"):
        staged.update_weights({"version": 2, "complete": True})  # vLLM ends its update session on this
    with pytest.raises(RuntimeError, match="finish_weight_update without a completed update_weights"):
        staged.finish_weight_update()
    assert staged._storage.loads == [] and staged.weights_version is None
    staged.start_weight_update()  # the next update starts clean
    assert staged._staging is None and staged._prepared is None


def test_a_staged_draft_that_cannot_be_prepared_loads_under_the_pause_with_the_model(staged, monkeypatch):
    """#67, ``gen_draft``: the model's version is prepared beside it, its draft's is not: the model's
    is not swapped in alone; both load under the pause (the model's reload, then the draft's)."""
    from megatron_refit.engines.vllm.worker import engine as worker
    from megatron_refit.engines.vllm.worker.prepare import NotPreparableError

    swapped = []
    monkeypatch.setattr(worker, "prepare", lambda *args, **kwargs: types.SimpleNamespace(
        swap=lambda: swapped.append("model"), nbytes=0, seconds=0.0))

    def not_preparable(*args, **kwargs):
        raise NotPreparableError("the draft's shadow (injected)")

    monkeypatch.setattr(worker, "prepare_draft", not_preparable)
    draft = torch.nn.Linear(1, 1)
    staged._with_draft = types.SimpleNamespace(is_draft=lambda name: name.startswith("model.layers.3."),
                                               hand_over=lambda model: None)
    staged.set_weight_update_target(draft, staged.model_config)  # vLLM's draft session
    staged.start_weight_update()
    staged.update_weights({"version": 1})
    staged.update_weights({"version": 1, "complete": True})
    staged.finish_weight_update()
    assert swapped == []
    assert staged._storage.targets == [None, draft]  # the live model's reload, then the draft's
    assert staged.state == "ready" and staged.last_swap["prepared"] is False


def test_staged_complete_call_outside_a_staged_update_is_refused_by_name(staged, monkeypatch):
    from megatron_refit.engines.vllm.worker import engine as worker
    from megatron_refit.engines.vllm.worker.prepare import Prepared

    monkeypatch.setattr(worker, "prepare", lambda *args, **kwargs: Prepared([], 0, 0.0))
    with pytest.raises(RuntimeError, match="update_info.complete is swap: staged's second update_weights call"):
        staged.update_weights({"version": 3, "complete": True})
    staged.start_weight_update()
    staged.update_weights({"version": 3})
    with pytest.raises(RuntimeError, match="complete for version 4, but the staged update received 3"):
        staged.update_weights({"version": 4, "complete": True})
    staged.start_weight_update()  # the staging that ended no update is dropped by the next
    staged.update_weights({"version": 5})
    staged.update_weights({"version": 5, "complete": True})
    staged.finish_weight_update()
    assert staged.state == "ready" and staged.weights_version == 5 and staged.last_swap["prepared"] is True
    with pytest.raises(ValueError, match=r"update_info\.complete must be true or false"):
        staged.parse_update_info({"version": 3, "complete": "yes"})


def test_staged_swap_that_fails_half_way_leaves_the_weights_stale_never_ready(staged, monkeypatch):
    from megatron_refit.engines.vllm.worker import engine as worker

    class HalfSwapped:
        seconds, nbytes = 0.0, 0

        def swap(self):
            raise RuntimeError("swap failed half way (injected)")

    monkeypatch.setattr(worker, "prepare", lambda *args, **kwargs: HalfSwapped())
    staged.start_weight_update()
    staged.update_weights({"version": 6})
    staged.update_weights({"version": 6, "complete": True})
    with pytest.raises(RuntimeError, match=r"swap failed half way \(injected\)"):
        staged.finish_weight_update()  # the client keeps the server paused
    assert staged.state == "stale" and staged.weights_version is None


def _qwen2_config():
    """A Qwen2 shape: its q/k/v projections have biases, which vLLM's reload loads where they
    are instead of restoring them on the meta device."""
    import transformers

    return transformers.Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                    tie_word_embeddings=False)


def _hf_weights(seed: int) -> dict:
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(_qwen2_config())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _vllm_model(vcfg):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    with set_current_vllm_config(vcfg):
        vcfg.compilation_config.static_forward_context.clear()  # a second instance: its layers by the same names
        return get_model_loader(vcfg.load_config).load_model(vllm_config=vcfg, model_config=vcfg.model_config)


def _tensors(model) -> dict:
    return {name: t.detach().clone() for name, t in list(model.named_parameters()) + list(model.named_buffers())}


def _shadow_rank(rank, world, port, workdir):
    import json
    import os

    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    from megatron_refit.engines.vllm.worker.moe_reload import FirstLoadSetup
    from megatron_refit.engines.vllm.worker.prepare import prepare
    from tests.engines.vllm.test_weight_transfer import _init_vllm

    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(_qwen2_config().to_dict(), f)
    vcfg = VllmConfig(model_config=ModelConfig(workdir, skip_tokenizer_init=True, enforce_eager=True,
                                               max_model_len=128, dtype="float32"),
                      parallel_config=ParallelConfig(tensor_parallel_size=1), device_config=DeviceConfig("cpu"),
                      load_config=LoadConfig(load_format="dummy"))
    _init_vllm(1, 0, port, vcfg)
    live, reference = _vllm_model(vcfg), _vllm_model(vcfg)
    out = {}
    with set_current_vllm_config(vcfg), torch.no_grad():
        initialize_layerwise_reload(live)  # vLLM's own reload first: it leaves its loader wrappers behind
        live.load_weights(iter(_hf_weights(1).items()))
        finalize_layerwise_reload(live, vcfg.model_config)
        serving = _tensors(live)
        new = _hf_weights(2)
        prepared = prepare(live, lambda shadow: shadow.load_weights(iter(new.items())), first_load_setup=FirstLoadSetup)
        during = _tensors(live)
        out["untouched"] = sorted(n for n in serving if not torch.equal(serving[n], during[n]))
        out["swap_s"] = prepared.swap()
        reference.load_weights(iter(new.items()))
        process_weights_after_loading(reference, vcfg.model_config, torch.device("cpu"))
        got, want = _tensors(live), _tensors(reference)
        out["names"] = sorted(got) == sorted(want)
        out["differ"] = sorted(n for n in want if n in got and not torch.equal(got[n], want[n]))
        out["changed"] = sorted(n for n in got if not torch.equal(got[n], serving[n]))
        out["nbytes"] = prepared.nbytes
    return out


def test_staged_prepare_never_writes_the_serving_model_and_swaps_in_what_vllms_own_load_makes(tmp_path):
    """vLLM's own load on a shadow of a real vLLM model (Qwen2: biases, which vLLM's reload loads
    in place), after a reload of vLLM's own (its loader wrappers left behind): the serving model
    is not written while it prepares; after the swap every parameter and buffer equals, bit for
    bit, what vLLM's ``load_weights`` + post-load make of the same weights on a second instance."""
    from megatron_refit.local.launch import run_spawned

    out = run_spawned(_shadow_rank, 1, str(tmp_path), timeout_s=180)[0]
    assert out["untouched"] == [], out["untouched"]  # biases included
    assert out["names"] and out["differ"] == [], out["differ"]
    assert any(n.endswith("qkv_proj.bias") for n in out["changed"]) and len(out["changed"]) > 10, out["changed"]
    assert out["nbytes"] > 0 and out["swap_s"] < 1.0
