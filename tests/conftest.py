"""Multi-process tests fork their ranks from a forkserver that imported torch, transformers
and Megatron once (megatron_refit/tools/preload.py): the suite's largest cost on 2 cores is
each fresh rank importing them again. ``REFIT_SPAWN_PRELOAD=`` (empty) turns it off."""

import os

os.environ.setdefault("REFIT_SPAWN_PRELOAD", "megatron_refit.tools.preload")
