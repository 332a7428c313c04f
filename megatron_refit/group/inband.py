"""The serving probe in band (``refit.verify_serving`` with an engine that has no control plane
of its own, e.g. the HF engine): both sides of a replica's refit group, one collective each, after
a refit it applied: the engine's answer (:func:`exchange_in_band`), then train rank 0's verdict
(:func:`verdict_in_band`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_refit.plan.probe import Probe


def exchange_in_band(group, num_train: int, *, probe: Probe | None = None,
                     score: Callable[[tuple], Any] | None = None, stale: Callable[[], list[str]] | None = None) -> Any:
    """A replica group scores the probe in band, after a refit it applied (collective over the
    group: every train rank passes nothing, train rank 0 the ``probe``; every engine rank its
    ``score``, or None where its storage cannot score, and its ``stale``: the parameters it no
    longer holds as they arrived, ``Receiver.stale_live``). Returns, on every rank, what the
    engine's first rank answered: its log-probs, ``{"unable": why}`` or ``{"error": why}``; where
    an engine rank holds a stale parameter, ``{"served": that answer, "stale": [names]}``."""
    sent = group.all_gather_object(list(map(list, probe.sequences)) if probe is not None else None, "probe")
    sequences = tuple(tuple(s) for s in sent[0])
    answer = None
    if group.rank >= num_train:
        if score is None:
            answer = {"unable": "its storage has no score method"}
        else:
            try:
                answer = score(sequences)
            except Exception as exc:  # noqa: BLE001 -- the train ranks learn why this replica could not score
                answer = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        try:
            answer = (answer, stale() if stale is not None else [])
        except Exception as exc:  # noqa: BLE001 -- reading its weights back failed: it cannot vouch for them
            answer = ({"error": f"reading its weights back: {type(exc).__name__}: {exc}"[:500]}, [])
    rows = group.all_gather_object(answer, "served")
    names = sorted({name for row in rows[num_train:] for name in row[1]})
    return {"served": rows[num_train][0], "stale": names} if names else rows[num_train][0]


def verdict_in_band(group, num_train: int, *, failed: str | None = None) -> str | None:
    """After :func:`exchange_in_band`, train rank 0 tells the replica's engine ranks its verdict
    (collective over the group: ``failed``, why it does not serve the trainer's model, from train
    rank 0; None elsewhere or where it passed): an engine rank told it holds its weights
    (:meth:`~megatron_refit.endpoint.storage.WeightsState.hold`). Returns it on every rank."""
    return group.all_gather_object(failed if group.rank == 0 else None, "verdict")[0]
