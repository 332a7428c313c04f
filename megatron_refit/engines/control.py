"""How train ranks drive an engine's control plane around the refit: one protocol for every engine.

``RefitCallback`` (and any training loop) asks :func:`engine_control` for the control of
``refit.engine`` and makes the same three calls whatever the engine: ``connect`` once, ``refit``
per version, ``close`` at the end. Each wraps the trainer's own call (``join()``,
``fleet.refit(version)``, ``fleet.close()``): an engine with a control plane (SGLang: pause,
update session, resume) runs its client calls on train rank 0 around it; one without
(:class:`NoControl`: vLLM, driven by vLLM's own weight-transfer API, or an engine that runs its
own receive loop) makes the trainer's call alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from megatron_refit.registry import engine_named, engine_names


@runtime_checkable
class EngineControl(Protocol):
    """Train ranks' calls around the refit (every train rank calls each, with its ``rank``)."""

    def connect(self, join: Callable[[], Any], *, rank: int, num_train: int) -> Any:
        """Run ``join()`` (joins the refit group, returns the trainer's refit) while the
        engines join too; returns what ``join()`` returned."""

    def refit(self, fleet, version: int, *, rank: int, full: bool = False) -> Any:
        """``fleet.refit(version, full=full)`` while the engines receive; returns its report."""

    def close(self, fleet, *, rank: int) -> None:
        """``fleet.close()`` while the engines leave the group."""


class NoControl:
    """The trainer's calls alone: the engine needs none from the trainer."""

    def connect(self, join: Callable[[], Any], *, rank: int, num_train: int) -> Any:
        return join()

    def refit(self, fleet, version: int, *, rank: int, full: bool = False) -> Any:
        return fleet.refit(version, full=full)

    def close(self, fleet, *, rank: int) -> None:
        fleet.close()


def engine_control(refit: dict, clients: Sequence = ()) -> EngineControl:
    """The control of engine ``refit["engine"]`` (``refit``: the ``refit:`` section as a
    mapping) over ``clients`` (one control client per engine replica; train rank 0 uses them,
    other ranks may pass none). No clients: :class:`NoControl`. ``ValueError`` where clients
    are given for an engine that takes none."""
    engine = engine_named(refit["engine"])
    if not clients:
        return NoControl()
    if engine.control is None:
        raise ValueError(f"control clients were given for refit.engine {engine.name!r}, which is driven without "
                         f"them (engines with control clients: "
                         f"{[n for n in engine_names() if engine_named(n).control]}); pass none, or set refit.engine")
    module, _, name = engine.control.partition(":")
    control = getattr(importlib.import_module(module), name)(list(clients), refit)
    if not isinstance(control, EngineControl):
        raise TypeError(f"engine {engine.name!r}: {engine.control} is not an EngineControl")
    return control

