"""The ``refit:`` section (:class:`RefitConfig`, :mod:`.section`) and the training YAML that
holds it (:mod:`.training_yaml`), the trainer layout of its Bridge sections (:mod:`.bridge_model`):
pure, no Megatron, no torch.

The Bridge readers (``load_training_yaml``, ``split_refit_section``, ``train_layout``) are loaded
when first asked for: an engine process imports this package for :class:`RefitConfig` (what
crosses to it, :meth:`RefitConfig.from_wire`) and never reads a training YAML."""

from megatron_refit.config.section import RefitConfig, refit_section, typed_section
from megatron_refit.config.values import DELTA, OVERLAP_BUSY, check_int

_BRIDGE_READERS = {"load_training_yaml": "megatron_refit.config.training_yaml",
                   "split_refit_section": "megatron_refit.config.training_yaml",
                   "train_layout": "megatron_refit.config.bridge_model"}
"""The trainer-side readers of a Bridge training config, by name: their modules."""

__all__ = ["DELTA", "OVERLAP_BUSY", "RefitConfig", "check_int", "load_training_yaml", "refit_section",
           "split_refit_section", "train_layout", "typed_section"]


def __getattr__(name: str):
    if name in _BRIDGE_READERS:
        import importlib

        return getattr(importlib.import_module(_BRIDGE_READERS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
