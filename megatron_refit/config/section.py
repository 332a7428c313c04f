"""``RefitConfig``: the ``refit:`` section of a training YAML (pure; no Megatron, no torch),
checked on construction. Reading the training YAML around it: :mod:`.training_yaml`.
``refit: {enabled: true}`` turns refit on with every other field at its default.
"""

from __future__ import annotations

import dataclasses
import typing
import warnings
from dataclasses import dataclass
from typing import Any

from megatron_refit.config.deployment import deployment_layout
from megatron_refit.config.values import check_type, check_values
from megatron_refit.registry import engine_named
from megatron_refit.plan.gen_layout import GenLayout

RENAMED = {"backend": "engine"}
"""Keys of earlier releases: refused, naming the key that replaced them."""
AUTO_SERVING_EVERY = 10
"""``verify_serving: auto``: every this many refits (and the first to each replica)."""


@dataclass(kw_only=True, slots=True)
class RefitConfig:
    """How trainer weights reach the generation engine after every optimizer step."""

    enabled: bool = False
    """Turn refit on. With ``false`` every other field is ignored."""
    mode: str = "disaggregated"
    """``disaggregated``: trainer and engine on separate GPUs, buffers move over NCCL (gloo
    on CPU). ``colocated``: both share the GPUs; buffers are handed over by IPC handles."""
    engine: str = "vllm"
    """Generation engine on the receiving side: ``vllm``, ``sglang`` or ``hf`` (Hugging Face
    transformers, CPU reference at gen TP 1), or another registered with
    ``megatron_refit.registry.register_engine``. (Formerly ``backend``.)"""
    transport: str = "auto"
    """How bucket bytes travel: ``auto`` (``ipc`` when ``mode: colocated``, else ``nccl`` between
    GPUs and ``gloo`` on CPU) or a transport registered with
    ``megatron_refit.transport.register_transport`` (built in: ``gloo``, ``nccl``, ``ipc``)."""
    gen_tp: int = 1
    """Tensor-parallel size of one engine replica."""
    gen_dp: int = 1
    """Number of engine replicas (each holds the whole model at ``gen_tp``)."""
    gen_expert_parallel: bool = False
    """vLLM ``enable_expert_parallel``: routed experts are split whole over an engine
    replica's ranks instead of tensor-sliced."""
    gen_attention_dp: int = 1
    """Data-parallel ranks inside one replica, then a wide expert-parallel deployment of
    ``gen_tp * gen_attention_dp`` ranks (vLLM ``--data-parallel-size`` of a MoE model at
    ``--tensor-parallel-size gen_tp``; SGLang ``--enable-dp-attention --dp`` at ``--tp gen_tp *
    gen_attention_dp``, ``--ep-size`` the same, ``--enable-dp-lm-head``): attention TP-sharded over
    ``gen_tp``, the same on each DP rank; routed experts over all the ranks (``gen_expert_parallel``,
    EP size ``gen_tp * gen_attention_dp``) or MoE-tensor-sharded over them. ``gen_dp`` counts
    deployments; a deployment is one refit group and one fault domain (a failure on any of its
    ranks fails that deployment's refit, the others land). vLLM's worker and SGLang's loader
    receive into it (a MoE model with expert parallelism; vLLM without it too), each engine's own
    expert maps checked against the plan's; an engine that does not declare it
    (``Engine.wide_ep``) refuses it by name where a refit starts."""
    gen_expert_placement: str = "linear"
    """vLLM ``--expert-placement-strategy`` under ``gen_expert_parallel``: ``linear`` or
    ``round_robin``, which vLLM turns into linear unless the model has expert groups, no
    redundant experts, no EPLB and (with ``gen_attention_dp > 1``) an all2all backend other than
    its default; the dry run prints the outcome. SGLang: ``linear``."""
    gen_redundant_experts: int = 0
    """Redundant expert slots per MoE layer under ``gen_expert_parallel`` (vLLM
    ``num_redundant_experts`` of ``--eplb-config``, with ``gen_eplb``; SGLang
    ``--ep-num-redundant-experts``), planned at the engine's initial map; a rank that holds an
    expert in two slots receives it once and writes both. vLLM keeps redundant experts only under
    EPLB (see ``gen_eplb``); vLLM's worker and SGLang's loader refuse a count other than the
    engine's by name and read the map in force (SGLang's ``--init-expert-location`` included)."""
    gen_eplb: bool = False
    """``--enable-eplb``: the engine moves experts between its slots while serving. vLLM's worker
    reads EPLB's live map of every MoE layer at the start of each refit, before any byte moves,
    and the refit lands in the slots it names (only the moved experts re-planned); sync EPLB only
    (``--eplb-config '{"use_async": false}'``: an async rebalance in flight would commit old
    experts over the refit's), and the worker refuses EPLB it runs that this key does not name.
    SGLang's loader reads its ``ExpertLocationMetadata`` at the start of each refit the same way
    (its rebalance runs on the scheduler thread, between the loader's calls). The plan also lands a
    moved map once a deployment's ranks rejoin with it (a new incarnation). Not with ``fanout``,
    ``overlap`` or LoRA adapter sync (refused by name)."""
    gen_dense_forward: str = "off"
    """How a wide deployment's data-parallel ranks get their dense weights (attention, shared
    experts, embeddings, norms: the same on every DP rank of a TP rank). ``off``: each from the
    train ranks. ``node``: the DP ranks that share a node (``gen_node_ranks``) each take a share of
    the rows from the train ranks and pass it to the others there (NVLink), so each NIC carries its
    share only; ``costmodel --json``'s ``deployment_forwarding`` says when that is faster. Not with
    ``delta``, ``fanout`` or LoRA adapter sync (refused by name)."""
    gen_node_ranks: int = 8
    """Under ``gen_dense_forward: node``: how many consecutive engine ranks of a deployment share a
    node (its GPUs: vLLM's and SGLang's DP ranks fill nodes in order). A value other than the
    cluster's costs speed (rows forwarded over the NICs), never bytes: the exchange is the same."""
    gen_draft: bool = False
    """The engine decodes speculatively with the model's MTP layers as its draft (vLLM
    ``--speculative-config '{"method": "deepseek_mtp", ...}'``, SGLang ``--speculative-algorithm
    EAGLE`` with the NextN draft): the trainer's MTP layers (Bridge ``mtp_num_layers``) are required
    on the engine ranks and refitted with the main model in every version; a plan where no engine
    rank holds them fails by name at start instead of leaving the draft the first version's. The
    HF engine holds a draft (``HFStorage.from_config(draft=True)``); vLLM's worker receives into
    its ``DeepSeekMTP`` draft in vLLM's draft session (``start_draft_weight_update``: every refit is
    one); SGLang's loader into its NextN draft (the sessions select ``all`` runners, the draft's
    runner hands it over at connect). Where the engine scores its draft (the HF engine), the
    serving check holds the draft's log-probs to the trainer's MTP layer's too. With
    ``trainer_quantize_fp8`` the MTP layers' weights are quantized by the main model's roles
    (``eh_proj``, a plain linear in the engines' drafts, stays bf16). Off: MTP layers no
    engine rank holds are skipped by name and counted (``refit/skipped_params``); the dry run
    counts the draft's parameters (``draft_params``) when on."""
    host: str = "127.0.0.1"
    """Rendezvous host of the refit process group (train rank 0's node under SLURM)."""
    port: int = 29600
    """Rendezvous TCP port of the refit process group."""
    bucket_mb: float = 64.0
    """Largest packed bucket, in MiB. Two buckets per peer are in flight at a time."""
    direct_mb: float | None = None
    """Transfers of at least this many MiB skip packing: one message each, sent from the
    trainer's tensor and received into the engine's storage where both are contiguous.
    ``null``: 1 MiB on gloo (CPU, where a packing copy costs as much as the wire), one bucket
    (``bucket_mb``) on NCCL (a device copy is ~30x faster than a 400 Gb/s NIC, a message costs
    ~20 us: mid-size pieces such as one expert's slice travel packed, a few full buckets
    per peer)."""
    trainer_quantize_fp8: bool = False
    """Quantize bf16 weights on the trainer to 128x128-block ``float8_e4m3fn`` plus fp32
    ``weight_scale_inv`` before sending (for an FP8 engine fed from a bf16 trainer)."""
    lora_sync: str = "auto"
    """What a refit sends when the policy trains LoRA adapters (Bridge PEFT). ``adapters``:
    base weights and adapters on the first refit (and on a refit called with ``full=True``,
    e.g. after the engine dropped its weights), the adapter matrices only afterwards; the
    engine's receiver merges them into its weights. ``full``: base weights and adapters
    every refit. ``auto``: ``adapters``. ``merged`` (trainer-side merge, for engines that
    cannot merge) is not implemented and is refused when adapters are present."""
    engine_load: str = "auto"
    """How the engine writes what it receives (vLLM: the ``megatron_refit`` weight-transfer backend).
    ``in_place``: straight into the engine's own parameters, then the engine's post-load step
    re-runs on them (no extra memory; needs parameters that keep the checkpoint's shape and
    dtype after post-load, which is checked). ``load_weights``: into staging buffers, then
    through vLLM's weight loaders and layerwise reload, as vLLM's own backends do (one more
    copy of this rank's share; for engines that re-pack weights into another shape).
    ``auto``: the engine decides when it connects: ``in_place`` where its live parameters
    hold the checkpoint layout, ``load_weights`` otherwise (vLLM on CPU re-packs its linear
    weights) and under ``swap: staged``; an engine with one mode uses it. The engine logs
    its choice once and reports it (``engine_load`` of its refit reports)."""
    every_n_steps: int = 1
    """Refit after every n-th optimizer step (``RefitCallback`` in Bridge's training loop:
    iterations whose step is a multiple of n; a skipped iteration never refits)."""
    timeout_s: float = 600.0
    """Upper bound on any single wait (rendezvous, bucket send/receive), in seconds."""
    stall_s: float = 30.0
    """A replica whose engine ranks all stopped beating for this long (each beats every
    ``stall_s / 6`` s from a thread of its own: a stopped or hung process stops, a slow one
    goes on) is stalled: the train ranks stop waiting for it then, not at ``timeout_s``, and
    drop it (it may rejoin). Bound: ``stall_s`` plus ``stall_s / 2``. ``0``: off (at or
    above ``timeout_s``, ``timeout_s`` comes first)."""
    verify: str = "sampled"
    """Integrity check of every bucket against a digest its sender computed, seeded with the
    version, both ranks, the bucket's place in the plan and the plan itself: ``sampled``
    reads 4 KiB of every 512 KiB (all of buckets under 512 KiB) and catches zeroed, truncated,
    stale, swapped or misrouted buckets at a few percent of a refit; ``full`` reads every
    byte (also single flipped bytes; on CPU/gloo ~40 % longer refits, on GPUs far less);
    ``off``. Under ``refit.fanout`` (chain, tree, auto) ``sampled`` reads every byte: a relay
    link is a hop no train rank reads. A mismatch raises ``RefitCorruptionError`` naming the
    parameters, marks the engine's weights stale, and the next refit restores them."""
    check_finite: bool = False
    """Read every trainer piece for NaN / Inf before each refit (one pass over this rank's
    weights); one found ends the refit on every rank before any byte moves, naming the
    parameters, and the engine keeps serving the previous version."""
    delta: str = "off"
    """Delta refits: send only the elements that changed since the last refit, shard to
    shard. ``on``: every refit after the first complete one compares each bucket with a copy
    of what was sent last time and sends the smallest of its bytes, the changed elements'
    indices and values, or a bitmask and values; ``auto``: decides before every refit from
    measured costs (the last full and the last delta refit's wall time; before the first delta,
    the comparison's cost on this rank): deltas while one takes at most 95 % of a full refit,
    else full refits without comparing and without the copy; ``off``. Costs host memory on every train rank: a copy of
    all it sends (its share of the model in the sent dtype). A receiver that missed a version
    (restart, failed refit, re-allocated parameters) gets a full refit, decided before any
    byte moves. (YAML reads a bare ``off`` / ``on`` as a boolean: both are taken as the mode.)"""
    swap: str = "in_place"
    """How a refit becomes live. ``in_place``: bytes land in the engine's parameters, which
    serve nothing while a refit runs (``updating``). ``staged``: the refit streams into a copy
    of the weights while the engine keeps serving the previous version, then a short swap
    under a pause makes it live at once: no forward pass sees two versions, every output is
    tagged with the version that produced it, and a failed refit leaves the previous version
    serving. Costs one more copy of the weights on each generation rank. The HF receiver
    swaps storage pointers; with ``engine: vllm`` it needs ``engine_load: load_weights``
    (the staging buffers loaded into a shadow of the model while it serves, swapped in under
    vLLM's pause; what a server does with the requests in flight: ``HTTPClient(policy=...)``,
    docs/guide-swap.md)."""
    on_replica_failure: str = "raise"
    """What train ranks do when an engine replica cannot apply a refit (its engine raised while
    receiving or loading, its bytes arrived corrupted, its process died): the failure stays on
    that replica either way (every replica has a refit group of its own: the others land the
    version bit-exactly; the failed one is stale and its next refit brings it back, or, if its
    process died, it is dropped until it rejoins) and is named in the report
    (``failed_replicas``) and the metrics (``refit/replicas_ok``, ``refit/replicas_failed``).
    ``raise``: the refit then raises ``ReplicaFailedError`` on every train rank, so a loop that
    does not look at the report cannot miss it (the default: with one replica nothing would
    serve the new weights); ``continue``: it returns, and training goes on (fleets of many
    replicas), unless no replica holds the version."""
    overlap: str = "off"
    """Trainer side. ``on``: a refit copies the bytes this train rank sends into a snapshot at
    the step boundary (a device-side copy of the pieces it sends from: the model's params in
    their training dtype, never the optimizer's fp32 main params) and returns; the bytes move
    from the snapshot in the background while the next step trains. Every version lands
    exactly as the weights were at the step it was taken. Costs one copy of what this rank
    sends, and the training step's share of the machine the background send takes. A refit
    that failed in the background raises at the next refit (or step boundary), its version
    named. ``off``: a refit returns when its bytes have landed. (A bare YAML ``on`` / ``off``
    is taken as the mode.)"""
    overlap_busy: str = "wait"
    """``overlap: on``, when a refit is due while the last one still moves (at most one is in
    flight per trainer): ``wait`` for it, then start; ``skip`` this one (every train rank
    alike; counted in ``RefitCallback.skipped_busy``)."""
    fanout: str = "off"
    """Replica fan-out: the train ranks send each byte once, to one replica, and the replicas
    forward it, engine rank ``k`` of one to rank ``k`` of the next, bucket by bucket while the
    next arrives (digests checked at every hop). ``chain``: each replica forwards to one;
    ``tree``: to two (fewer hops, twice the egress); ``auto``: the cost model's choice per refit
    (:func:`megatron_refit.plan.fanout.auto_mode`: direct, chain or tree); ``off``: every replica
    from the train ranks. Replicas share a chain only with the same layout and base version
    (under ``delta``: the version they hold); any other replica gets its refit directly. A relay
    that dies, stalls or breaks its link mid-refit is routed around within that refit: its
    successors get the rest from the train ranks. Needs ``mode: disaggregated``. docs/design.md
    shows the chain."""
    verify_serving: str | int = "auto"
    """Proof of serving: after a version lands, each engine replica scores a fixed probe
    (``serving_probe``) through its real serving path (vLLM: ``prompt_logprobs`` of its server
    or ``LLM``; SGLang: its log-prob path; the HF engine: its forward) and the train ranks compare
    the per-token log-probs with the trainer model's own forward at that version. Beyond
    ``serving_tolerance`` that replica has not landed the version: ``ServingMismatchError``,
    handled by ``on_replica_failure`` like any replica failure, and its next refit is a full one.
    ``on``: every refit; an int N: every N-th refit; both also the first refit to each replica (its
    start, a join, after a failure), and both refuse to start where the trainer has no forward to
    compare with (a trainer of bare pieces) or an engine cannot score. ``auto``: every
    10th refit and the first to each replica, where both can (off elsewhere, said once in the log;
    ``refit/serving_checked`` counts the replicas checked). ``off``. (A bare YAML ``on`` / ``off``
    is taken as the mode.) A replica's first check also measures its clean noise, and its later
    checks must keep the probe's tail and bulk within about twice that, as well as the tolerance
    (under ``verify: off``, which proves no refit's bytes, the tolerance alone). Cost and what it
    catches: docs/guide-serving.md."""
    serving_probe: dict | None = None
    """The probe of ``verify_serving``: ``{sequences: 4, length: 16, seed: 0}`` (token ids drawn
    uniformly from the vocabulary with the seed), or ``{tokens: [[id, ...], ...]}``; null: the
    defaults. Either with ``cover_tokens`` (default 1024; 0: never): of a MoE model, where the
    probe leaves an expert of some layer unrouted under the trainer's router, sequences from a
    seeded sweep of the vocabulary are added, at most this many tokens, chosen to route the rest
    (``refit/serving_experts_covered`` of ``refit/serving_experts_total``; a WARNING where they
    cannot all be reached)."""
    serving_tolerance: float | None = None
    """Largest |Δ log-prob| per probe token between the engine and the trainer, to which each
    token adds a share of its logits' magnitude (``|its logit| + |the largest logit|`` times
    float32 1e-4, bfloat16 0.1, float16 0.02: the dtype's relative precision); null: by the
    engine's dtype (float32 1e-3, bfloat16 0.02, float16 0.01), plus 0.02 under
    ``trainer_quantize_fp8`` and 1e-3 with LoRA adapters. Beside each token the probe's bulk is
    judged: 90 % of its tokens must differ by at most 0.2 of their own tolerance (so this value
    scales both). The measured margins: docs/guide-serving.md."""
    swap_budget_mb: float | None = None
    """``swap: staged``: memory for the copy, in MiB; null: the whole model. With less, the
    tensors that fit (embedding and the first layers) are staged, and the refit writes the
    rest in place under the pause, which then starts when the first of them is written. vLLM:
    the staging buffers and the shadow together; a version whose shadow does not fit loads
    under the pause (named in the log)."""
    model: str | None = None
    """Preset of ``conversion.presets.PRESETS`` that the dry run and the cost model build
    the model from (no hub access). Not needed when training."""
    train_dp: int | None = None
    """Trainer data-parallel size for the dry run (at launch it follows from the world
    size). Default: the smallest that fits expert parallelism, ``ep*etp / gcd(tp, ep*etp)``."""

    def to_wire(self) -> dict[str, Any]:
        """The section as plain data for another process (an engine's ``init_info``, SGLang's
        ``connect``): every field, read back by :meth:`from_wire`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, value: Any, where: str) -> RefitConfig:
        """:meth:`to_wire`'s mapping, validated as the edge of the receiving process
        (``ValueError`` naming ``where``); the section is in force there (``enabled``)."""
        if not isinstance(value, dict):
            raise ValueError(f"{where}.refit must be the refit: config section as a mapping, "
                             f"got {type(value).__name__}")
        return cls.from_dict({**value, "enabled": True})

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> RefitConfig:
        """Validated config from a YAML mapping; ``ValueError`` names unknown keys and bad values."""
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise ValueError(f"refit: expected a mapping, got {type(d).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        for old, new in RENAMED.items():
            if old in d:
                raise ValueError(f"refit.{old} is now refit.{new}: write {new}: {d[old]}")
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"refit: unknown key(s) {unknown}; expected some of {names}")
        if isinstance(d.get("delta"), bool):  # YAML 1.1 reads `delta: off` / `on` as booleans
            d = {**d, "delta": "on" if d["delta"] else "off"}
        for key in ("overlap", "verify_serving", "fanout", "gen_dense_forward"):
            if isinstance(d.get(key), bool):
                d = {**d, key: "on" if d[key] else "off"}
        config = cls(**d)  # checked in __post_init__
        ignored = sorted(set(d) - {"enabled", "model", "train_dp"})
        if not config.enabled and ignored:
            warnings.warn(f"refit.enabled is false: {ignored} are ignored by training (dry runs still use them)",
                          stacklevel=2)
        return config

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for field in dataclasses.fields(self):
            check_type(field.name, getattr(self, field.name), hints[field.name])
        self.validate()

    def validate(self) -> None:
        """``ValueError`` naming the first bad value (also run on construction): :func:`.values.check_values`."""
        check_values(self)

    @property
    def serving_every(self) -> int | None:
        """``verify_serving`` as a cadence: check every N-th refit (None: never)."""
        if self.verify_serving == "off":
            return None
        if self.verify_serving == "on":
            return 1
        return AUTO_SERVING_EVERY if self.verify_serving == "auto" else self.verify_serving

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * (1 << 20))

    @property
    def direct_bytes(self) -> int | str:
        """``direct_mb`` in bytes, or ``"auto"`` (the transport picks)."""
        return "auto" if self.direct_mb is None else max(1, int(self.direct_mb * (1 << 20)))

    @property
    def replica_size(self) -> int:
        """Engine ranks of one replica (one deployment, one refit group): ``gen_tp * gen_attention_dp``.
        Engine rank ``gen_index`` is rank ``gen_index % replica_size`` of replica ``gen_index // replica_size``
        (``dp_rank * gen_tp + tp_rank`` inside it: vLLM's flattened expert-parallel rank)."""
        return self.gen_tp * self.gen_attention_dp

    def rank_name(self, rank: int) -> str:
        """Rank ``rank`` of a replica as the errors name it: ``TP rank 1``, or in a deployment of
        data-parallel ranks ``rank 3 (DP rank 1, TP rank 1)``."""
        if self.gen_attention_dp == 1:
            return f"TP rank {rank}"
        return f"rank {rank} (DP rank {rank // self.gen_tp}, TP rank {rank % self.gen_tp})"

    @property
    def gen_world_size(self) -> int:
        """Engine ranks of all ``gen_dp`` replicas: ``gen_tp * gen_attention_dp * gen_dp``."""
        return self.replica_size * self.gen_dp

    def gen_layout(self, num_experts: int = 0, num_expert_group: int | None = None) -> GenLayout:
        """The layout of the ``gen_dp`` replicas the job starts with (planning, costs), for a model
        of ``num_experts`` routed experts (its expert placement: :mod:`.deployment`)."""
        return deployment_layout(self, replicas=self.gen_dp, num_experts=num_experts,
                                 num_expert_group=num_expert_group).layout

    def replica_layout(self, num_experts: int = 0, num_expert_group: int | None = None) -> GenLayout:
        """One replica's layout: every replica, whatever its index (one that joins later
        too), holds the pieces of its rank in it."""
        return deployment_layout(self, replicas=1, num_experts=num_experts,
                                 num_expert_group=num_expert_group).layout

    @property
    def gen_style(self) -> str:
        """How the engine shards a tensor (:func:`~megatron_refit.plan.gen_layout.gen_targets`):
        the engine's :attr:`~megatron_refit.registry.Engine.layout`: ``full`` for ``hf``;
        ``vllm`` for vLLM and SGLang, whose parallel layers (fused ``qkv_proj`` /
        ``gate_up_proj``, FusedMoE ``w13`` / ``w2``, vocabulary padded to 64) shard alike
        (tests/engines/sglang checks SGLang's real model classes against this plan)."""
        return engine_named(self.engine).layout


def typed_section(value: Any, where: str) -> RefitConfig:
    """A trainer entry point's ``refit:`` section (``where``: the entry point), in force: a
    :class:`RefitConfig`, parsed once at the edge of the process (:meth:`RefitConfig.from_dict`,
    :func:`~megatron_refit.config.load_training_yaml`); anything else is a ``TypeError`` naming it."""
    if not isinstance(value, RefitConfig):
        raise TypeError(f"{where} takes the refit: section as a RefitConfig, parsed once where it is read "
                        f"(RefitConfig.from_dict(mapping), load_training_yaml(path)), got {type(value).__name__}")
    return refit_section(value, where)


def refit_section(value: Any, where: str) -> RefitConfig:
    """``value`` (a ``refit:`` mapping, parsed here: the edge of a process; or a ``RefitConfig``,
    valid since its construction and passed on as it is) as a validated, enabled config."""
    if isinstance(value, RefitConfig):
        return value if value.enabled else dataclasses.replace(value, enabled=True)
    return RefitConfig.from_wire(value, where)
