"""The engine deployment the ``refit:`` section names (pure): its keys checked against each other
and the engine (:func:`check_deployment`), its expert placement resolved as the engine resolves it
once the model's expert count is known (:func:`deployment_layout`), and the refusal of what the
engines cannot receive yet (:func:`refuse_wide_ep`, #64: planned by the dry run and the cost model,
not built into the engines).

One replica is one **deployment** of ``gen_tp * gen_attention_dp`` ranks
(:class:`~megatron_refit.plan.gen_layout.GenLayout`: ``tp``, ``attention_dp``, ``placement``);
``gen_dp`` counts deployments. The keys read here are fields of
:class:`~megatron_refit.config.section.RefitConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_refit.plan.expert_placement import STRATEGIES, sglang_placement, vllm_placement
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.registry import engine_named

WIDE_EP_KEYS = ("gen_attention_dp", "gen_redundant_experts", "gen_eplb", "gen_expert_placement")
"""The keys of a deployment the engines cannot receive into yet, with their defaults below."""
DEFAULTS = {"gen_attention_dp": 1, "gen_redundant_experts": 0, "gen_eplb": False, "gen_expert_placement": "linear"}
VLLM_ALL2ALL = "allgather_reducescatter"
"""vLLM's default ``--all2all-backend``: with data-parallel ranks it keeps no round-robin routing
tables, so round-robin placement falls back to linear there."""


def check_deployment(cfg) -> None:
    """``ValueError`` naming the first deployment key ``cfg`` (a ``RefitConfig``) sets that its
    engine, or the other keys, rule out; what needs the model's expert count is checked by
    :func:`deployment_layout`."""
    if cfg.gen_expert_placement not in STRATEGIES:
        raise ValueError(f"refit.gen_expert_placement: {cfg.gen_expert_placement!r} is not one of {list(STRATEGIES)}")
    if cfg.gen_redundant_experts < 0:
        raise ValueError(f"refit.gen_redundant_experts must be >= 0, got {cfg.gen_redundant_experts!r}")
    if not cfg.gen_expert_parallel:
        for key in ("gen_redundant_experts", "gen_eplb", "gen_expert_placement"):
            if getattr(cfg, key) != DEFAULTS[key]:
                raise ValueError(f"refit.{key}={getattr(cfg, key)!r} places whole experts: it needs "
                                 "gen_expert_parallel: true")
    if cfg.gen_eplb:  # each deployment's balancer moves its experts on its own, between any two refits
        for key, why in (("fanout", "a relayed refit would land in another deployment's expert map"),
                         ("overlap", "the snapshot is taken before the refit re-plans the moved experts")):
            if getattr(cfg, key) != "off":
                raise ValueError(f"refit.{key}={getattr(cfg, key)!r} with refit.gen_eplb: {why}; set {key}: off")
    if cfg.gen_dense_forward not in ("off", "node"):
        raise ValueError(f"refit.gen_dense_forward: {cfg.gen_dense_forward!r} is not one of ['off', 'node']")
    if not isinstance(cfg.gen_node_ranks, int) or isinstance(cfg.gen_node_ranks, bool) or cfg.gen_node_ranks < 1:
        raise ValueError(f"refit.gen_node_ranks must be a positive int, got {cfg.gen_node_ranks!r}")
    if cfg.gen_dense_forward == "node":
        if cfg.gen_attention_dp < 2:
            raise ValueError("refit.gen_dense_forward: node splits the dense weights over a deployment's "
                             f"data-parallel ranks; gen_attention_dp is {cfg.gen_attention_dp}")
        for key, why in (("delta", "a forwarded row is written by a peer, not kept as sent"),
                         ("fanout", "a relayed replica's ranks would need their node group's rows too")):
            if getattr(cfg, key) != "off":
                raise ValueError(f"refit.{key}={getattr(cfg, key)!r} with refit.gen_dense_forward: node: {why}")
    if cfg.engine == "vllm":
        if cfg.gen_redundant_experts and not cfg.gen_eplb:
            raise ValueError(f"refit.gen_redundant_experts={cfg.gen_redundant_experts}: vLLM holds redundant "
                             "experts only under EPLB (set gen_eplb: true)")
        if cfg.gen_eplb and cfg.gen_tp * cfg.gen_attention_dp == 1:
            raise ValueError("refit.gen_eplb: vLLM balances experts over more than one rank; gen_tp * "
                             "gen_attention_dp is 1")
    elif cfg.engine == "sglang" and cfg.gen_expert_placement != "linear":
        raise ValueError(f"refit.gen_expert_placement={cfg.gen_expert_placement!r}: SGLang places its physical "
                         "experts in contiguous blocks (linear)")
    if cfg.gen_style == "full" and cfg.gen_attention_dp != 1:
        raise ValueError(f"refit.gen_attention_dp={cfg.gen_attention_dp}: engine {cfg.engine!r} holds whole "
                         "tensors on one rank per replica; more ranks are more replicas (gen_dp)")


@dataclass(frozen=True, slots=True)
class Deployment:
    """A deployment's layout and how its placement was resolved (what the dry run prints)."""

    layout: GenLayout
    strategy: str
    """The placement strategy planned: the requested one, or ``linear`` where the engine falls back."""
    fallback: str
    """Why the engine falls back to ``linear`` ('' where it does not)."""

    def describe(self, engine: str) -> str:
        """``vllm D16xT8, EP128 (linear, 0 redundant experts) x 1 = 128 ranks``."""
        gen = self.layout
        if gen.expert_parallel:
            redundant = gen.placement.num_redundant if gen.placement is not None else 0
            experts = f", EP{gen.deployment_size} ({self.strategy}, {redundant} redundant experts)"
        else:
            experts = ""
        shape = f"D{gen.attention_dp}xT{gen.tp}" if gen.attention_dp > 1 else f"TP{gen.tp}"
        return f"{engine} {shape}{experts} x {gen.dp} = {gen.world_size} ranks"


