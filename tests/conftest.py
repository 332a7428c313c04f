"""Multi-process tests fork their ranks from a forkserver that imported torch, transformers
and Megatron once (megatron_refit/testing/preload.py): the suite's largest cost on 2 cores is
each fresh rank importing them again. Only where Megatron is installed (not in the vLLM
suite's environment, whose engine starts processes of its own); ``REFIT_SPAWN_PRELOAD=``
(empty) turns it off."""

import importlib.util
import os

if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
    os.environ.setdefault("REFIT_SPAWN_PRELOAD", "megatron_refit.testing.preload")
