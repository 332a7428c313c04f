"""A toy engine, whole in one module: what adding an engine to megatron-refit takes.

1. Storage: an object with ``target_specs()`` / ``buffer(name)`` / ``finalize()``
   (:class:`megatron_refit.endpoint.storage.Storage`); here whole tensors in a dict.
2. Optionally a control (:class:`megatron_refit.fleet.control.EngineControl`): the calls train
   rank 0's fleet makes to the engine's control plane when a replica connects, around each
   replica's part of every refit, and at close; here it logs them.
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
    """Logs each control call of train rank 0's fleet (``clients``: lists to append to, one per
    replica): connect, each replica's start and land of every refit, and close."""

    staged = False  # refit.swap: staged is not for this engine (it notes nothing)
    engine = "toy engine"

    def __init__(self, clients: list, refit):
        self.clients = clients
        self.cfg = refit  # the trainer's RefitConfig

    @property
    def replicas(self) -> list[int]:
        return list(range(len(self.clients)))

    def connect(self, replica: int, *, num_train: int, client=None) -> None:
        if client is not None:
            raise ValueError("the toy engine takes no replica while the trainer runs")
        self.clients[replica].append(f"connect {self.cfg.engine} {num_train}")
        return None  # its engine ranks join by themselves: nothing to wait for

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

    def close(self, *, tell: bool = True, wait_s: float = 0.0) -> list[str]:
        if tell:
            for log in self.clients:
                log.append("close")
        return []  # it runs no thread


register_engine(Engine(name="toy", layout="full", staged_needs=None, writes="writes whole tensors into a dict",
                       control="megatron_refit.testing.toy_engine:ToyControl"))
