"""How train ranks drive an engine's control plane around the refit: one protocol for every engine.

``RefitCallback``, the vLLM trainer engine and any training loop ask :func:`engine_control` for
the control of ``refit.engine`` and make the same two calls whatever the engine: ``connect``
once (it wraps ``join(hooks)``, which builds the fleet) and ``close`` at the end (it wraps
``fleet.close()``). Every refit is the fleet's own call, ``fleet.refit(version)``: an engine with a
control plane (vLLM's weight-transfer API, SGLang's update sessions:
:class:`~megatron_refit.fleet.lanes.ReplicaLanes`) gave the fleet its hooks at connect, and
train rank 0 runs its client calls around each replica's part in the fleet's lanes; one without
(:class:`NoControl`: an engine that runs its own receive loop, the HF engine) gives none.

What ``join(hooks)`` returns is the fleet (:class:`~megatron_refit.fleet.trainer_fleet.TrainerFleet`),
built with the control as its ``hooks`` on train rank 0 (the fleet calls them around each
replica's part of a refit); the control runs its calls on the fleet's runner and aborts a replica
whose engine will not join (``fleet.abort_join``): it imports nothing of the fleet's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from megatron_refit.config import RefitConfig, typed_section
from megatron_refit.registry import engine_named, engine_names


@runtime_checkable
class EngineControl(Protocol):
    """Train ranks' calls around the refit (every train rank calls each, with its ``rank``)."""

    def connect(self, join: Callable[[Any], Any], *, rank: int, num_train: int) -> Any:
        """``join(hooks)`` (the train ranks' fleet, built with ``hooks``: on train rank 0 the calls
        this control runs around each replica's part of a refit, else None) while the engines join
        too; returns the fleet once its starting replicas joined (or failed to, each named; it
        raises if none joined)."""

    def close(self, fleet, *, rank: int) -> None:
        """``fleet.close()`` while the engines leave the group."""


class NoControl:
    """The trainer's calls alone: the engine needs none from the trainer."""

    def connect(self, join: Callable[[Any], Any], *, rank: int, num_train: int) -> Any:
        fleet = join(None)
        fleet.await_start()
        return fleet

    def close(self, fleet, *, rank: int) -> None:
        fleet.close()


def engine_control(refit: RefitConfig, clients: Sequence = ()) -> EngineControl:
    """The control of engine ``refit.engine`` (``refit``: the ``refit:`` section) over ``clients``
    (one control client per engine replica; train rank 0 uses them, other ranks may pass none). No
    clients: :class:`NoControl`. ``ValueError`` where clients are given for an engine that takes none."""
    refit = typed_section(refit, "engine_control")
    engine = engine_named(refit.engine)
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
