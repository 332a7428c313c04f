"""``swap: staged`` in vLLM: the staged version made servable beside the live model, so that the
pause covers a swap of references only (engine process; ``engine_load: load_weights``).

vLLM's layerwise reload (``initialize_layerwise_reload``, the model's ``load_weights``,
``finalize_layerwise_reload``) takes the live model's layers to the meta device, loads, runs each
layer's post-load step (on CPU: the oneDNN pre-pack of every linear layer, the experts' pre-pack
of fused MoE; on GPU: whatever ``process_weights_after_loading`` produces) and copies the result
back. The model serves nothing meanwhile: that is the 0.05–0.12 s of ``finish_weight_update`` the
pause had to cover.

:func:`prepare` runs the same steps of vLLM's, layer by layer, on a **shadow** of the model while
the live one serves: every module copied shallowly (its own parameter, buffer and child tables;
its ``quant_method`` copied, since the post-load step keeps state there: the MoE kernel), the
tensors its reload materializes new, and copies of its own of those vLLM's reload loads where
they are (``bias``): the live ones are never written. :meth:`Prepared.swap`, under the
client's pause, then hands each live module what its shadow holds: on CPU the tensor references
and the post-load step's own attributes (the pre-packed handles); on GPU the tensors are copied
into the live storage instead, as vLLM's own reload does, since CUDA graphs keep their addresses.

What cannot be prepared beside the live model is named (:class:`NotPreparableError`), and the worker
then loads that version under the pause, as before: an attention layer whose reload loads
tensors (KV-cache scales are processed with the live cache); a vLLM without the layerwise
reload; on a GPU, a post-load tensor whose shape, dtype or device differs from the live one (it
could only be swapped by reference, which CUDA graphs, holding the live address, would not see);
a shadow larger than ``refit.swap_budget_mb`` allows. The shadow's memory is reported
(:attr:`Prepared.nbytes`): one processed copy of the weights this rank loads, freed at the swap
(the old ones then go).

The GPU path (copies into the live storage, the budget, the synchronize after the swap) is
written for CUDA but has not yet run on a GPU: ``make gpu-check`` has no staged vLLM case yet.
"""

from __future__ import annotations

import copy
import time

import torch

_TABLES = ("_parameters", "_buffers", "_non_persistent_buffers_set")


class NotPreparableError(RuntimeError):
    """A staged version that cannot be made servable beside the live model (named why)."""


class _Pair:
    """A live module, its shadow, and what the shadow held when it was made (the live module's
    state then): :meth:`take_over` hands the live module only what the reload changed, so what
    the live module changed meanwhile (a cache it re-made while serving) stays."""

    def __init__(self, live: torch.nn.Module, shadow: torch.nn.Module):
        self.live, self.shadow = live, shadow
        self.before = dict(shadow.__dict__)
        self.tables = {table: copy.copy(shadow.__dict__[table]) for table in _TABLES}

    def reset_tables(self) -> None:
        """Not reloaded: the shadow's tables back to the live module's (nothing to take over)."""
        for table, start in self.tables.items():
            self.shadow.__dict__[table] = copy.copy(start)

    def take_over(self) -> None:
        old, now = self.live.__dict__, self.shadow.__dict__
        for table in ("_parameters", "_buffers"):
            start, target = self.tables[table], old[table]
            for name in [n for n in start if n not in now[table]]:
                target.pop(name, None)  # the post-load step removed it
            for name, tensor in now[table].items():
                if name in start and start[name] is tensor:
                    continue  # not reloaded
                kept = target.get(name)
                if (tensor is not None and kept is not None and tensor.is_cuda and kept.shape == tensor.shape
                        and kept.dtype == tensor.dtype and kept.device == tensor.device):
                    kept.data.copy_(tensor)  # CUDA graphs hold the live addresses
                else:
                    target[name] = tensor
        if now["_non_persistent_buffers_set"] != self.tables["_non_persistent_buffers_set"]:
            old["_non_persistent_buffers_set"] = set(now["_non_persistent_buffers_set"])
        for key, value in now.items():
            changed = key == "quant_method" or self.before.get(key, _NONE) is not value
            if key not in _TABLES and key != "_modules" and changed:
                old[key] = value  # the post-load step's attributes; the method object whose state it set
        for key in [k for k in self.before if k not in now and k not in _TABLES]:
            old.pop(key, None)


_NONE = object()


