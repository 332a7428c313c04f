"""A toy fleet without Megatron: 2 train ranks holding row halves of a few weights, engine
replicas of ``gen_tp`` ranks holding row blocks, and versions whose weights anyone can rebuild.

Used by the fleet, overlap and shutdown tests and by ``scripts/bench_fleet.py``; run as a module
it is one rank of a fleet in its own process (``python -m megatron_refit.testing.toy_fleet
train|engine RANK PORT``), for the tests that signal, stop or kill a rank as an operator would.
Each such rank prints one JSON line per event (``{"event": ..., "t": seconds since start}``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
import zlib

import torch

from megatron_refit.testing.storages import MemoryStorage, local, row_box, row_specs

NUM_TRAIN = 2
SHAPES = {f"layer{i}.w": (64, 48) for i in range(4)} | {"norm": (48,)}


def weights(version: int) -> dict[str, torch.Tensor]:
    """Version ``version``'s full weights: a random base with a sparse, version-dependent change
    (about 1 % of the elements: what delta refits encode as indices)."""
    out = {}
    for name, shape in SHAPES.items():
        w = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
        w.view(-1)[version % 7::97] += 0.01 * version
        out[name] = w
    return out


def train_pieces(rank: int) -> list:
    """Train rank ``rank``'s pieces (row halves of the 2-D weights, the norm whole), zeroed."""
    from megatron_refit.endpoint.sender import TensorPiece

    return [TensorPiece(spec, torch.zeros(spec.shape)) for spec in row_specs(SHAPES, rank, NUM_TRAIN)]


def set_version(pieces: list, version: int) -> None:
    """Write version ``version``'s weights into ``pieces`` in place (as an optimizer step does)."""
    full = weights(version)
    for piece in pieces:
        piece.data.copy_(local(piece.spec, full[piece.spec.name]))


def storage(tp_rank: int, tp: int, **hooks) -> MemoryStorage:
    """Engine TP rank ``tp_rank`` of ``tp``'s storage (row blocks)."""
    return MemoryStorage(row_specs(SHAPES, tp_rank, tp), **hooks)


def exact(store: MemoryStorage, version: int) -> bool:
    return store.exact(weights(version))


__all__ = ["NUM_TRAIN", "SHAPES", "exact", "row_box", "set_version", "storage", "train_pieces", "weights"]


# -- one rank in its own process ---------------------------------------------------------------

def _say(t0: float, event: str, **fields) -> None:
    print(json.dumps({"event": event, "t": round(time.monotonic() - t0, 3), **fields}), flush=True)


def _config(port: int):
    from megatron_refit.config import RefitConfig

    env = os.environ
    return RefitConfig(enabled=True, engine="vllm", gen_tp=1, gen_dp=int(env.get("TOY_GEN_DP", "2")), port=port,
                       bucket_mb=4096 / (1 << 20), timeout_s=float(env.get("TOY_TIMEOUT_S", "30")),
                       stall_s=float(env.get("TOY_STALL_S", "0")), overlap=env.get("TOY_OVERLAP", "on"),
                       delta="off", on_replica_failure="continue")


def _train(rank: int, port: int, t0: float) -> None:
    """Refit a new version every ``TOY_STEP_S`` until stopped (a signal, an error)."""
    from megatron_refit.refit import trainer_refit_from_pieces
    from megatron_refit.local.faults import slowed

    cfg = _config(port)
    pieces = train_pieces(rank)
    fleet = trainer_refit_from_pieces(cfg, pieces, [], rank=rank, num_train=NUM_TRAIN)
    fleet.await_start()
    for member in fleet.members.values():  # each bucket takes a while: a refit is in flight when stopped
        slowed(member.group, float(os.environ.get("TOY_SEND_DELAY_S", "0.02")))
    _say(t0, "started", members=sorted(fleet.members))
    version = 0
    try:
        while True:
            version += 1
            set_version(pieces, version)
            if cfg.overlap == "on":
                fleet.start_refit(version)
                for report in fleet.finished():
                    _say(t0, "landed", version=report.version, failed=sorted(report.failed_replicas))
            else:
                report = fleet.refit(version)
                _say(t0, "landed", version=report.version, failed=sorted(report.failed_replicas))
            time.sleep(float(os.environ.get("TOY_STEP_S", "0.2")))  # the training step
    except KeyboardInterrupt:
        _say(t0, "interrupted", version=version)
        raise


def _engine(rank: int, port: int, t0: float) -> None:
    """Receive versions until the trainer is gone; then report the last complete one and close."""
    from megatron_refit.engine_side.entry import engine_refit

    gen = rank - NUM_TRAIN
    store = storage(0, 1)
    member = engine_refit(_config(port), store, gen_index=gen, num_train=NUM_TRAIN)
    _say(t0, "started")
    landed = None
    while True:
        try:
            landed = member.receive().version
        except Exception as exc:  # noqa: BLE001 -- the trainer is gone (or a refit failed): reported
            _say(t0, "failed", error=f"{type(exc).__name__}: {exc}"[:600], state=member.state)
            break
    start = time.monotonic()
    member.close()
    _say(t0, "closed", close_s=round(time.monotonic() - start, 3), landed=landed,
         exact=landed is not None and exact(store, landed))


def main(argv: list[str]) -> None:
    role, rank, port = argv[0], int(argv[1]), int(argv[2])
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test dumps a rank that does not end
    # Ctrl-C raises KeyboardInterrupt whatever the caller left: a process started in the background
    # of a non-interactive shell inherits SIGINT ignored, and Python then leaves it ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    torch.set_num_threads(1)
    t0 = time.monotonic()
    (_train if role == "train" else _engine)(rank, port, t0)


if __name__ == "__main__":
    main(sys.argv[1:])
