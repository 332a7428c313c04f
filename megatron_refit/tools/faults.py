"""Faults injected on purpose (tests, the demo, benchmarks): an engine error while a refit lands."""

from __future__ import annotations


def fail_next_refit(storage, *, at_call: int = 2) -> None:
    """``storage.buffer`` raises an engine error (a ``RuntimeError``) on its ``at_call``-th call
    from now (the next refit's bytes have started landing by then), once; then it is the
    storage's own again."""
    buffer, calls = storage.buffer, [0]

    def failing(name):
        calls[0] += 1
        if calls[0] == at_call:
            storage.buffer = buffer
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return buffer(name)

    storage.buffer = failing


def slow_next_refit(pieces: list, seconds: float) -> None:
    """A train rank's ``pieces`` (``spec`` + ``tensor()``) take ``seconds`` to read at the next
    refit, once (at the first read): a slow train rank, whose sends start late while the
    engine's update is open."""
    import time

    reads = {id(piece): piece.tensor for piece in pieces}

    def restore() -> None:
        for piece in pieces:  # pieces may be frozen dataclasses
            object.__setattr__(piece, "tensor", reads[id(piece)])

    def slow(piece):
        def read(*args, **kwargs):
            restore()
            time.sleep(seconds)
            return reads[id(piece)](*args, **kwargs)

        return read

    for piece in pieces:
        object.__setattr__(piece, "tensor", slow(piece))
