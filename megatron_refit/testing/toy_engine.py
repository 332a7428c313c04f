"""A toy engine, whole in one module: what adding an engine to megatron-refit takes.

1. Storage: an object with ``target_specs()`` / ``buffer(name)`` / ``finalize()``
   (:class:`megatron_refit.endpoint.storage.Storage`); here whole tensors in a dict.
2. Optionally a control (:class:`megatron_refit.engines.control.EngineControl`): train rank 0's
   calls to the engine's control plane at connect and close, and around each replica's part of
   every refit (the fleet's hooks, :class:`megatron_refit.fleet.replica.ReplicaHooks`); here it
   logs them.
3. One registration line: ``register_engine(Engine(name=...))``. From then on
   ``refit: {engine: toy}`` is a valid config and ``engine_control`` finds the control.
"""

from __future__ import annotations

import torch

from megatron_refit.fleet.serving import ServingUnavailableError
from megatron_refit.registry import Engine, register_engine
from megatron_refit.plan.spec import ShardSpec, full_box


class ToyStorage:
    """Whole tensors by HF name (gen TP 1)."""

    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], str]]):
        self.tensors = {n: torch.zeros(shape, dtype=getattr(torch, dtype)) for n, (shape, dtype) in shapes.items()}
        self.finalized = 0

    def target_specs(self) -> list[ShardSpec]:
        return [ShardSpec(name=n, global_shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                          box=full_box(tuple(t.shape))) for n, t in self.tensors.items()]

    def buffer(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def finalize(self) -> None:
        self.finalized += 1


class ToyControl:
    """Logs each control call of train rank 0 (``clients``: lists to append to, one per replica):
    connect and close, and, as the fleet's hooks, each replica's start and land of every refit."""

    staged = False  # refit.swap: staged is not for this engine (it notes nothing)

    def __init__(self, clients: list, refit):
        self.clients = clients
        self.cfg = refit  # the trainer's RefitConfig

    def _log(self, rank: int, call: str) -> None:
        if rank == 0:
            for log in self.clients:
                log.append(call)

    def connect(self, join, *, rank: int, num_train: int):
        self._log(rank, f"connect {self.cfg.engine} {num_train}")
        fleet = join(self if rank == 0 else None)  # train rank 0's fleet calls the hooks below
        fleet.await_start()
        return fleet

    def start(self, replica: int, version: int, full: bool) -> None:
        self.clients[replica].append(f"start {version}")  # before its bytes move

    def land(self, replica: int, version: int, *, gate: bool = False) -> None:
        self.clients[replica].append(f"land {version}")  # its group carried the version

    def release(self, replica: int, *, passed: bool) -> None:
        pass  # it keeps no traffic off a version under its serving check

    def score(self, replica: int, sequences) -> list[list[float]]:
        raise ServingUnavailableError("the toy engine serves nothing to score")

    def hold(self, replica: int) -> None:
        pass  # it cannot stop serving

    def forget(self, replica: int) -> None:
        pass

    def close(self, fleet, *, rank: int) -> None:
        self._log(rank, "close")
        fleet.close()


register_engine(Engine(name="toy", layout="full", staged_needs=None, writes="writes whole tensors into a dict",
                       control="megatron_refit.testing.toy_engine:ToyControl"))
