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
groups so every train rank holds the same answer.
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
        from megatron.core import parallel_state as ps

        seen = torch.zeros(batch, self.num_layers, self.num_experts, dtype=torch.int32)
        moe_layers = torch.zeros(self.num_layers, dtype=torch.int32)
        local = len(run.positions)
        tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        for layer_number, routing_map in self.maps:
            rows = routing_map.shape[0] // batch
            if rows == local:
                offset = 0
            elif rows * tp == local:  # sequence parallelism: this TP rank's slice of the positions
                offset = tp_rank * rows
            else:
                raise ValueError(f"layer {layer_number}'s router saw {routing_map.shape[0]} tokens, expected "
                                 f"{local} or {local // tp} positions x {batch} sequences")
            valid = torch.tensor([p < run.length for p in run.positions[offset:offset + rows]])
            routed = routing_map.cpu().view(rows, batch, self.num_experts)[valid].any(dim=0)
            seen[:, layer_number - 1] |= routed.to(torch.int32)
            moe_layers[layer_number - 1] = 1
        seen, moe_layers = seen.to(self.device), moe_layers.to(self.device)
        for group, size in ((ps.get_tensor_model_parallel_group(), tp),
                            (ps.get_context_parallel_group(), ps.get_context_parallel_world_size()),
                            (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size())):
            if size > 1:
                for t in (seen, moe_layers):
                    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        return seen.cpu().bool(), moe_layers.cpu().bool()
