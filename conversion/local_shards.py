"""HF-named local shards of this trainer rank, from Megatron-Bridge's conversion tasks.

For each conversion task whose parameter lives on this rank, the mapping's semantics
(column / row / replicated, QKV interleave, gated-MLP halves, EP expert numbering, vocab
padding) give the piece of each HF tensor that the local Megatron tensor holds, and a
getter for that piece. No gather, no collective: the PP name exchange that Bridge's task
builder does is replaced by this rank's own names (see :func:`local_conversion_tasks`).
"""

from __future__ import annotations

import copy
import itertools
import math
import threading
from dataclasses import dataclass
from collections.abc import Callable

import torch

from megatron_refit import families
from megatron_refit.plan.spec import Box, ShardSpec, box_along, full_box

from conversion import bridge_api
from conversion.te_shim import import_bridge

import_bridge()
from megatron.bridge.models.conversion import param_mapping as pm  # noqa: E402
from megatron.bridge.models.conversion.utils import extract_sort_key, persistent_buffers  # noqa: E402

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


class LocalSplitError(ValueError):
    """The local tensor cannot be split into HF pieces without data from other ranks."""


@dataclass(frozen=True)
class LocalShard:
    """This rank's piece of one HF parameter."""

    spec: ShardSpec
    megatron_name: str
    """Global Megatron parameter name the piece comes from."""
    get: Callable[[], torch.Tensor]
    """Returns the piece, shaped like ``spec.shape``, from the *current* parameter values
    (a view where the layout allows, else one copy of this rank's part)."""
    drop: Callable[[], None] | None = None
    """Drops any copy ``get`` made (QKV split): :meth:`release`."""
    follows: str | None = None
    """HF name of the piece this one starts right after in memory (up after gate of one
    fused weight; k after q, v after k of one QKV split): such runs can leave as one message."""
    optional: str | None = None
    """``"mtp"`` for a multi-token-prediction layer's piece (Megatron's ``mtp.layers.*``): an
    engine holds it only with an MTP draft, so where no engine rank holds it, it is skipped by
    name (``refit/skipped_params``)."""

    def tensor(self) -> torch.Tensor:
        return self.get()

    def release(self) -> None:
        """Drop any copy ``tensor()`` made; the endpoint calls it after each refit."""
        if self.drop is not None:
            self.drop()


def local_conversion_tasks(bridge, model: list, hf_config) -> list:
    """Bridge's conversion tasks for the parameters on this rank, built without collectives.

    ``build_conversion_tasks`` all-gathers parameter names over the PP group to order
    tasks identically on all stages (needed by its gathering export, not by us). We prime
    its cache with this rank's names, computed by Bridge's own local→global renaming, on a
    private copy of the model bridge.
    """
    model_bridge = copy.copy(bridge_api.model_bridge_of(bridge))
    config = model[0].config
    names = set()
    for vp_stage, chunk in enumerate(model):
        for local_name, _ in itertools.chain(chunk.named_parameters(), persistent_buffers(chunk)):
            if "_extra_state" in local_name:
                continue
            local_name = bridge_api.unwrap_name(model_bridge, local_name)
            global_name = bridge_api.local_name_to_global(model, config, local_name, vp_stage)
            if not bridge_api.is_adapter_param_name(model_bridge, global_name):
                names.add(global_name)
    bridge_api.prime_param_names(model_bridge, sorted(names, key=extract_sort_key))
    tasks = model_bridge.build_conversion_tasks(hf_config, model)
    return [t for t in tasks if t is not None and t.param_weight is not None]


def enumerate_local_shards(bridge, model: list, hf_config, tasks: list | None = None) -> list[LocalShard]:
    """One :class:`LocalShard` per HF parameter piece held by this rank."""
    if tasks is None:
        tasks = local_conversion_tasks(bridge, model, hf_config)
    vocab_size = hf_config.vocab_size
    shards: list[LocalShard] = []
    for task in tasks:
        shards.extend(task_shards(task, vocab_size=vocab_size, hf_config=hf_config))
    names = [s.spec.name for s in shards]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate HF names in local shards: {dup[:5]}")
    return shards


