"""The ``refit:`` section (:class:`RefitConfig`, :mod:`.section`) and the training YAML that
holds it (:mod:`.training_yaml`), the trainer layout of its Bridge sections (:mod:`.bridge_model`):
pure, no Megatron, no torch."""

from megatron_refit.config.section import RefitConfig, refit_section, typed_section
from megatron_refit.config.values import DELTA, OVERLAP_BUSY, check_int
from megatron_refit.config.bridge_model import train_layout
from megatron_refit.config.training_yaml import load_training_yaml, split_refit_section

__all__ = ["DELTA", "OVERLAP_BUSY", "RefitConfig", "check_int", "load_training_yaml", "refit_section",
           "split_refit_section", "train_layout", "typed_section"]
