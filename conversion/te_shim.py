"""Import megatron.bridge on a machine without Transformer Engine.

megatron-bridge 0.6.2 imports ``transformer_engine.pytorch`` unconditionally in exactly one
module, ``megatron/bridge/peft/lora_layers.py`` (every other module guards it and sets
``HAVE_TE = False``). When TE is absent, :func:`import_bridge` serves an inert stand-in
module to *that importer only*, and removes the stand-in from ``sys.modules`` once
``megatron.bridge`` is imported, so every other ``try: import transformer_engine`` still
fails and TE-only code paths stay off. With TE installed, nothing is patched.

The stand-in's attributes are fresh placeholder classes: ``isinstance(x, te.Linear)`` is
False for every real module, and instantiating any of them raises.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

_IMPORTER = "megatron.bridge.peft.lora_layers"
_TE_NAMES = ("transformer_engine", "transformer_engine.pytorch")


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


class _Inert(types.ModuleType):
    """Module whose every attribute is a placeholder class (or a nested inert module)."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "ops":
            value = _Inert(f"{self.__name__}.ops")
        else:
            value = type(attr, (), {"__init__": _refuse, "__module__": self.__name__})
        setattr(self, attr, value)
        return value


def _refuse(self, *args, **kwargs):
    raise RuntimeError(
        f"{type(self).__name__} is a placeholder: Transformer Engine is not installed "
        "(megatron_refit's TE shim serves it only so megatron.bridge can be imported)"
    )


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TE_NAMES:
            # Any other import after the importer's own `import transformer_engine...`
            # line: drop the stand-in so that nothing else sees it.
            _drop_stand_in()
            return None
        if _direct_importer() != _IMPORTER:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        return _Inert(spec.name)

    def exec_module(self, module):
        module.__path__ = []


_IMPORT_MACHINERY = {"importlib._bootstrap", "importlib._bootstrap_external", __name__}


def _direct_importer() -> str | None:
    """Name of the module whose code runs the import statement being resolved."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if name not in _IMPORT_MACHINERY:
            return name
        frame = frame.f_back
    return None


def _drop_stand_in() -> None:
    for name in _TE_NAMES:
        if isinstance(sys.modules.get(name), _Inert):
            del sys.modules[name]


def import_bridge() -> types.ModuleType:
    """Import and return ``megatron.bridge``, with the TE stand-in only when TE is absent (and
    mamba_ssm's stand-in CUDA extensions when they were not built: :mod:`conversion.mamba_shim`)."""
    from conversion import mamba_shim

    mamba_shim.install()  # before Megatron's mamba_mixer is imported (megatron.bridge imports it)
    if "megatron.bridge" in sys.modules or te_available():
        return importlib.import_module("megatron.bridge")
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module("megatron.bridge")
    finally:
        sys.meta_path.remove(finder)
        _drop_stand_in()
