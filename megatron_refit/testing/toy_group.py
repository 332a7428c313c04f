"""One refit group without a fleet, for the endpoint tests: 2 train ranks holding row halves of
a few weights (whole norms), 2 generation ranks holding every tensor whole, and faults to arm on
either side (a crash or a stall when a piece is read or a buffer written)."""

from __future__ import annotations

import os
import time
import zlib

import torch

from megatron_refit.endpoint.sender import TensorPiece
from megatron_refit.plan.spec import ShardSpec, box_along, full_box
from megatron_refit.testing.storages import MemoryStorage, whole_specs

NUM_TRAIN, NUM_GEN = 2, 2
NAMES = {f"layer{i}.w": (64, 32) for i in range(8)} | {"norm": (32,)}


def full(name: str) -> torch.Tensor:
    """Parameter ``name``'s full tensor (the same in every process)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(NAMES[name], generator=g)


class FaultyPiece(TensorPiece):
    """A piece that runs ``on_read`` (a crash or a stall) when the sender reads it."""

    def __init__(self, spec, tensor, on_read=None):
        super().__init__(spec, tensor)
        self._on_read = on_read

    def tensor(self):
        if self._on_read:
            self._on_read()
        return self.data


def train_pieces(rank: int, on_read=None, names=NAMES) -> list[FaultyPiece]:
    """Train rank ``rank``'s pieces: row halves of the 2-D weights, the 1-D ones whole."""
    pieces = []
    for name in names:
        shape = NAMES[name]
        if len(shape) == 1:
            spec = ShardSpec(name=name, global_shape=shape, dtype="float32", box=full_box(shape))
            pieces.append(FaultyPiece(spec, full(name), on_read))
        else:
            half = shape[0] // 2
            spec = ShardSpec(name=name, global_shape=shape, dtype="float32",
                             box=box_along(shape, 0, rank * half, (rank + 1) * half))
            pieces.append(FaultyPiece(spec, full(name)[rank * half:(rank + 1) * half], on_read))
    return pieces


def gen_storage(names=NAMES) -> MemoryStorage:
    """A generation rank's storage: every tensor whole."""
    return MemoryStorage(whole_specs({n: (NAMES[n], "float32") for n in names}))


def exact(storage: MemoryStorage, names=NAMES) -> bool:
    return all(torch.equal(storage.t[n], full(n)) for n in names)


def die_after(n: int):
    """A hook that kills this process (no cleanup: its sockets just close) at its ``n+1``-th call."""
    count = [0]

    def hook(*_):
        count[0] += 1
        if count[0] > n:
            os._exit(17)

    return hook


def stall_after(n: int, seconds: float):
    """A hook that sleeps ``seconds`` at its ``n+1``-th call: alive but silent, no error reaches the peers."""
    count = [0]

    def hook(*_):
        count[0] += 1
        if count[0] == n + 1:
            time.sleep(seconds)

    return hook
