"""Which experts the trainer's router sends each probe sequence to: the serving probe's expert
coverage (``refit.verify_serving``; :meth:`conversion.serving.MegatronForward.cover`).

A broken expert shows in what an engine serves only where a probe token is routed to it. With
``k`` of ``E`` experts per token, a random probe of ``n`` tokens misses an expert of a layer with
probability about ``(1 - k/E)**n``, so coverage is measured, not assumed: while a forward runs,
a hook on every decoder layer's Megatron router (``TopKRouter``; MTP layers left out, an engine
scoring the probe does not run them) keeps its ``routing_map`` (``[tokens, experts]``, tokens in
Megatron's sequence-major order), and :meth:`RoutedExperts.per_sequence` turns them into the
experts each sequence reached in each layer, over this rank's part of the sequence (its CP
positions, its sequence-parallel slice), the padding left out, united over the TP, CP and PP
groups so every train rank holds the same answer; :meth:`RoutedExperts.per_token` keeps, per scored
token, the (layer, expert) pairs its own position was routed to: what the calibrated check groups
the probe's differences by (a fault in one expert moves the tokens routed to it,
:mod:`megatron_refit.plan.calibration`).
"""

from __future__ import annotations

import contextlib

import torch


class RoutedExperts:
    """The routers of Megatron model chunks ``model`` and what they routed during :meth:`capture`."""

    def __init__(self, model: list, config):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers = getattr(config, "num_layers", 0)
        self.num_experts = getattr(config, "num_moe_experts", None) or 0
        self.topk = getattr(config, "moe_router_topk", None) or 0
        self.routers = [m for chunk in model for name, m in chunk.named_modules()
                        if isinstance(m, TopKRouter) and not getattr(m, "is_mtp_layer", False)
                        and not (name.startswith("mtp.") or ".mtp." in name)]
        self.maps: list[tuple[int, torch.Tensor]] = []
        self.device = next(model[0].parameters()).device
        """Where the reductions run (the model's device: CUDA under NCCL)."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @contextlib.contextmanager
    def capture(self):
        """While a forward runs: each router's ``(layer number, routing_map)``, in call order."""
        self.maps = []

        def keep(router, _args, output):
            self.maps.append((router.layer_number, output[1].detach()))

        handles = [router.register_forward_hook(keep) for router in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def per_sequence(self, run, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """After one captured :func:`conversion.forward.pipeline_forward` of ``batch`` sequences
        (``run``): ``(seen, moe_layers)``, ``seen[b, l, e]`` True where a token of sequence ``b``
        was routed to expert ``e`` of decoder layer ``l`` (0-based), ``moe_layers[l]`` True where
        layer ``l`` has a router; the same on every train rank (collective over TP, CP and PP)."""

        seen = torch.zeros(batch, self.num_layers, self.num_experts, dtype=torch.int32)
        moe_layers = torch.zeros(self.num_layers, dtype=torch.int32)
        for layer_number, routing_map in self.maps:
            rows, offset = _rows(layer_number, routing_map, run, batch)
            valid = torch.tensor([p < run.length for p in run.positions[offset:offset + rows]])
            routed = routing_map.cpu().view(rows, batch, self.num_experts)[valid].any(dim=0)
            seen[:, layer_number - 1] |= routed.to(torch.int32)
            moe_layers[layer_number - 1] = 1
        seen, moe_layers = seen.to(self.device), moe_layers.to(self.device)
        _unite(seen, moe_layers)
        return seen.cpu().bool(), moe_layers.cpu().bool()

    def per_token(self, run, batch: int) -> list[list[tuple[tuple[int, int], ...]]]:
        """After the same captured forward as :meth:`per_sequence`: per sequence, per scored token
        (positions ``0 .. run.length - 2``: the position whose output predicts the next token), the
        ``(layer, expert)`` pairs its position was routed to (the layer 0-based, as the HF names
        count), ascending, over every MoE layer; the same on every train rank (collective over TP,
        CP and PP: each position's routing is kept by the rank that ran it, ``-1`` elsewhere, and
        the groups take the maximum)."""
        top = max((int(m.sum(dim=1).max()) for _, m in self.maps if m.numel()), default=0)
        if top > self.topk:
            raise ValueError(f"a router sent one token to {top} experts, more than the model's moe_router_topk "
                             f"{self.topk}")
        picked = torch.full((batch, max(run.length - 1, 0), self.num_layers, self.topk), -1, dtype=torch.int32)
        for layer_number, routing_map in self.maps:
            rows, offset = _rows(layer_number, routing_map, run, batch)
            flags = routing_map.cpu().view(rows, batch, self.num_experts).to(torch.int32)
            values, experts = torch.topk(flags, self.topk, dim=-1)  # the routed experts first
            experts = torch.where(values > 0, experts + (layer_number - 1) * self.num_experts, -1).to(torch.int32)
            positions = torch.tensor(run.positions[offset:offset + rows], dtype=torch.long)
            scored = positions < run.length - 1
            picked[:, positions[scored], layer_number - 1] = experts[scored].transpose(0, 1)
        picked = picked.to(self.device)
        _unite(picked)
        flat = picked.cpu().view(batch, picked.shape[1], -1).tolist()
        experts = self.num_experts
        return [[tuple(divmod(e, experts) for e in sorted(token) if e >= 0) for token in sequence]
                for sequence in flat]


def _rows(layer_number: int, routing_map: torch.Tensor, run, batch: int) -> tuple[int, int]:
    """How many of ``run``'s positions a router's ``routing_map`` holds per sequence, and the first
    one's index in ``run.positions``: all of them, or under sequence parallelism this TP rank's slice."""
    from megatron.core import parallel_state as ps

    rows, local = routing_map.shape[0] // batch, len(run.positions)
    tp = ps.get_tensor_model_parallel_world_size()
    if rows == local:
        return rows, 0
    if rows * tp == local:
        return rows, ps.get_tensor_model_parallel_rank() * rows
    raise ValueError(f"layer {layer_number}'s router saw {routing_map.shape[0]} tokens, expected {local} or "
                     f"{local // tp} positions x {batch} sequences")


def _unite(*tensors: torch.Tensor) -> None:
    """Each of ``tensors`` (on the model's device) the element-wise maximum over the TP, CP and PP
    groups, in place."""
    from megatron.core import parallel_state as ps

    for group, size in ((ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()),
                        (ps.get_context_parallel_group(), ps.get_context_parallel_world_size()),
                        (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size())):
        if size > 1:
            for t in tensors:
                torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
