"""The in-memory engine storage of the tests and benchmarks: one class, whatever they need of it.

:class:`MemoryStorage` holds one tensor per :class:`~megatron_refit.plan.spec.ShardSpec` (its
local box), plays the :class:`~megatron_refit.endpoint.storage.Storage` protocol, and counts
what the refit does to it; a test injects a fault through ``on_buffer`` (called with the name,
and the call's number in this refit, before each write: raise, stall, die) or ``on_finalize``.
The spec builders say which box each rank holds: the whole tensor, or a row block of a 2-D one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_refit.plan.spec import ShardSpec, full_box


def whole_specs(shapes: dict[str, tuple[tuple[int, ...], str]]) -> list[ShardSpec]:
    """Every tensor whole: ``shapes[name] = (shape, dtype)``."""
    return [ShardSpec(name=n, global_shape=tuple(s), dtype=d, box=full_box(tuple(s))) for n, (s, d) in shapes.items()]


def row_box(shape: tuple[int, ...], rank: int, parts: int) -> tuple:
    """Rank ``rank`` of ``parts``'s row block of a 2-D tensor (1-D ones, or one part: whole)."""
    if len(shape) == 1 or parts == 1:
        return tuple((0, n) for n in shape)
    rows = shape[0] // parts
    return ((rank * rows, (rank + 1) * rows), *((0, n) for n in shape[1:]))


def row_specs(shapes: dict[str, tuple[int, ...]], rank: int, parts: int, dtype: str = "float32") -> list[ShardSpec]:
    """Rank ``rank`` of ``parts``'s row blocks of ``shapes`` (the layout a TP engine holds)."""
    return [ShardSpec(name=n, global_shape=tuple(s), dtype=dtype, box=row_box(tuple(s), rank, parts))
            for n, s in shapes.items()]


def local(spec: ShardSpec, full: torch.Tensor) -> torch.Tensor:
    """``spec``'s box of the full tensor ``full``."""
    return full[tuple(slice(a, b) for a, b in spec.box)]


class MemoryStorage:
    """An engine rank's weights in memory, by spec (see the module docstring)."""

    holds_sent_bytes = True
    """What the last refit wrote stays as it is (no engine repacking): deltas apply to it."""

    def __init__(self, specs: list[ShardSpec], *, on_buffer: Callable[[str, int], None] | None = None,
                 on_finalize: Callable[[], None] | None = None):
        self.specs = list(specs)
        self.t = {s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in self.specs}
        self.on_buffer, self.on_finalize = on_buffer, on_finalize
        self.calls = 0
        """``buffer`` calls so far (a test resets it to count one refit's)."""
        self.finalized = 0
        self.state = None
        """The last state the receiver set (``set_state``): ``ready``, ``updating``, ``stale``."""

    def target_specs(self) -> list[ShardSpec]:
        return self.specs

    def buffer(self, name: str) -> torch.Tensor:
        self.calls += 1
        if self.on_buffer is not None:
            self.on_buffer(name, self.calls)
        return self.t[name]

    def finalize(self) -> None:
        if self.on_finalize is not None:
            self.on_finalize()
        self.finalized += 1

    def set_state(self, state: str, version) -> None:
        self.state = state

    def exact(self, full: dict[str, torch.Tensor]) -> bool:
        """Whether every tensor equals its box of ``full`` (the version's full tensors), bit for bit."""
        return all(torch.equal(self.t[s.name], local(s, full[s.name])) for s in self.specs)
