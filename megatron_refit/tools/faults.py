"""Faults injected on purpose (tests, the demo, benchmarks): an engine error while a refit lands."""

from __future__ import annotations

ENGINE_ERROR = "CUDA error: an illegal memory access was encountered (injected)"


def fail_next_refit(storage, message: str = ENGINE_ERROR, *, at_call: int = 2) -> None:
    """``storage.buffer`` raises ``RuntimeError(message)`` on its ``at_call``-th call from now
    (the next refit's bytes have started landing by then), once; then it is the storage's own."""
    buffer, calls = storage.buffer, [0]

    def failing(name):
        calls[0] += 1
        if calls[0] == at_call:
            storage.buffer = buffer
            raise RuntimeError(message)
        return buffer(name)

    storage.buffer = failing