def deployment_layout(cfg, *, replicas: int, num_experts: int = 0, num_expert_group: int | None = None) -> Deployment:
    """``replicas`` deployments of ``cfg``'s engine layout for a model of ``num_experts`` routed
    experts (0: dense; ``num_expert_group``: vLLM's ``num_expert_group``, e.g. DeepSeek-V3's
    ``n_group``), its expert placement resolved as the engine resolves it: vLLM's rules
    (:func:`~megatron_refit.plan.expert_placement.vllm_placement`, with vLLM's default all2all
    backend where ``gen_attention_dp > 1``) or SGLang's; ``ValueError`` where the engine refuses
    it. The placement is ``None`` (each TP rank holds ``num_experts // gen_tp`` consecutive
    experts, as before) where it would be vLLM's initial linear map over ``gen_tp`` ranks alone."""
    strategy, fallback, placement = cfg.gen_expert_placement, "", None
    wide = cfg.gen_attention_dp > 1 or cfg.gen_redundant_experts or cfg.gen_eplb or strategy != "linear"
    if cfg.gen_expert_parallel and num_experts and wide:
        ep_size = cfg.gen_tp * cfg.gen_attention_dp
        if cfg.engine == "sglang":
            placement = sglang_placement(num_logical_experts=num_experts, ep_size=ep_size,
                                         num_redundant=cfg.gen_redundant_experts)
        else:
            backend = VLLM_ALL2ALL if cfg.gen_attention_dp > 1 else None
            placement = vllm_placement(num_logical_experts=num_experts, ep_size=ep_size,
                                       num_redundant=cfg.gen_redundant_experts, strategy=strategy,
                                       num_expert_group=num_expert_group, eplb=cfg.gen_eplb, all2all_backend=backend)
            fallback = _fallback(strategy, placement.strategy, cfg, ep_size, num_expert_group)
        strategy = placement.strategy
        if placement.strategy == "linear" and not placement.num_redundant and cfg.gen_attention_dp == 1 \
                and not cfg.gen_eplb:  # EPLB moves experts: its map is kept to be compared with the live one
            placement = None  # the map of gen_tp ranks that GenLayout keeps by default
    layout = GenLayout(tp=cfg.gen_tp, dp=replicas, expert_parallel=cfg.gen_expert_parallel,
                       attention_dp=cfg.gen_attention_dp, placement=placement)
    return Deployment(layout=layout, strategy=strategy, fallback=fallback)


def _fallback(requested: str, resolved: str, cfg, ep_size: int, num_expert_group: int | None) -> str:
    if requested == resolved:
        return ""
    if not (num_expert_group or 0) > 1:
        return f"the model has no expert groups (num_expert_group={num_expert_group})"
    if cfg.gen_redundant_experts or cfg.gen_eplb:
        return "redundant experts or EPLB"
    if ep_size == 1:
        return "one expert-parallel rank"
    return f"vLLM's default all2all backend {VLLM_ALL2ALL} keeps no round-robin routing tables"


def refuse_wide_ep(cfg) -> None:
    """``ValueError`` naming the first key of a wide expert-parallel deployment that ``cfg`` sets
    and its engine does not receive into (its :attr:`~megatron_refit.registry.Engine.wide_ep`);
    called where a refit starts (the train ranks' and every engine's), before any byte moves."""
    key = refused_key(cfg)
    if key is not None:
        raise ValueError(f"refit.{key}={getattr(cfg, key)!r}: engine {cfg.engine!r} does not receive into that wide "
                         f"expert-parallel deployment yet (#64): the dry run and the cost model plan it "
                         f"(python -m megatron_refit.dryrun / costmodel --config ...); to refit now set "
                         f"{key}: {_yaml(DEFAULTS[key])}")


def refused_key(cfg) -> str | None:
    """The first wide-EP key ``cfg`` sets that its engine does not receive into (None: it receives
    the whole deployment); the dry run prints it before a job starts."""
    honoured = engine_named(cfg.engine).wide_ep
    return next((key for key in WIDE_EP_KEYS if getattr(cfg, key) != DEFAULTS[key] and key not in honoured), None)


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
