"""Metadata between refit ranks as plain data: JSON, never pickles.

What ranks exchange at ``prepare()`` (shard specs, plan fingerprints) and in colocated mode
(shared-buffer handles) is encoded here. JSON has lists, strings, numbers, booleans and
null; the few other forms travel as one-key objects with a tag, and decoding builds only
these (a peer's bytes never choose a class or a function):

====  ==============================  =========================================
tag   Python                          JSON
====  ==============================  =========================================
t     tuple                           ``{"t": [items]}``
d     dict (any plain keys)           ``{"d": [[key, value], ...]}``
b     bytes                           ``{"b": "<base64>"}``
s     :class:`~megatron_refit.plan.spec.ShardSpec`  ``{"s": [name, shape, dtype, box, pp_stage, is_expert]}``
x     CPU tensor                      ``{"x": [dtype, shape, "<base64>"]}``
====  ==============================  =========================================

A ShardSpec from a peer is built through its validating constructor. This module imports
torch only to encode or decode a tensor (the dry run decodes pieces as a rank does, without it).
"""

from __future__ import annotations

import base64
import json
import sys

from megatron_refit.errors import WireError
from megatron_refit.plan.spec import ShardSpec


def dumps(obj) -> bytes:
    return json.dumps(_plain(obj), separators=(",", ":"), allow_nan=True).encode()


def loads(data: bytes):
    try:
        return json.loads(data.decode(), object_hook=_decode)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WireError(f"refit metadata from a peer is not JSON: {exc}") from exc


def _plain(obj):
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_plain(x) for x in obj]
    if isinstance(obj, ShardSpec):
        return {"s": [obj.name, list(obj.global_shape), obj.dtype, [list(b) for b in obj.box], obj.pp_stage,
                      obj.is_expert]}
    if isinstance(obj, tuple):  # torch.Size too
        return {"t": [_plain(x) for x in obj]}
    if isinstance(obj, dict):
        return {"d": [[_plain(k), _plain(v)] for k, v in obj.items()]}
    if isinstance(obj, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(obj)).decode()}
    torch = sys.modules.get("torch")  # a tensor means torch is imported
    if torch is not None and isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"x": [str(t.dtype).removeprefix("torch."), list(t.shape), base64.b64encode(raw).decode()]}
    raise TypeError(f"{type(obj).__name__} cannot travel as refit metadata (plain data only)")


def _decode(obj: dict):
    if len(obj) != 1:
        raise WireError(f"unexpected object in refit metadata from a peer: keys {sorted(obj)[:5]}")
    (tag, value), = obj.items()
    try:
        if tag == "t":
            return tuple(value)
        if tag == "d":
            return {_hashable(k): v for k, v in value}
        if tag == "b":
            return base64.b64decode(value, validate=True)
        if tag == "s":
            name, shape, dtype, box, pp_stage, is_expert = value
            return ShardSpec(name=name, global_shape=tuple(shape), dtype=dtype,
                             box=tuple((a, b) for a, b in box), pp_stage=pp_stage, is_expert=is_expert)
        if tag == "x":
            import torch

            dtype, shape, raw = value
            dt = getattr(torch, dtype, None)
            if not isinstance(dt, torch.dtype):
                raise WireError(f"unknown dtype {dtype!r} in refit metadata from a peer")
            data = bytearray(base64.b64decode(raw, validate=True))
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return flat.view(dt).reshape(shape)
    except WireError:
        raise
    except (TypeError, ValueError, RuntimeError) as exc:
        raise WireError(f"malformed {tag!r} object in refit metadata from a peer: {exc}") from exc
    raise WireError(f"unknown tag {tag!r} in refit metadata from a peer")


def _hashable(key):
    if isinstance(key, list):
        raise WireError("a list as a dict key in refit metadata from a peer")
    return key
