"""Where each physical expert slot of one engine deployment lives under expert parallelism (pure).

An engine with expert parallelism over ``ep_size`` ranks (vLLM ``--enable-expert-parallel``:
``ep_size = DP x PCP x TP``; SGLang ``--ep-size``) holds ``E + R`` **physical** expert slots per
MoE layer: the ``E`` logical experts and ``R`` redundant replicas. Each slot holds one logical
expert, per layer (EPLB's ``physical_to_logical`` map, ``[num_layers, E + R]``), and lives on one
rank, at one local index. A receiver writes one logical expert into every local slot that holds
it (two on one rank included): :func:`slots_of`; :func:`ranks_holding` says which ranks need it.

The rules are the installed engines' own:

- vLLM 0.33, ``fused_moe/expert_map_manager.py``: ``determine_expert_map`` splits the physical
  slots (``global_num_experts = E + R``, ``fused_moe/layer.py:determine_expert_counts``) over the
  ranks: rank ``r`` holds ``P // ep + (r < P % ep)`` of them, ``linear`` from
  ``r * (P // ep) + min(r, P % ep)`` on, ``round_robin`` ``r, r + ep, ...`` (on a rank ``r > P``
  it fails: refused here). Which strategy runs is :func:`vllm_strategy`. ``ParallelConfig``
  refuses redundant experts without EPLB, ``FusedMoEFactory`` EPLB with ``P % ep != 0``. The
  first map is ``EplbState.build_initial_global_physical_to_logical_map``.
- SGLang 0.5.23, ``srt/eplb/expert_location.py``: ``ExpertLocationMetadata`` puts physical slot
  ``p`` on rank ``p // (P // ep)`` (contiguous: ``linear``) and needs ``P % ep == 0``; its trivial
  map (``init_trivial``) is ``arange(P) % E``, the same as vLLM's first map. Its weight loader
  (``FusedMoE.weight_loader``) writes a checkpoint expert into the slots
  ``logical_to_all_physical`` names; under an all2all backend that list is cut, per rank, to the
  nearest replica (two on one rank: the first only), and a parameter that needs every expert
  (``_sglang_require_global_experts``) gets slots ``e, e + E, ...`` whatever the map.
"""

from __future__ import annotations

from dataclasses import dataclass

STRATEGIES = ("linear", "round_robin")
"""vLLM's ``ExpertPlacementStrategy``."""

ROUND_ROBIN_ALL2ALL_BACKENDS = ("deepep_low_latency", "nixl_ep")
"""vLLM's all2all backends that keep round-robin placement (``needs_round_robin_routing_tables``)."""

Map = tuple[int, ...]
"""One MoE layer's physical-to-logical map: the logical expert each physical slot holds."""


