"""What one end-to-end run does (:class:`RunSpec`), checked before any rank starts: the model, the
train and generation layouts, and the refit settings under test (:mod:`megatron_refit.local.harness`
runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    model: str = "qwen3"
    overrides: dict = field(default_factory=dict)
    train: TrainLayout = TrainLayout()
    gen: GenLayout = GenLayout()
    bucket_bytes: int = 1 << 20
    refits: int = 3
    dtype: str = "float32"
    megatron_port: int = 0
    collect: bool = True
    """Return weights and logits for checking (off in benchmarks)."""
    timeout_s: float = 120.0
    fp8: str = ""
    """``"trainer"``: trainer-side blockwise FP8 quantization of the linear weights."""
    offload: bool = False
    """Trainer parameters live in host memory between steps (loaded for each step and refit)."""
    colocated: bool = False
    """Bucket bytes through shared staging buffers (:mod:`megatron_refit.transport.ipc`)."""
    lora_rank: int = 0
    """> 0: the trainer trains LoRA adapters of this rank (Bridge PEFT); refit 1 moves base +
    adapters, later refits only the adapters (gen TP 1, the HF receiver merges)."""
    lora_alpha: int = 8
    device: str = "cpu"
    """``"cuda"``: train and generation ranks compute on the (one) GPU and share bucket bytes
    by CUDA IPC (colocated only: NCCL refuses two ranks on one GPU)."""
    progress: bool = False
    """A progress bar over the refits on train rank 0 (:mod:`megatron_refit.local.progress`: terminals only)."""
    lr: float = 1e-2
    """Learning rate of the step before each refit."""
    delta: str = "off"
    """``refit.delta``: ``on`` / ``auto`` send only the elements that changed since the last refit."""
    swap: str = "in_place"
    """``refit.swap``: ``staged`` streams into a copy while the engine serves, then swaps (gen TP 1)."""
    swap_budget_bytes: int | None = None
    """``refit.swap_budget_mb`` in bytes (None: the whole model)."""
    fail_replica: tuple[int, int] | None = None
    """``(replica, version)``: that engine replica's first rank raises while ``version`` lands (an
    engine error, as a CUDA fault would); run with ``refit.on_replica_failure: continue``, the
    other replicas land it and the next refit brings the replica back."""
    fail_rank: int = 0
    """The rank inside the replica (``dp_rank * tp + tp_rank`` of a deployment) that raises for
    :attr:`fail_replica`."""
    fanout: str = "off"
    """``refit.fanout``: the train ranks send to the chain's head, the replicas forward."""
    overlap: bool = False
    """``refit.overlap: on``: each refit sends from a snapshot in the background while the
    next step trains (the export checked against is taken at the step boundary)."""
    verify_serving: str | int = "off"
    """``refit.verify_serving``: replicas score the probe after a version lands (the HF engine in band)."""
    serving_tolerance: float | None = None
    verify: str = "sampled"
    """``refit.verify``: ``off`` also turns the HF engine's read-back of its live weights off, so that
    the serving check's log-probs alone judge the engine (and its draft)."""
    breaks: tuple[tuple[int, int, str], ...] = ()
    """``(replica, version, how)``: that replica's post-load step breaks the model while ``version``
    lands (:func:`~megatron_refit.local.faults.break_post_load`); the serving check must catch it."""
    traffic: bool = False
    """HF engine ranks answer one forward pass from a client thread each time a version goes live
    (:class:`~megatron_refit.local.traffic.Traffic`): each refit's ``traffic`` lists the versions
    those passes were answered with, or ``"refused"``."""
    remap: tuple[int, ...] = ()
    """Versions after which every deployment's experts move (an EPLB rebalance, seeded by the
    version: :func:`~megatron_refit.local.fused_engine.rebalanced`) while the engine serves: its
    balancer moves them in place (:class:`~megatron_refit.local.fused_engine.Balancer`, the moved
    slots' bytes scrambled), and the next refit must re-read the map and land in it."""
    remap_rejoin: bool = False
    """With :attr:`remap`: the engine ranks instead leave and rejoin with the new map (a new
    incarnation, as a restarted engine would)."""
    dense_forward: int = 0
    """``refit.gen_dense_forward: node`` with this many engine ranks a node (``gen_node_ranks``; 0: off)."""
    corrupt_forward: int | None = None
    """With :attr:`dense_forward`: this engine rank's (global index) forwarded rows are corrupted on
    the way to its peers at refit 2 (:func:`~megatron_refit.local.faults.corrupt_forwarded`): its
    deployment must fail by name, not serve them."""
    bad_map: int | None = None
    """With :attr:`remap` (in place): this replica's balancer reports, after each move, a map of
    other slots (two more redundant experts) than the refit was connected with: its next refit
    must fail by name before any byte moves, the others land."""
    draft: bool = False
    """The HF engine ranks decode with the model's MTP layers as a speculative draft
    (:class:`~megatron_refit.engines.hf.draft.MTPDraft`): the trainer's MTP layer lands there."""
    hold_refits: bool = False
    """``overlap``: each background refit starts (reads nothing) only once the next training
    step has changed the weights (the last one once training ends), so every refit provably
    overlaps a step."""

    def __post_init__(self) -> None:
        if self.draft and (self.gen.tp != 1 or self.wide):
            raise ValueError(f"draft: the HF engine holds an MTP draft (gen TP 1), got gen tp {self.gen.tp}"
                             f"{' (a wide deployment)' if self.wide else ''}")
        if self.fp8 not in ("", "trainer"):
            raise ValueError(f"fp8 must be '' or 'trainer', got {self.fp8!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and (not self.colocated or self.train.pp != 1):
            raise ValueError(f"device 'cuda' runs colocated at train PP 1 (every rank shares the one GPU; "
                             f"pipeline activations travel over gloo), got colocated={self.colocated}, "
                             f"pp={self.train.pp}")
        if self.device == "cuda" and self.dtype == "bfloat16" and self.num_train > 1 and not self.lora_rank:
            raise ValueError(f"device 'cuda' trains bf16 over NCCL (over gloo a rank died, SIGSEGV), one train rank "
                             f"on the one GPU: got {self.num_train}")
        if self.swap == "staged" and (self.gen.tp != 1 or self.lora_rank):
            raise ValueError(f"swap 'staged' runs with the HF receiver (gen TP 1, no LoRA), got gen tp {self.gen.tp}, "
                             f"lora rank {self.lora_rank}")
        if self.fail_replica is not None:
            replica, version = self.fail_replica
            if not 0 <= self.fail_rank < self.gen.deployment_size:
                raise ValueError(f"fail_rank {self.fail_rank} is not a rank of a replica of "
                                 f"{self.gen.deployment_size}")
            if not (0 <= replica < self.gen.dp and 1 <= version <= self.refits):
                raise ValueError(f"--fail-replica {replica}@{version}: the replica must be in 0..{self.gen.dp - 1} "
                                 f"(gen DP {self.gen.dp}) and the version in 1..{self.refits}")
        if self.remap and (self.gen.placement is None or self.fail_replica or self.breaks or self.overlap
                           or self.traffic or not all(1 <= v < self.refits for v in self.remap)):
            raise ValueError(f"remap {self.remap}: moves the experts of a deployment with a placement "
                             f"(gen.placement), between refits 1..{self.refits} (each version before the last), "
                             "without fail_replica, breaks, overlap or traffic")
        if self.corrupt_forward is not None and not (self.dense_forward and self.refits >= 2):
            raise ValueError(f"corrupt_forward {self.corrupt_forward}: needs dense_forward and refits >= 2")
        if self.bad_map is not None and not (self.remap and not self.remap_rejoin and 0 <= self.bad_map < self.gen.dp):
            raise ValueError(f"bad_map {self.bad_map}: a replica in 0..{self.gen.dp - 1} whose experts move in place "
                             "(remap without remap_rejoin)")
        if self.lora_rank and (self.gen.tp != 1 or self.fp8):
            raise ValueError(f"LoRA refit needs gen TP 1 without FP8 (the HF receiver merges), got gen tp "
                             f"{self.gen.tp}, fp8 {self.fp8!r}")

    @property
    def num_train(self) -> int:
        return self.train.world_size

    @property
    def num_gen(self) -> int:
        return self.gen.world_size

    def fails(self, gen_index: int, version: int) -> bool:
        """Whether engine rank ``gen_index``'s refit ``version`` is made to fail: its injected
        engine error (:attr:`fail_replica`; under :attr:`dense_forward` its node group's too), a
        map of other slots after a move (:attr:`bad_map`), or its deployment's forwarded rows
        corrupted (:attr:`corrupt_forward`)."""
        size = self.gen.deployment_size
        if self.fail_replica is not None:
            failing = self.fail_replica[0] * size + self.fail_rank
            group = (failing,)
            if self.dense_forward:  # its node group's peers are told its rows are not this version's
                from megatron_refit.plan.dense_forward import node_group

                group = node_group(failing, tp=self.gen.tp, attention_dp=self.gen.attention_dp,
                                   node_ranks=self.dense_forward)
            if gen_index in group:
                return version == self.fail_replica[1]
        if self.bad_map is not None and gen_index // size == self.bad_map:
            return any(v < version for v in self.remap)
        return self.corrupt_forward is not None and version == 2 and gen_index // size == self.corrupt_forward // size

    @property
    def failures_expected(self) -> bool:
        """A replica is made to fail a refit (``refit.on_replica_failure: continue``)."""
        return bool(self.fail_replica or self.breaks or self.bad_map is not None or self.corrupt_forward is not None)

    @property
    def wide(self) -> bool:
        """The engine replicas are wide expert-parallel deployments (the harness's ``fused`` engine)."""
        return self.gen.attention_dp > 1 or self.gen.placement is not None

    def gen_at(self, version: int, moe_layers: int) -> GenLayout:
        """The generation layout refit ``version`` lands in: :attr:`gen`, its placement rebalanced
        at the last of :attr:`remap` before ``version`` (``moe_layers``: the model's MoE layers)."""
        moved = [v for v in self.remap if v < version]
        if not moved:
            return self.gen
        from dataclasses import replace

        from megatron_refit.local.fused_engine import rebalanced

        return replace(self.gen, placement=rebalanced(self.gen.placement, moved[-1], layers=moe_layers))
