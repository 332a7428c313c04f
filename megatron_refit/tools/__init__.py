"""Tooling around the runtime: the demo, the dry run and its enumeration cache, the cost
model, charts, the command-line helpers. The runtime (``megatron_refit`` outside this package,
:mod:`megatron_refit.local` and :mod:`megatron_refit.testing`) imports none of it, and it imports
nothing of :mod:`megatron_refit.testing` (the demo runs :mod:`megatron_refit.local`);
``python -m megatron_refit.demo`` / ``.dryrun`` / ``.costmodel`` are the command-line entry points."""

import importlib.util
import sys

_missing = [name for name in ("torch", "omegaconf") if importlib.util.find_spec(name) is None]
if _missing:  # a Python outside the project's venv: one line that says what to run, not a traceback
    raise SystemExit(f"megatron_refit's commands need {' and '.join(_missing)}, which {sys.executable} lacks: run "
                     "them in the project's venv (`make setup`, then `source .venv/bin/activate`; or call "
                     ".venv/bin/python)")
