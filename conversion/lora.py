"""LoRA adapters (Megatron-Bridge PEFT) as HF-named local shards, without a gather.

Bridge wraps each targeted linear in a ``LoRALinear`` whose ``adapter`` holds ``linear_in``
(A, ``[rank, in]``) and ``linear_out`` (B, ``[out, rank]``). Their TP sharding, as Bridge
builds them: for a column-parallel base (``linear_qkv``, ``linear_fc1``) A is split along
the rank (dim 0) and B along the output rows like the base weight; for a row-parallel
base (``linear_proj``, ``linear_fc2``) A is split along its input columns (dim 1) and B along
its output rows. Names follow Bridge's adapter export: ``<hf base>.lora_A.weight`` /
``.lora_B.weight`` per HF projection (q, k and v share one A, as do gate and up).
The merged weight Bridge exports is ``base + (alpha / rank) * (B @ A)``, in float32.
"""

from __future__ import annotations

from megatron_refit.plan.spec import box_along

from conversion import bridge_api
from conversion.local_shards import (
    LocalShard,
    LocalSplitError,
    mapping_kind,
    local_conversion_tasks,
    pm,
    qkv_local_pieces,
)

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
WRAPPED = ".to_wrap.weight"


def apply_lora(model: list, *, dim: int, alpha: int, targets=TARGETS) -> list:
    """Wrap ``targets`` of ``model`` with Bridge's LoRA (trainable adapters, base frozen)."""
    import megatron.bridge.peft.utils as peft_utils
    from megatron.bridge.peft.lora import LoRA

    from conversion.te_shim import te_available

    if not te_available():
        # Without TE, megatron.core.extensions.transformer_engine still imports and Bridge sets
        # HAVE_TE from it, then isinstance() against its non-type placeholders fails.
        peft_utils.HAVE_TE = False
    return LoRA(target_modules=list(targets), dim=dim, alpha=alpha)(model, training=True)


def adapter_shards(bridge, model: list, hf_config) -> list[LocalShard]:
    """One LocalShard per HF-named adapter piece (A and B of every wrapped projection)."""
    out = []
    for task in local_conversion_tasks(bridge, model, hf_config):
        if not task.param_name.endswith(WRAPPED):
            continue
        wrapper = model[task.vp_stage or 0].get_submodule(task.param_name.removesuffix(WRAPPED))
        out += _task_adapter_shards(task, wrapper.adapter)
    return out


def _shard(name: str, shape: tuple, box, get, meg_name: str, pp_stage: int, release=None) -> LocalShard:
    from megatron_refit.plan.spec import ShardSpec

    spec = ShardSpec(name=name, global_shape=tuple(shape), dtype=str(get().dtype).removeprefix("torch."), box=box,
                     pp_stage=pp_stage)
    return LocalShard(spec=spec, megatron_name=meg_name, get=get, drop=release)


def _task_adapter_shards(task, adapter) -> list[LocalShard]:
    mapping = task.mapping
    if mapping.is_expert:
        raise LocalSplitError(f"{task.global_param_name}: LoRA on experts has no local split here")
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    tp, rank = mapping.tp_size, mapping.tp_rank
    meg = task.global_param_name.removesuffix(WRAPPED)
    stage = mapping.pp_rank
    lora = lambda hf, part: hf.removesuffix(".weight") + f".lora_{part}.weight"  # noqa: E731
    if isinstance(mapping, (pm.QKVMapping, pm.GatedMLPMapping)):
        kind = "column"
    else:
        kind = mapping_kind(mapping, task.megatron_module)
    if kind == "column":  # A split along the rank, B rows like the base weight
        a_shape = (a.shape[0] * tp, a.shape[1])
        a_box = box_along(a_shape, 0, rank * a.shape[0], (rank + 1) * a.shape[0])
        if isinstance(mapping, pm.QKVMapping):
            pieces = qkv_local_pieces(bridge_api.config_of(mapping, task.megatron_module), tp, rank, b,
                                      feature_dim=b.shape[1])
            return [s for key, (g, box, get, drop) in pieces.items() for s in (
                _shard(lora(mapping.hf_param[key], "A"), a_shape, a_box, lambda w=a: w, meg, stage),
                _shard(lora(mapping.hf_param[key], "B"), g, box, get, meg, stage, drop))]
        if isinstance(mapping, pm.GatedMLPMapping):
            half = b.shape[0] // 2
            b_shape = (half * tp, b.shape[1])
            b_box = box_along(b_shape, 0, rank * half, (rank + 1) * half)
            return [s for key, start in (("gate", 0), ("up", half)) for s in (
                _shard(lora(mapping.hf_param[key], "A"), a_shape, a_box, lambda w=a: w, meg, stage),
                _shard(lora(mapping.hf_param[key], "B"), b_shape, b_box,
                       lambda w=b, s=start, h=half: w.narrow(0, s, h), meg, stage))]
        b_shape = (b.shape[0] * tp, b.shape[1])
        b_box = box_along(b_shape, 0, rank * b.shape[0], (rank + 1) * b.shape[0])
    elif kind == "row":  # A split along its input columns, B along its output rows
        a_shape = (a.shape[0], a.shape[1] * tp)
        a_box = box_along(a_shape, 1, rank * a.shape[1], (rank + 1) * a.shape[1])
        b_shape = (b.shape[0] * tp, b.shape[1])
        b_box = box_along(b_shape, 0, rank * b.shape[0], (rank + 1) * b.shape[0])
    else:
        raise LocalSplitError(f"{task.global_param_name}: LoRA on a {kind} parameter has no local split here")
    hf = str(mapping.hf_param)
    return [_shard(lora(hf, "A"), a_shape, a_box, lambda w=a: w, meg, stage),
            _shard(lora(hf, "B"), b_shape, b_box, lambda w=b: w, meg, stage)]