def mapping_kind(mapping, module) -> str:
    """'column' | 'row' | 'replicated', by Bridge's own detection for AutoMapping."""
    if isinstance(mapping, pm.ColumnParallelMapping):
        return "column"
    if isinstance(mapping, pm.RowParallelMapping):
        return "row"
    if isinstance(mapping, (pm.ReplicatedMapping, pm.DirectMapping)):
        return "replicated"
    if type(mapping) is pm.AutoMapping:
        if mapping.permute_dims is not None:
            raise LocalSplitError(f"{mapping.megatron_param}: AutoMapping with permute_dims has no local split")
        return bridge_api.parallelism_of(mapping, module)
    raise LocalSplitError(
        f"{mapping.megatron_param}: no local split for mapping {type(mapping).__name__}"
    )


def task_shards(task, *, vocab_size: int, hf_config=None) -> list[LocalShard]:
    """Local shards of one conversion task (this rank must hold the parameter); ``hf_config``
    tells which HF tensors are concatenations of segments (its family's table)."""
    mapping = task.mapping
    suffix = ""
    parts = bridge_api.suffix_parts(mapping)
    if parts is not None:  # FP8 *_scale_inv sibling of a weight
        suffix, mapping = parts
    weight = task.param_weight
    module = task.megatron_module
    meg_name = task.global_param_name
    tp_size, tp_rank = mapping.tp_size, mapping.tp_rank
    common = dict(pp_stage=mapping.pp_rank, is_expert=mapping.is_expert)
    dtype = str(weight.dtype).removeprefix("torch.")

    optional = "mtp" if meg_name.startswith("mtp.") else None

    def shard(name, global_shape, box, get, release=None, follows=None):
        spec = ShardSpec(name=name + suffix, global_shape=tuple(global_shape), dtype=dtype, box=box, **common)
        return LocalShard(spec=spec, megatron_name=meg_name, get=get, drop=release,
                          follows=None if follows is None else follows + suffix, optional=optional)

    if isinstance(mapping, pm.QKVMapping):
        kind = bridge_api.qkv_parallelism_of(mapping, module)
        if kind != "column":
            raise LocalSplitError(f"{meg_name}: QKV is {kind}-parallel; expected column")
        config = bridge_api.config_of(mapping, module)
        pieces = qkv_local_pieces(config, tp_size, tp_rank, weight)
        after = {"k": mapping.hf_param["q"], "v": mapping.hf_param["k"]}  # split_qkv_rows: [q; k; v]
        return [shard(mapping.hf_param[key], g, b, get, drop, after.get(key))
                for key, (g, b, get, drop) in pieces.items()]

    if isinstance(mapping, pm.GatedMLPMapping):
        # Column-parallel [gate_local; up_local] (Bridge splits gate and up separately).
        half = weight.shape[0] // 2
        global_shape = (half * tp_size, *weight.shape[1:])
        box = box_along(global_shape, 0, tp_rank * half, (tp_rank + 1) * half)
        return [
            shard(mapping.hf_param["gate"], global_shape, box, lambda w=weight, h=half: w.narrow(0, 0, h)),
            shard(mapping.hf_param["up"], global_shape, box, lambda w=weight, h=half: w.narrow(0, h, h),
                  follows=mapping.hf_param["gate"]),
        ]

    if hf_config is not None and (segments := families.segment_rows(str(mapping.hf_param), hf_config)) is not None:
        return segment_shards(shard, str(mapping.hf_param), segments, weight, tp_size, tp_rank)

    kind = mapping_kind(mapping, module)
    hf_name = str(mapping.hf_param)
    local_shape = tuple(weight.shape)
    if kind == "replicated" or tp_size == 1 or (kind == "row" and weight.ndim == 1):
        return [shard(hf_name, local_shape, full_box(local_shape), lambda w=weight: w)]
    dim = 0 if kind == "column" else 1
    n = local_shape[dim]
    global_shape = list(local_shape)
    global_shape[dim] = n * tp_size
    start, stop = tp_rank * n, (tp_rank + 1) * n
    if dim == 0 and meg_name in VOCAB_PARAMS and vocab_size < global_shape[0]:
        # Megatron pads the vocab to a multiple of (divisor * TP); HF has no padding rows.
        global_shape[0] = vocab_size
        stop = min(stop, vocab_size)
        if start >= stop:
            return []  # this rank holds only padding rows
    box = box_along(tuple(global_shape), dim, start, stop)
    if stop - start == n:
        get = lambda w=weight: w  # noqa: E731
    else:
        get = lambda w=weight, d=dim, k=stop - start: w.narrow(d, 0, k)  # noqa: E731
    return [shard(hf_name, global_shape, box, get)]


