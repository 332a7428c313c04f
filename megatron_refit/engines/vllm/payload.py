"""The payloads of the ``megatron_refit`` backend, as plain JSON (no vLLM import).

``init_info`` (``init_weight_transfer_engine``, once): the trainer's ``refit:`` config
section as a mapping (the same section its training YAML holds: one source of truth for
both sides), the number of train ranks, and the LoRA rank / alpha when the trainer syncs
adapters. ``update_info`` (``update_weights``, per refit): the refit version and whether it
is a full refit. Plain JSON passes unchanged through ``LLM``, Ray and vLLM's HTTP routes.
The trainer engine builds both; the engine checks them field by field.
"""

from __future__ import annotations

from dataclasses import asdict

from megatron_refit.config import RefitConfig


def init_payload(cfg: RefitConfig, *, num_train: int, lora_rank: int = 0, lora_alpha: float = 0.0) -> dict:
    """The engine's ``init_info``."""
    return {"refit": asdict(cfg), "num_train": num_train, "lora_rank": lora_rank, "lora_alpha": lora_alpha}


def update_payload(version: int, *, full: bool, complete: bool = False) -> dict:
    """The engine's ``update_info`` for one refit (``complete``: ``swap: staged``'s second call,
    which waits for the staging and its preparation)."""
    return {"version": version, "full": full, "complete": complete}
