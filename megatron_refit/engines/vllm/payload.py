"""The payloads of the ``megatron_refit`` backend, as plain JSON (no vLLM import).

``init_info`` (``init_weight_transfer_engine``, once): the trainer's ``refit:`` config
section as a mapping (the same section its training YAML holds: one source of truth for
both sides), the number of train ranks, and the LoRA rank / alpha when the trainer syncs
adapters. ``update_info`` (``update_weights``, per refit): the refit version and whether it
is a full refit. Plain JSON passes unchanged through ``LLM``, Ray and vLLM's HTTP routes.
The trainer engine builds both; the engine checks them field by field. The body of the
server's engine-step swap (:data:`SWAP_PATH`, :mod:`.server_swap`): the version and ``kv``.
"""

from __future__ import annotations

from typing import Any

from megatron_refit.config import RefitConfig


def init_payload(cfg: RefitConfig, *, num_train: int, lora_rank: int = 0, lora_alpha: float = 0.0) -> dict:
    """The engine's ``init_info``."""
    return {"refit": cfg.to_wire(), "num_train": num_train, "lora_rank": lora_rank, "lora_alpha": lora_alpha}


def update_payload(version: int, *, full: bool, complete: bool = False) -> dict:
    """The engine's ``update_info`` for one refit (``complete``: ``swap: staged``'s second call,
    which waits for the staging and its preparation)."""
    return {"version": version, "full": full, "complete": complete}


SWAP_PATH = "/megatron_refit/swap"
"""The API server's route that swaps a staged version in one step of vLLM's engine core."""
KV_MODES = ("recompute", "keep")
"""What the requests in flight do at that swap: recompute their KV under the new version, or
go on over the KV the old version computed (PipelineRL's in-flight update)."""


def swap_payload(version: str | None, kv: str) -> dict:
    """The body of a ``POST`` to :data:`SWAP_PATH`."""
    return {"kv": kv, **({"weight_version": version} if version is not None else {})}


def parse_swap_payload(body: Any) -> tuple[str | None, str]:
    """``(weight_version, kv)`` of a swap's body; ``ValueError`` naming the bad field."""
    if not isinstance(body, dict):
        raise ValueError(f"{SWAP_PATH} takes a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - {"weight_version", "kv"})
    if unknown:
        raise ValueError(f"{SWAP_PATH}: unknown field(s) {unknown}; it takes weight_version and kv")
    version, kv = body.get("weight_version"), body.get("kv", "recompute")
    if version is not None and not isinstance(version, str):
        raise ValueError(f"{SWAP_PATH}: weight_version must be a string, got {version!r}")
    if kv not in KV_MODES:
        raise ValueError(f"{SWAP_PATH}: kv must be one of {list(KV_MODES)}, got {kv!r}")
    return version, kv