def segment_shards(shard, hf_name: str, segments, weight: torch.Tensor, tp_size: int, tp_rank: int) -> list:
    """A column-parallel tensor that is a concatenation of segments (Mamba's ``in_proj`` =
    [z, x, B, C, dt]): each segment is split over the TP ranks on its own, so the local
    tensor is ``[seg_0 local; seg_1 local; ...]``: one box per segment, several disjoint row
    ranges of the HF tensor. One shard per segment, a view of the local tensor each."""
    local = [rows // tp_size for _, rows in segments]
    if any(rows % tp_size for _, rows in segments) or sum(local) != weight.shape[0]:
        raise LocalSplitError(
            f"{hf_name}: local tensor of {weight.shape[0]} rows is not this rank's share of segments "
            f"{dict(segments)} at tensor-parallel size {tp_size}"
        )
    out, start, previous = [], 0, None
    for (segment, rows), n in zip(segments, local):
        name = families.segment_name(hf_name, segment)
        global_shape = (rows, *weight.shape[1:])
        box = box_along(global_shape, 0, tp_rank * n, (tp_rank + 1) * n)
        out.append(shard(name, global_shape, box, lambda w=weight, a=start, k=n: w.narrow(0, a, k), follows=previous))
        start, previous = start + n, name
    return out


def qkv_local_pieces(config, tp_size: int, tp_rank: int, qkv: torch.Tensor, feature_dim: int | None = None):
    """Split a local column-parallel fused QKV (weight, bias, FP8 scale tile or LoRA B matrix)
    into local q, k, v pieces, the row split of Bridge's ``split_qkv_weights`` /
    ``split_qkv_biases`` applied to this rank's head counts. Returns ``{key: (global_shape,
    box, getter, release)}``; the split is computed once for q, k and v and kept until all
    three were released. ``feature_dim`` is accepted for Bridge's signature: the split is by
    rows, whatever the trailing dims."""
    num_heads, num_groups = config.num_attention_heads, config.num_query_groups
    if getattr(config, "attention_output_gate", False):
        raise LocalSplitError("QKV with attention_output_gate has no local split here")
    if num_groups % tp_size or num_heads % tp_size:
        raise LocalSplitError(
            f"cannot split QKV locally: tensor-parallel size {tp_size} does not divide "
            f"num_query_groups={num_groups} / num_attention_heads={num_heads}, "
            "so no rank holds whole KV heads"
        )
    heads, groups = num_heads // tp_size, num_groups // tp_size
    rows_per_head = qkv.shape[0] // (heads + 2 * groups)
    tail = tuple(qkv.shape[1:])
    memo = _VersionMemo(lambda: split_qkv_rows(qkv, heads, groups))
    out = {}
    for index, (key, local_heads) in enumerate((("q", heads), ("k", groups), ("v", groups))):
        rows = local_heads * rows_per_head
        global_shape = (rows * tp_size, *tail)
        box = box_along(global_shape, 0, tp_rank * rows, (tp_rank + 1) * rows)
        out[key] = (global_shape, box, lambda i=index: memo.get(qkv, i), lambda i=index: memo.drop(i))
    return out


def split_qkv_rows(qkv: torch.Tensor, num_heads: int, num_groups: int):
    """``(q, k, v)`` of Megatron's interleaved fused QKV: rows are grouped per query group as
    ``[q heads of the group, k, v]``, each head ``rows_per_head`` rows; trailing dims any.
    Views where one group makes them contiguous, else one strided copy each into one new
    buffer ``[q; k; v]`` (back to back, as engines fuse them)."""
    per_group = num_heads // num_groups
    rows_per_head = qkv.shape[0] // (num_heads + 2 * num_groups)
    tail = tuple(qkv.shape[1:])
    grouped = qkv.view(num_groups, per_group + 2, rows_per_head, *tail)
    parts = (grouped[:, :per_group], grouped[:, per_group], grouped[:, per_group + 1])
    if num_groups == 1:
        return tuple(part.reshape(-1, *tail) for part in parts)
    out, start = [], 0
    buffer = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    with torch.no_grad():  # a copy of the weights, not a step of a computation
        for part in parts:
            rows = part.numel() // math.prod(tail)
            dst = buffer.narrow(0, start, rows)
            dst.view(part.shape).copy_(part)
            out.append(dst)
            start += rows
    return tuple(out)


class _VersionMemo:
    """Caches a derived value of a tensor until the tensor is modified in place. Thread-safe:
    a trainer refits its engine replicas from one thread each, over the same pieces."""

    def __init__(self, compute: Callable):
        self._compute = compute
        self._key = None
        self._value = None
        self._lock = threading.Lock()

    def get(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        key = (tensor.data_ptr(), tensor._version)
        with self._lock:
            if self._value is None or self._key != key or tensor.device.type == "meta" or \
                    self._value[index] is None:
                self._value, self._key = list(self._compute()), key
            return self._value[index]

    def drop(self, index: int) -> None:
        """Forget part ``index``; the whole value once every part was dropped."""
        with self._lock:
            if self._value is not None:
                self._value[index] = None
                if all(part is None for part in self._value):
                    self._key = self._value = None


def group_experts(shards: list[LocalShard], num_experts: int) -> list[LocalShard]:
    """Grouped view ``[E_local, ...]`` per projection per layer of per-expert shards.

    ``model.layers.L.mlp.experts.<e>.gate_proj.weight`` pieces of experts ``e0..e1`` on this
    rank become one piece of ``model.layers.L.mlp.experts.gate_proj.weight`` of global shape
    ``[num_experts, ...]`` with box ``[e0, e1)`` on dim 0. Its getter stacks the local
    experts (one copy of this rank's experts of that projection).
    """
    import re

    groups: dict[tuple[str, str], list[tuple[int, LocalShard]]] = {}
    for s in shards:
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", s.spec.name)
        if s.spec.is_expert and m:
            groups.setdefault((m.group(1), m.group(3)), []).append((int(m.group(2)), s))
    out = []
    for (prefix, suffix), members in groups.items():
        members.sort(key=lambda item: item[0])
        ids = [e for e, _ in members]
        first = members[0][1].spec
        if ids != list(range(ids[0], ids[0] + len(ids))) or any(
            s.spec.box != first.box or s.spec.global_shape != first.global_shape for _, s in members
        ):
            raise LocalSplitError(f"{prefix}.*.{suffix}: local experts {ids} do not form one box")
        box: Box = ((ids[0], ids[-1] + 1), *first.box)
        spec = ShardSpec(
            name=f"{prefix}.{suffix}",
            global_shape=(num_experts, *first.global_shape),
            dtype=first.dtype,
            box=box,
            pp_stage=first.pp_stage,
            is_expert=True,
        )
        getters = [s.get for _, s in members]
        out.append(
            LocalShard(spec=spec, megatron_name=f"{prefix}.*.{suffix}",
                       get=lambda g=getters: torch.stack([f() for f in g]), optional=members[0][1].optional)
        )
    return out