def initial_map(num_logical_experts: int, num_redundant: int) -> Map:
    """The engines' first map: slot ``p`` holds logical expert ``p % E`` (vLLM's
    ``build_initial_global_physical_to_logical_map``, SGLang's ``init_trivial``)."""
    return tuple(p % num_logical_experts for p in range(num_logical_experts + num_redundant))


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertPlacement:
    """The physical expert slots of one engine deployment: how many, on which rank, holding what."""

    num_logical_experts: int
    """``E``: routed experts of the model, per MoE layer."""
    ep_size: int
    """Expert-parallel ranks the slots are split over."""
    num_redundant: int = 0
    """``R``: extra replicas (EPLB's redundant experts); ``E + R`` physical slots per layer."""
    strategy: str = "linear"
    """How slots are dealt to ranks (the strategy the engine runs, after its fallbacks)."""
    physical_to_logical: tuple[Map, ...] = ()
    """One map per layer, indexed as the engine indexes its map (vLLM's EPLB: its MoE layers in
    order; SGLang: the decoder layer id), or one map for every layer; ``()``: :func:`initial_map`
    for every layer."""

    def __post_init__(self) -> None:
        for field, low in (("num_logical_experts", 1), ("ep_size", 1), ("num_redundant", 0)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"ExpertPlacement.{field} must be an int >= {low}, got {value!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"expert placement strategy {self.strategy!r} is not one of {STRATEGIES}")
        if self.strategy == "round_robin" and self.ep_size > self.num_physical + 1:
            # torch.arange(ep_rank, P, ep_size) with ep_rank > P: vLLM's determine_expert_map raises
            raise ValueError(f"ep_size={self.ep_size} round-robin over {self.num_physical} physical experts: vLLM "
                             f"fails on the ranks past {self.num_physical}")
        rows = self.physical_to_logical or (initial_map(self.num_logical_experts, self.num_redundant),)
        rows = tuple(_check_row(self, layer, row) for layer, row in enumerate(rows))
        object.__setattr__(self, "physical_to_logical", rows)

    @property
    def num_physical(self) -> int:
        return self.num_logical_experts + self.num_redundant

    def layer_map(self, layer: int) -> Map:
        """The physical-to-logical map of MoE layer ``layer``."""
        rows = self.physical_to_logical
        if len(rows) == 1:
            return rows[0]
        if not 0 <= layer < len(rows):
            raise ValueError(f"layer {layer!r} is not one of the {len(rows)} MoE layers of the map")
        return rows[layer]


def _check_row(placement: ExpertPlacement, layer: int, row) -> Map:
    if isinstance(row, int) or not hasattr(row, "__len__"):
        raise ValueError(f"physical_to_logical must hold one map per MoE layer, got {row!r} at [{layer}]")
    row = tuple(row)
    if len(row) != placement.num_physical:
        raise ValueError(f"physical_to_logical[{layer}] has {len(row)} slots, num_logical_experts + num_redundant "
                         f"= {placement.num_physical}")
    for physical, logical in enumerate(row):
        if not isinstance(logical, int) or not 0 <= logical < placement.num_logical_experts:
            raise ValueError(f"physical_to_logical[{layer}][{physical}] = {logical!r} is not a logical expert "
                             f"of {placement.num_logical_experts}")
    missing = set(range(placement.num_logical_experts)).difference(row)
    if missing:
        raise ValueError(f"physical_to_logical[{layer}] holds no replica of logical expert {min(missing)}")
    return row


def vllm_strategy(requested: str, *, ep_size: int, num_expert_group: int | None, num_redundant: int, eplb: bool,
                  all2all_backend: str | None = None) -> str:
    """The strategy vLLM runs for ``requested`` (``--expert-placement-strategy``), with its fallbacks
    to ``linear`` (``determine_expert_placement_strategy``, ``ExpertMapManager._determine_placement_strategy``):
    round-robin needs ``num_expert_group > 1``, no redundant experts, no EPLB, ``ep_size > 1`` and,
    where the MoE uses all2all kernels (EP with DP, PCP or sequence parallelism > 1:
    ``all2all_backend`` given), a backend of :data:`ROUND_ROBIN_ALL2ALL_BACKENDS`. vLLM warns on each
    fallback but the ``ep_size == 1`` one."""
    if requested not in STRATEGIES:
        raise ValueError(f"expert placement strategy {requested!r} is not one of {STRATEGIES}")
    if requested != "round_robin":
        return requested
    grouped = num_expert_group is not None and num_expert_group > 1
    if not (grouped and num_redundant == 0 and not eplb) or ep_size == 1:
        return "linear"
    if all2all_backend is not None and all2all_backend not in ROUND_ROBIN_ALL2ALL_BACKENDS:
        return "linear"
    return "round_robin"


def vllm_placement(*, num_logical_experts: int, ep_size: int, num_redundant: int = 0, strategy: str = "linear",
                   num_expert_group: int | None = None, eplb: bool = False, all2all_backend: str | None = None,
                   physical_to_logical: tuple[Map, ...] = ()) -> ExpertPlacement:
    """A vLLM deployment's placement, refused where vLLM refuses it: redundant experts or a moved map
    without EPLB (``ParallelConfig``, ``FusedMoEFactory``), EPLB on one rank (``ParallelConfig``:
    it needs TP x PCP x DP > 1) or over ranks that do not divide the physical slots (``FusedMoEFactory``)."""
    if num_redundant and not eplb:
        raise ValueError(f"num_redundant={num_redundant!r}: vLLM holds redundant experts only under EPLB")
    if eplb and ep_size == 1:
        raise ValueError("eplb: vLLM balances experts over more than one rank, got ep_size=1")
    resolved = vllm_strategy(strategy, ep_size=ep_size, num_expert_group=num_expert_group,
                             num_redundant=num_redundant, eplb=eplb, all2all_backend=all2all_backend)
    placement = ExpertPlacement(num_logical_experts=num_logical_experts, ep_size=ep_size, num_redundant=num_redundant,
                                strategy=resolved, physical_to_logical=physical_to_logical)
    if eplb and placement.num_physical % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {placement.num_physical} physical experts "
                         f"(vLLM's EPLB places them evenly)")
    first = initial_map(num_logical_experts, num_redundant)
    if not eplb and any(row != first for row in placement.physical_to_logical):
        raise ValueError("physical_to_logical differs from vLLM's initial map: only EPLB moves experts")
    return placement