def graph_bound(tensor: torch.Tensor) -> bool:
    """A tensor whose address a captured CUDA graph may hold: one on a GPU."""
    return tensor.is_cuda


def check_copyable(pairs: list[_Pair], names: dict[int, str]) -> None:
    """On a GPU every tensor the swap hands a live module must be copied into the live storage
    (CUDA graphs replay the addresses they captured): ``NotPreparableError`` naming the first
    whose shape, dtype or device differs from the live tensor it replaces, or that has no live
    tensor to go into, before any swap."""
    for pair in pairs:
        now, start, live = pair.shadow.__dict__, pair.tables, pair.live.__dict__
        for table in ("_parameters", "_buffers"):
            for name, tensor in now[table].items():
                if tensor is None or (name in start[table] and start[table][name] is tensor):
                    continue  # not reloaded
                kept = live[table].get(name)
                if not (graph_bound(tensor) or (kept is not None and graph_bound(kept))):
                    continue
                if kept is None or (kept.shape, kept.dtype, kept.device) != (tensor.shape, tensor.dtype,
                                                                             tensor.device):
                    was = "none" if kept is None else f"{tuple(kept.shape)} {kept.dtype} on {kept.device}"
                    raise NotPreparableError(
                        f"vLLM layer {names.get(id(pair.shadow), '?')}: its post-load step made {name} "
                        f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device} where the live one is {was}: "
                        "it could only be swapped by reference, which CUDA graphs (holding the live address) "
                        "would not see")


class Prepared:
    """A staged version, processed, in a shadow of the live model; :meth:`swap` makes it live."""

    def __init__(self, pairs: list[_Pair], nbytes: int, seconds: float):
        self._pairs = pairs
        self.nbytes = nbytes
        """Bytes of the tensors the shadow's reload made (the staging copy's processed weights)."""
        self.seconds = seconds
        """Time the preparation took, beside the serving model."""

    def modules(self) -> frozenset[int]:
        """The ids of the live modules this version swaps."""
        return frozenset(id(pair.live) for pair in self._pairs)

    def joined(self, other: Prepared) -> Prepared:
        """This version and ``other`` (another model's: vLLM's draft) as one swap."""
        return Prepared(self._pairs + other._pairs, self.nbytes + other.nbytes, self.seconds + other.seconds)

    @torch.no_grad()
    def swap(self) -> float:
        """Each live module takes its shadow's tensors and post-load attributes; returns seconds."""
        t0 = time.perf_counter()
        for pair in self._pairs:
            pair.take_over()
        self._pairs = []
        return time.perf_counter() - t0


def _shadow(model: torch.nn.Module) -> tuple[torch.nn.Module, list[_Pair]]:
    """A shallow copy of ``model``'s module tree (tied modules stay tied) and its (live, shadow) pairs."""
    memo: dict[int, torch.nn.Module] = {}
    pairs: list[_Pair] = []

    def copy_module(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        shadow = copy.copy(module)
        memo[id(module)] = shadow
        for table in _TABLES:
            shadow.__dict__[table] = copy.copy(module.__dict__[table])
        if module.__dict__.get("quant_method") is not None:
            shadow.__dict__["quant_method"] = copy.copy(module.__dict__["quant_method"])
        shadow.__dict__["_modules"] = {k: None if c is None else copy_module(c) for k, c in module._modules.items()}
        pairs.append(_Pair(module, shadow))
        return shadow

    return copy_module(model), pairs


def _own_copies(pair: _Pair, never_loaded: set[str]) -> None:
    """vLLM's reload keeps some tensors where they are instead of restoring them on the meta
    device (``bias``) and loads into them: the shadow's must be copies of its own, or the staged
    version would be written into the serving model."""
    shared = {id(t) for table in ("_parameters", "_buffers") for t in pair.tables[table].values()}
    layer = pair.shadow
    for table in ("_parameters", "_buffers"):
        for name, tensor in layer.__dict__[table].items():
            if tensor is None or id(tensor) not in shared or name in never_loaded or tensor.is_meta:
                continue
            own = tensor.detach().clone()
            own.__class__ = tensor.__class__
            own.__dict__ = {key: value.__func__.__get__(layer) if getattr(value, "__self__", None) is pair.live
                            else value for key, value in tensor.__dict__.items()}  # its loader bound to the shadow
            layer.__dict__[table][name] = own


def _meta(recorded: torch.Tensor, layerwise) -> torch.Tensor:
    """A meta tensor of the shadow's own, from what vLLM recorded for the live layer, with vLLM's
    own loader: an earlier reload of the live model left its layerwise wrapper (which loads into
    the live layer) on the recorded tensor."""
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor

    meta = to_meta_tensor(recorded)
    original = layerwise._get_original_loader(meta)  # through vLLM parameters' loader property too
    if layerwise._get_weight_loader(meta) is not original:
        meta.weight_loader = original
    return meta


def shadow_estimate(model: torch.nn.Module) -> int:
    """Bytes a shadow of ``model`` makes: about one processed copy of its weights."""
    return sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta)


