"""``swap: staged`` in vLLM's worker engine (vLLM 0.33, in one process): the version is prepared
beside the live model in the staging thread; its failures surface in the update's ``complete``
call, before any pause; a version that cannot be prepared so is named and loads under the pause.

(The preparation itself, vLLM's layerwise load on a shadow of a real model, is checked bit for
bit by ``test_weight_transfer.py``'s ``qwen3-staged`` case and, by what the server serves, by the
running-server suite: ``tests/engines/vllm_server``.)
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engines.vllm.test_weight_transfer import _vllm_config

pytest.importorskip("vllm")


class _Received:
    """What the refit group hands over: each version, every byte in."""

    def receive(self, version, full=False):
        from megatron_refit.endpoint.report import RefitReport

        return RefitReport(version=version, role="gen", rank=0)


class _Backend:
    """Staging buffers that record where they were loaded: the live model or a shadow."""

    def __init__(self):
        self.loads: list[str] = []

    def load(self, model=None):
        self.loads.append("live" if model is None else "shadow")


@pytest.fixture
def staged(tmp_path, monkeypatch):
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's entry point registers our engine by name
    vcfg = _vllm_config("qwen3", 1, str(tmp_path), engine=True)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="megatron_refit"), vcfg,
                                                       torch.device("cpu"), torch.nn.Linear(1, 1))
    engine.member, engine._backend, engine._mode, engine._staged_swap = _Received(), _Backend(), "load_weights", True
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
    assert staged._backend.loads == [] and staged.state == "stale"  # nothing live yet: it serves on
    assert any("loads under the pause" in r.getMessage() and why in r.getMessage() for r in caplog.records)
    staged.finish_weight_update()
    assert staged._backend.loads == ["live"]  # vLLM's reload of the live model, under the pause
    assert staged.state == "ready" and staged.weights_version == 1
    assert staged.last_swap["prepared"] is False and staged.last_swap["why"] == why and staged.last_swap["swap_s"] >= 0


def test_staged_version_whose_preparation_fails_fails_its_update_weights_and_never_touches_the_live_model(
        staged, monkeypatch):
    _prepare_raising(monkeypatch, RuntimeError("engine error while preparing (injected)"))
    staged.start_weight_update()
    staged.update_weights({"version": 2})
    with pytest.raises(RuntimeError, match=r"engine error while preparing \(injected\)"):
        staged.update_weights({"version": 2, "complete": True})  # vLLM ends its update session on this
    with pytest.raises(RuntimeError, match="finish_weight_update without a completed update_weights"):
        staged.finish_weight_update()
    assert staged._backend.loads == [] and staged.weights_version is None
    staged.start_weight_update()  # the next update starts clean
    assert staged._staging is None and staged._prepared is None


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