def sglang_placement(*, num_logical_experts: int, ep_size: int, num_redundant: int = 0,
                     physical_to_logical: tuple[Map, ...] = ()) -> ExpertPlacement:
    """An SGLang deployment's placement: contiguous blocks (``linear``), ``P % ep_size == 0``."""
    placement = ExpertPlacement(num_logical_experts=num_logical_experts, ep_size=ep_size, num_redundant=num_redundant,
                                physical_to_logical=physical_to_logical)
    if placement.num_physical % ep_size:
        raise ValueError(f"ep_size={ep_size} does not divide the {placement.num_physical} physical experts "
                         f"(SGLang's num_local_physical_experts)")
    return placement


def _check_rank(placement: ExpertPlacement, ep_rank: int) -> None:
    if not isinstance(ep_rank, int) or not 0 <= ep_rank < placement.ep_size:
        raise ValueError(f"ep_rank {ep_rank!r} is not one of the {placement.ep_size} EP ranks")


def rank_slots(placement: ExpertPlacement, ep_rank: int) -> tuple[int, ...]:
    """The physical slots rank ``ep_rank`` holds, in local order (vLLM's ``determine_expert_map``)."""
    _check_rank(placement, ep_rank)
    base, rem = divmod(placement.num_physical, placement.ep_size)
    if placement.strategy == "round_robin":
        return tuple(range(ep_rank, placement.num_physical, placement.ep_size))
    start = ep_rank * base + min(ep_rank, rem)
    return tuple(range(start, start + base + (ep_rank < rem)))


def rank_of(placement: ExpertPlacement, physical: int) -> int:
    """The rank that holds physical slot ``physical``."""
    if not isinstance(physical, int) or not 0 <= physical < placement.num_physical:
        raise ValueError(f"physical expert {physical!r} is not one of {placement.num_physical}")
    if placement.strategy == "round_robin":
        return physical % placement.ep_size
    base, rem = divmod(placement.num_physical, placement.ep_size)
    if physical < rem * (base + 1):
        return physical // (base + 1)
    return rem + (physical - rem * (base + 1)) // base


def expert_map(placement: ExpertPlacement, ep_rank: int) -> tuple[int, ...]:
    """vLLM's ``expert_map`` of ``ep_rank``: per physical slot, its local index there, -1 elsewhere
    (vLLM keeps none at ``ep_size == 1``, where every slot is local: this gives ``0 .. P - 1``)."""
    out = [-1] * placement.num_physical
    for local, physical in enumerate(rank_slots(placement, ep_rank)):
        out[physical] = local
    return tuple(out)


def slots_of(placement: ExpertPlacement, ep_rank: int, layer: int) -> tuple[tuple[int, int], ...]:
    """``(local index, logical expert)`` of each slot rank ``ep_rank`` holds in MoE layer ``layer``."""
    row = placement.layer_map(layer)
    return tuple((local, row[physical]) for local, physical in enumerate(rank_slots(placement, ep_rank)))


def ranks_holding(placement: ExpertPlacement, layer: int, logical_expert: int) -> tuple[int, ...]:
    """The ranks that hold a replica of ``logical_expert`` in MoE layer ``layer``, ascending."""
    if not isinstance(logical_expert, int) or not 0 <= logical_expert < placement.num_logical_experts:
        raise ValueError(f"logical expert {logical_expert!r} is not one of {placement.num_logical_experts}")
    row = placement.layer_map(layer)
    return tuple(sorted({rank_of(placement, p) for p, logical in enumerate(row) if logical == logical_expert}))


def moved(live: ExpertPlacement, current: ExpertPlacement, num_layers: int) -> bool:
    """Whether ``live`` (an engine's map read now) puts any logical expert of the first
    ``num_layers`` MoE layers in another slot than ``current`` (the one planned); ``ValueError``
    where ``live`` is not a map of the same physical slots (logical and redundant experts, EP
    size, strategy: what a load balancer cannot change)."""
    if not isinstance(live, ExpertPlacement):
        raise ValueError(f"the engine's live expert map must be an ExpertPlacement, got {type(live).__name__}")
    for field in ("num_logical_experts", "ep_size", "num_redundant", "strategy"):
        if getattr(live, field) != getattr(current, field):
            raise ValueError(f"the engine's live expert map has {field}={getattr(live, field)!r}, the refit planned "
                             f"{getattr(current, field)!r}: a load balancer moves experts between slots, it does "
                             "not change the slots (restart the engine's refit connection)")
    if len(live.physical_to_logical) not in (1, num_layers):
        raise ValueError(f"the engine's live expert map holds {len(live.physical_to_logical)} layer maps, the model "
                         f"{num_layers} MoE layers")
    return any(live.layer_map(layer) != current.layer_map(layer) for layer in range(num_layers))
