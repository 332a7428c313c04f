"""Breaks a running vLLM server's post-load step on purpose (the serving check must catch it).

The running-server tests start the server with this folder on ``PYTHONPATH`` and
``MEGATRON_REFIT_TEST_BREAK`` naming a file; Python imports ``sitecustomize`` in every process of
the server (API server, engine core, workers), and the worker's ``megatron_refit`` engine then
reads the file before making each refit live:

- ``moe_reload``: vLLM's fused-MoE reload as it is without ``megatron_refit``'s fix (the experts'
  post-load step skipped: on CPU they stay unpacked);
- ``unload_layer``: the first decoder layer's pieces never reach vLLM's loaders (it keeps its
  weights from before the refit);
- ``permute_experts``: after the refit is live, the first MoE layer's experts 0 and 1 swapped
  (their weights, as vLLM holds them);
- ``staged_raise``: (``swap: staged``) the staged version's preparation beside the live model
  raises, once the bytes have landed in staging;
- ``not_preparable``: (``swap: staged``) the staged version cannot be prepared beside the live
  model (``NotPreparableError``): it loads under the pause, with the worker's WARNING;
- empty or absent: nothing is broken.
"""

from __future__ import annotations

import os

_FLAG = os.environ.get("MEGATRON_REFIT_TEST_BREAK")


def _break() -> str:
    try:
        with open(_FLAG) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def _install() -> None:
    """Patch the worker engine when vLLM loads the plugin (in every server process; the worker's
    module is imported then, with vLLM importable)."""
    import importlib

    from megatron_refit.engines.vllm import plugin

    register = plugin.register

    def register_and_break() -> None:
        register()
        _patch(importlib.import_module("megatron_refit.engines.vllm.worker.engine"))

    plugin.register = register_and_break


def _patch(worker) -> None:
    if getattr(worker.MegatronRefitEngine, "_test_break", False):
        return
    worker.MegatronRefitEngine._test_break = True
    from megatron_refit.engines.vllm.worker import moe_reload

    enter = moe_reload.FirstLoadSetup.__enter__

    def maybe_enter(self):
        return self if _break() == "moe_reload" else enter(self)

    moe_reload.FirstLoadSetup.__enter__ = maybe_enter
    load = worker.StagedPiecesStorage.load

    def maybe_unloaded(self, model=None, only=None):  # the layer's pieces never reach vLLM's loaders: it keeps its
        if _break() != "unload_layer":  # old weights
            return load(self, model, only)
        pieces = self._pieces
        self._pieces = [p for p in pieces if not p.name.startswith("model.layers.0.")]
        try:
            return load(self, model, only)
        finally:
            self._pieces = pieces

    worker.StagedPiecesStorage.load = maybe_unloaded
    make_live = worker.MegatronRefitEngine._make_live

    def maybe_permuted(self):
        make_live(self)
        if _break() == "permute_experts":
            import torch

            experts = next(m for m in self.model.model.layers[0].modules() if hasattr(m, "w13_weight"))
            with torch.no_grad():
                for weight in (experts.w13_weight, experts.w2_weight):
                    weight.data[[0, 1]] = weight.data[[1, 0]].clone()

    worker.MegatronRefitEngine._make_live = maybe_permuted
    prepare = worker.prepare

    def maybe_raising(*args, **kwargs):
        if _break() == "staged_raise":
            raise RuntimeError("engine error while the staged version was prepared (injected)")
        if _break() == "not_preparable":
            raise worker.NotPreparableError("this version cannot be prepared beside the live model (injected)")
        return prepare(*args, **kwargs)

    worker.prepare = maybe_raising


if _FLAG:
    _install()
