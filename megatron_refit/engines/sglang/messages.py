"""The control messages a refit's trainer sends an SGLang engine, and its TP workers read.

Each is one named tensor of an ``update_weights_from_tensor`` call (``load_format=LOADER``): the
message is the name, ``PREFIX + op + ":" + JSON``, the tensor empty (it pickles without shared
memory, so it also travels in an HTTP body). The trainer's clients
(:mod:`megatron_refit.engines.sglang.trainer.client`) build them; the custom weight loader in
every TP worker (:mod:`megatron_refit.engines.sglang.worker.loader`) parses them. Imports
neither SGLang nor Megatron.
"""

from __future__ import annotations

import json
from typing import Any

import torch

LOADER = "megatron_refit.engines.sglang.worker.loader.refit_loader"
"""Import path of :func:`~megatron_refit.engines.sglang.worker.loader.refit_loader`: the engine's
``custom_weight_loader`` entry and the ``load_format`` of every ``update_weights_from_tensor``
call that drives a refit."""
PREFIX = "megatron_refit."
"""A control message is one named tensor named ``PREFIX + op + ":" + JSON`` (an empty tensor)."""
OPS = ("connect", "refit", "close")


def parse_message(name: str) -> tuple[str, dict]:
    """``(op, args)`` of a control message's name; ``ValueError`` naming a name that is none."""
    op, sep, args = name.removeprefix(PREFIX).partition(":")
    if not name.startswith(PREFIX) or not sep or op not in OPS:
        raise ValueError(f"{name[:200]!r} is no megatron_refit control message "
                         f"(expected {PREFIX}<op>:<json> with op one of {list(OPS)})")
    parsed = json.loads(args)
    if not isinstance(parsed, dict):
        raise ValueError(f"megatron_refit control message {op!r}: arguments must be a JSON object, got {args[:200]!r}")
    return op, parsed


def control_message(op: str, **args: Any) -> list[tuple[str, torch.Tensor]]:
    """The ``named_tensors`` of one control message: the message is the name, the tensor
    empty (it pickles without shared memory, so it also travels in an HTTP body)."""
    return [(f"{PREFIX}{op}:{json.dumps(args)}", torch.empty(0, dtype=torch.uint8))]


def connect_message(refit: dict, *, num_train: int, replica: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Makes every TP worker of engine ``replica`` join the refit group (``refit``: the
    ``refit:`` section as a mapping)."""
    return control_message("connect", refit=dict(refit), num_train=num_train, replica=replica)


def refit_message(version: int, full: bool = False) -> list[tuple[str, torch.Tensor]]:
    return control_message("refit", version=version, full=full)


def close_message() -> list[tuple[str, torch.Tensor]]:
    return control_message("close")
