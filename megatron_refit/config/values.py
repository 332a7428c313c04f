"""The ``refit:`` section's values checked (pure): the allowed values of its named modes, each
field's type, and every value's range and combination (:func:`check_values`, run when a
:class:`~megatron_refit.config.section.RefitConfig` is built); ``ValueError`` names the first bad one."""

from __future__ import annotations

import math
import typing
from typing import Any

from megatron_refit.config.deployment import check_deployment
from megatron_refit.plan.probe import check_probe_spec
from megatron_refit.registry import engine_named

MODES = ("disaggregated", "colocated")
LORA_SYNC = ("auto", "adapters", "merged", "full")
VERIFY = ("off", "sampled", "full")
ENGINE_LOAD = ("auto", "in_place", "load_weights")
DELTA = ("off", "on", "auto")
SWAP = ("in_place", "staged")
ON_REPLICA_FAILURE = ("raise", "continue")
OVERLAP = ("off", "on")
OVERLAP_BUSY = ("wait", "skip")
FANOUT = ("off", "chain", "tree", "auto")
VERIFY_SERVING = ("auto", "on", "off")


def check_values(cfg) -> None:
    """``ValueError`` naming the first bad value of ``cfg`` (a ``RefitConfig``)."""
    for name in ("bucket_mb", "direct_mb", "timeout_s", "stall_s", "swap_budget_mb", "serving_tolerance"):
        value = getattr(cfg, name)
        if value is not None and not math.isfinite(value):
            raise ValueError(f"refit.{name} must be a finite number, got {value!r}")
    one_byte = 1 / (1 << 20)
    for name, low, high in (("bucket_mb", one_byte, float(1 << 20)), ("direct_mb", one_byte, float(1 << 20)),
                            ("timeout_s", 0.001, 7 * 24 * 3600.0)):
        value = getattr(cfg, name)
        if value is not None and value > 0 and not low <= value <= high:
            raise ValueError(f"refit.{name} must be between {low:g} and {high:g}, got {value!r}")
    engine = engine_named(cfg.engine)
    if not cfg.transport:
        raise ValueError("refit.transport must be 'auto' or a registered transport's name, got ''")
    for name, allowed in (("mode", MODES), ("lora_sync", LORA_SYNC),
                          ("engine_load", ENGINE_LOAD), ("verify", VERIFY), ("delta", DELTA),
                          ("swap", SWAP), ("on_replica_failure", ON_REPLICA_FAILURE),
                          ("overlap", OVERLAP), ("overlap_busy", OVERLAP_BUSY), ("fanout", FANOUT)):
        value = getattr(cfg, name)
        if value not in allowed:
            raise ValueError(f"refit.{name}: {value!r} is not one of {list(allowed)}")
    for name in ("gen_tp", "gen_dp", "gen_attention_dp", "port", "bucket_mb", "direct_mb", "every_n_steps",
                 "timeout_s", "train_dp"):
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ValueError(f"refit.{name} must be positive, got {value!r}")
    if isinstance(cfg.verify_serving, str) and cfg.verify_serving not in VERIFY_SERVING:
        raise ValueError(f"refit.verify_serving: {cfg.verify_serving!r} is not one of {list(VERIFY_SERVING)} "
                         "or a positive int (every N-th refit)")
    if isinstance(cfg.verify_serving, int) and cfg.verify_serving < 1:
        raise ValueError(f"refit.verify_serving must be 'auto', 'on', 'off' or a positive int, got "
                         f"{cfg.verify_serving!r}")
    check_probe_spec(cfg.serving_probe)
    if cfg.fanout != "off" and cfg.mode == "colocated":
        raise ValueError(f"refit.fanout: {cfg.fanout!r} needs mode: disaggregated (colocated engines share the "
                         "train ranks' GPUs: there is no replica link to relay over); set fanout: off")
    if cfg.stall_s < 0:
        raise ValueError(f"refit.stall_s must be 0 (off) or positive, got {cfg.stall_s!r}")
    if cfg.serving_tolerance is not None and cfg.serving_tolerance <= 0:
        raise ValueError(f"refit.serving_tolerance must be positive or null, got {cfg.serving_tolerance!r}")
    if cfg.swap_budget_mb is not None and cfg.swap_budget_mb < 0:
        raise ValueError(f"refit.swap_budget_mb must be >= 0 or null, got {cfg.swap_budget_mb!r}")
    if cfg.port > 65535:
        raise ValueError(f"refit.port must be at most 65535, got {cfg.port}")
    engine.check(gen_tp=cfg.gen_tp, engine_load=cfg.engine_load, swap=cfg.swap)
    check_deployment(cfg)


def check_type(key: str, value: Any, hint: Any) -> None:
    allowed = typing.get_args(hint) or (hint,)
    allowed = tuple(type(None) if a is None else a for a in allowed)
    ok = False
    for kind in allowed:
        if kind is float:
            ok = ok or (isinstance(value, (int, float)) and not isinstance(value, bool))
        elif kind is int:
            ok = ok or (isinstance(value, int) and not isinstance(value, bool))
        else:
            ok = ok or isinstance(value, kind)
    if not ok:
        names = " or ".join(a.__name__ if a is not type(None) else "null" for a in allowed)
        raise ValueError(f"refit.{key}: expected {names}, got {value!r} ({type(value).__name__})")


def check_int(name: str, value: Any, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