@torch.no_grad()
def prepare(model: torch.nn.Module, load, *, first_load_setup, budget_bytes: int | None = None,
            shared: frozenset[int] = frozenset()) -> Prepared:
    """Run vLLM's layerwise load of the staged version (``load(shadow)`` feeds it to the shadow's
    ``load_weights``) on a shadow of ``model``, never touching the live tensors; ``NotPreparableError``
    names what cannot be. ``first_load_setup``: the MoE experts' post-load step (moe_reload).
    ``budget_bytes`` (``refit.swap_budget_mb`` less the staging buffers; None: no bound): a shadow
    estimated larger is not made (the version loads under the pause). ``shared``: ids of live
    modules another prepared version swaps (vLLM's draft shares the model's embedding and LM
    head): ``load`` must load none of them, and this version does not swap them."""
    t0 = time.perf_counter()
    if budget_bytes is not None and (need := shadow_estimate(model)) > budget_bytes:
        raise NotPreparableError(f"its shadow would take about {need / 2**20:.1f} MiB, over the "
                                 f"{max(budget_bytes, 0) / 2**20:.1f} MiB refit.swap_budget_mb leaves beside the "
                                 "staging buffers")
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, restore_layer_on_meta
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    except ImportError as exc:
        raise NotPreparableError(f"this vLLM has no layerwise reload to run beside the live model ({exc})") from exc
    shadow, pairs = _shadow(model)
    loaded = 0
    names = {id(s): name for name, s in shadow.named_modules()}
    for pair in pairs:
        layer, recorded = pair.shadow, layerwise.get_layerwise_info(pair.live)
        params, buffers = recorded.restore_metadata  # the checkpoint format, as vLLM recorded it at load
        info = LayerReloadingInfo(restore_metadata=({n: _meta(t, layerwise) for n, t in params.items()},
                                                    {n: _meta(t, layerwise) for n, t in buffers.items()}),
                                  restore_device=recorded.restore_device)
        layerwise.LAYERWISE_INFO[layer] = info
        restore_layer_on_meta(layer, info)  # kernel_tensors stay None: processed tensors are the shadow's own
        _own_copies(pair, SKIP_LOAD_TENSORS)
        layerwise.initialize_online_processing(layer)
    made = 0
    try:
        with first_load_setup(shadow):
            load(shadow)
            for pair in pairs:
                layer = pair.shadow
                info = layerwise.get_layerwise_info(layer)
                loaded += not info.can_load() or bool(info.loaded_weights)  # processed, or partly loaded
                if not info.can_load():
                    continue  # processed as its last weight arrived
                if info.load_numel <= 0:  # not reloaded: the live tensors stay
                    pair.reset_tables()
                elif is_deferred_attention_layer(layer):
                    raise NotPreparableError(f"vLLM layer {names[id(layer)]}: an attention layer whose reload "
                                             "loads tensors (KV-cache scales) is processed with the live KV cache")
                else:  # some elements never loaded (padding): processed now, as vLLM's finalize does
                    layerwise._layerwise_process(layer, info)
                info.reset()
    finally:
        for pair in pairs:
            layerwise.LAYERWISE_INFO.pop(pair.shadow, None)
    if not loaded:
        raise RuntimeError("swap: staged: the shadow of the vLLM model loaded none of the staged weights")
    pairs = [pair for pair in pairs if id(pair.live) not in shared]
    check_copyable(pairs, names)
    for pair in pairs:
        kept = {id(t) for table in ("_parameters", "_buffers") for t in pair.tables[table].values()}
        made += sum(t.nbytes for t in list(pair.shadow._parameters.values()) + list(pair.shadow._buffers.values())
                    if t is not None and id(t) not in kept)
    return Prepared(pairs, made, time.perf_counter() - t0)
