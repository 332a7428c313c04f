"""Import ``mamba_ssm`` (and so Megatron's MambaMixer) on a machine without its CUDA builds.

``mamba-ssm`` and ``causal-conv1d`` install here with their CUDA extensions skipped
(``scripts/setup_venv.sh``). Their Python packages then import the compiled modules
``selective_scan_cuda`` and ``causal_conv1d_cuda`` at module level and fail. Megatron only
needs the import to succeed (``megatron.core.ssm.mamba_mixer`` sets ``HAVE_MAMBA_SSM`` from
it); the kernels themselves are CUDA / Triton-only and never run on CPU: the CPU forward is
:func:`conversion.testing.nemotron_h_build.mixer_forward_cpu`.

:func:`install` puts an empty stand-in module into ``sys.modules`` for each compiled
extension that is missing, before Megatron is imported (:func:`conversion.te_shim.import_bridge`
calls it). A stand-in has no attributes: calling any kernel raises ``AttributeError``.
With the real extensions installed, or without ``mamba_ssm``, nothing is patched.
"""

from __future__ import annotations

import importlib.util
import sys
import types

EXTENSIONS = ("selective_scan_cuda", "causal_conv1d_cuda")
"""The compiled modules ``mamba_ssm`` and ``causal_conv1d`` import at module level."""


class _StandIn(types.ModuleType):
    """An empty module standing in for a CUDA extension that was not built."""


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install() -> list[str]:
    """Stand-ins for the missing CUDA extensions when ``mamba_ssm`` is installed; the names
    stood in (empty when the real extensions exist or mamba_ssm is absent). Idempotent."""
    if not _installed("mamba_ssm"):
        return []
    stood_in = []
    for name in EXTENSIONS:
        if isinstance(sys.modules.get(name), _StandIn):
            stood_in.append(name)
        elif name not in sys.modules and not _installed(name):
            sys.modules[name] = _StandIn(name)
            stood_in.append(name)
    return stood_in


def active() -> bool:
    """Whether a CUDA extension of mamba_ssm is a stand-in (its kernels cannot run)."""
    return any(isinstance(sys.modules.get(name), _StandIn) for name in EXTENSIONS)
