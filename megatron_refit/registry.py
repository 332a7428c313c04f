"""The engines a refit can land in, by name: ``refit.engine`` names one of them.

An :class:`Engine` declares what the ``refit:`` section may ask of that engine (how it shards
a tensor, which ``engine_load`` and ``swap`` modes it offers) and, where train rank 0 drives
the engine's control plane around every refit, the class that does it (an
:class:`~megatron_refit.engines.control.EngineControl`, named by import path so that nothing is
imported before it is used). Everything else of an engine (its storage, post-load step,
control client and entry point) lives in its own folder, ``megatron_refit/engines/<name>/``.

Adding an engine: one module that implements the storage protocol
(:class:`~megatron_refit.endpoint.storage.Storage`) and calls
``register_engine(Engine(name=...))`` once on import (``megatron_refit/testing/toy_engine.py`` does exactly
that). This module imports nothing, so :mod:`megatron_refit.config` checks names against it.
"""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("vllm", "full")


@dataclass(frozen=True, kw_only=True, slots=True)
class Engine:
    """What the ``refit:`` section may ask of one engine (checked when a config is built)."""

    name: str
    """``refit.engine``."""
    layout: str = "vllm"
    """How an engine rank holds a tensor: ``vllm`` (vLLM's parallel layers: fused
    ``qkv_proj`` / ``gate_up_proj``, FusedMoE ``w13`` / ``w2``, vocabulary padded to 64, as
    SGLang's too) or ``full`` (whole HF tensors: gen TP 1)."""
    engine_loads: tuple[str, ...] = ("in_place", "load_weights")
    """The ``refit.engine_load`` modes it offers."""
    swaps: tuple[str, ...] = ("in_place", "staged")
    """The ``refit.swap`` modes it offers."""
    staged_needs: str | None = "load_weights"
    """The ``engine_load`` a staged swap needs (the engine loads its staging buffers under a
    pause); ``None``: any."""
    writes: str = ""
    """How it writes what it receives, said in the errors that refuse a mode."""
    scores: str = "in_band"
    """How a replica scores the serving probe (``refit.verify_serving``): ``client`` (train rank 0
    asks its control client, through the engine's serving path: vLLM, SGLang) or ``in_band`` (its
    engine ranks' storage scores it with the engine's forward and answers over the refit group:
    the HF engine; a storage without ``score`` cannot be checked)."""
    wide_ep: tuple[str, ...] = ()
    """The keys of a wide expert-parallel deployment it receives into (of
    ``config.deployment.WIDE_EP_KEYS``: ``gen_attention_dp``, ``gen_redundant_experts``,
    ``gen_expert_placement``, ``gen_eplb``); a config that sets another is refused by name where
    a refit starts (:func:`~megatron_refit.config.deployment.refuse_wide_ep`)."""
    control: str | None = None
    """``"module:Class"`` of the :class:`~megatron_refit.engines.control.EngineControl` that
    ``RefitCallback(engines=[client, ...])`` drives this engine's clients with, built as
    ``Class(clients, refit)`` (``refit``: the trainer's ``RefitConfig``, parsed once); ``None``:
    the engine needs no control calls from the trainer (it is driven by its own API, or by its
    own loop)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"engine name must be an identifier, got {self.name!r}")
        if self.scores not in ("client", "in_band"):
            raise ValueError(f"engine {self.name!r}: scores must be 'client' or 'in_band', got {self.scores!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"engine {self.name!r}: layout must be one of {list(LAYOUTS)}, got {self.layout!r}")

    def check(self, *, gen_tp: int, engine_load: str, swap: str) -> None:
        """``ValueError`` naming the first ``refit:`` value this engine does not offer."""
        if self.layout == "full" and gen_tp != 1:
            raise ValueError(f"refit.engine {self.name!r} holds whole tensors and needs gen_tp 1, got {gen_tp}")
        if engine_load != "auto" and engine_load not in self.engine_loads:
            raise ValueError(f"refit.engine {self.name!r} {self.writes}; engine_load must be "
                             f"{_one_of(self.engine_loads)}, got {engine_load!r}")
        if swap not in self.swaps:
            raise ValueError(f"refit.swap {swap!r} is not offered for engine {self.name!r} ({self.writes}); "
                             f"use swap: {_one_of(self.swaps)}")
        if swap == "staged" and self.staged_needs is not None and engine_load not in ("auto", self.staged_needs):
            raise ValueError(f"refit.swap 'staged' with engine {self.name!r} needs engine_load {self.staged_needs!r} "
                             f"(the engine loads its staging buffers under a pause), got {engine_load!r}")


def resolved_load(engine: Engine, engine_load: str, swap: str) -> str | None:
    """What ``engine_load`` means for ``engine`` before its live parameters are seen: the mode
    itself, or for ``auto`` the mode a staged swap needs, the engine's only mode, or ``None``
    (the engine decides from its parameters)."""
    if engine_load != "auto":
        return engine_load
    if swap == "staged" and engine.staged_needs is not None:
        return engine.staged_needs
    return engine.engine_loads[0] if len(engine.engine_loads) == 1 else None


def _one_of(values: tuple[str, ...]) -> str:
    return repr(values[0]) if len(values) == 1 else f"one of {list(values)}"


_ENGINES: dict[str, Engine] = {}


def register_engine(engine: Engine) -> None:
    """Make ``engine`` selectable as ``refit.engine: <name>``; a taken name is refused."""
    if not isinstance(engine, Engine):
        raise TypeError(f"register_engine takes an Engine, got {type(engine).__name__}")
    if engine.name in _ENGINES:
        raise ValueError(f"engine {engine.name!r} is already registered")
    _ENGINES[engine.name] = engine


def engine_named(name: str) -> Engine:
    """The registered engine ``name``; ``ValueError`` naming the registered ones."""
    engine = _ENGINES.get(name)
    if engine is None:
        raise ValueError(f"refit.engine: {name!r} is not one of {engine_names()}")
    return engine


def engine_names() -> list[str]:
    return list(_ENGINES)


register_engine(Engine(name="vllm", scores="client", writes="writes through vLLM's weight-transfer backend",
                       wide_ep=("gen_attention_dp", "gen_redundant_experts", "gen_eplb", "gen_expert_placement"),
                       control="megatron_refit.engines.vllm.trainer.control:VllmControl"))
register_engine(Engine(name="sglang", scores="client", engine_loads=("in_place",), swaps=("in_place",),
                       wide_ep=("gen_attention_dp", "gen_redundant_experts", "gen_eplb"),
                       writes="writes in place into SGLang's parameters (its weight loader hook, under SGLang's pause)",
                       control="megatron_refit.engines.sglang.trainer.control:SglangControl"))
register_engine(Engine(name="hf", layout="full", staged_needs=None, writes="writes into a transformers model"))
