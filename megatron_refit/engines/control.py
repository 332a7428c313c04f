"""The control of an engine's control plane, by name: :func:`engine_control`.

``RefitCallback``, the vLLM trainer engine and any training loop ask :func:`engine_control` for
the control of ``refit.engine`` over the engines' clients and hand it to the fleet they build
(``trainer_refit(..., control=control)``). From then on the fleet is its one caller, whatever the
engine: on train rank 0 it connects each replica (and any that joins later, ``fleet.add``), runs
its calls around each replica's part of every refit, and closes it (``fleet.close()``). An engine
with a control plane (vLLM's weight-transfer API, SGLang's update sessions) has a
:class:`~megatron_refit.fleet.lanes.ReplicaLanes` subclass; one without (an engine that runs its own
receive loop, the HF engine) has none, and :func:`engine_control` returns None for it, as it does
on the train ranks that hold no clients. The protocol is the fleet's:
:class:`~megatron_refit.fleet.control.EngineControl`.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from megatron_refit.config import RefitConfig, typed_section
from megatron_refit.fleet.control import EngineControl
from megatron_refit.registry import engine_named, engine_names

__all__ = ["EngineControl", "engine_control"]


def engine_control(refit: RefitConfig, clients: Sequence = ()) -> EngineControl | None:
    """The control of engine ``refit.engine`` (``refit``: the ``refit:`` section) over ``clients``
    (one control client per engine replica; train rank 0 uses them, other ranks may pass none).
    None without clients. ``ValueError`` where clients are given for an engine that takes none."""
    refit = typed_section(refit, "engine_control")
    engine = engine_named(refit.engine)
    if not clients:
        return None
    if engine.control is None:
        raise ValueError(f"control clients were given for refit.engine {engine.name!r}, which is driven without "
                         f"them (engines with control clients: "
                         f"{[n for n in engine_names() if engine_named(n).control]}); pass none, or set refit.engine")
    module, _, name = engine.control.partition(":")
    control = getattr(importlib.import_module(module), name)(list(clients), refit)
    if not isinstance(control, EngineControl):
        raise TypeError(f"engine {engine.name!r}: {engine.control} is not an EngineControl")
    return control
