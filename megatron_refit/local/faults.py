"""Faults injected on purpose (tests, the demo, benchmarks): an engine error while a refit lands,
a slow train rank, a slow link, a background refit held until the next training step, forwarded
rows corrupted on the way."""

from __future__ import annotations

import re
import threading
import time

import torch


def fail_next_refit(storage, *, at_call: int = 2) -> None:
    """``storage.buffer`` raises an engine error (a ``RuntimeError``) on its ``at_call``-th call
    from now (the next refit's bytes have started landing by then), once; then it is the
    storage's own again."""
    buffer, calls = storage.buffer, [0]

    def failing(name):
        calls[0] += 1
        if calls[0] == at_call:
            storage.buffer = buffer
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return buffer(name)

    storage.buffer = failing


def slow_next_refit(pieces: list, seconds: float) -> None:
    """A train rank's ``pieces`` (``spec`` + ``tensor()``) take ``seconds`` to read at the next
    refit, once (at the first read): a slow train rank, whose sends start late while the
    engine's update is open."""
    import time

    reads = {id(piece): piece.tensor for piece in pieces}

    def restore() -> None:
        for piece in pieces:  # pieces may be frozen dataclasses
            object.__setattr__(piece, "tensor", reads[id(piece)])

    def slow(piece):
        def read(*args, **kwargs):
            restore()
            time.sleep(seconds)
            return reads[id(piece)](*args, **kwargs)

        return read

    for piece in pieces:
        object.__setattr__(piece, "tensor", slow(piece))


def slowed(group, delay_s: float) -> None:
    """Every bucket ``group`` sends waits ``delay_s`` first (a slow link)."""
    isend = group.isend

    def slow(buffer, peer, tag):
        time.sleep(delay_s)
        return isend(buffer, peer, tag)

    group.isend = slow


class HoldRefits:
    """``refit.overlap`` (``RunSpec.hold_refits`` of the harness, the overlap tests): the
    background refit of version ``v`` of the fleet ``fleet`` reads and sends nothing before
    step ``v + 1`` has finished (:meth:`stepped`), so that every refit provably overlaps a
    training step (at most ``timeout_s`` each)."""

    def __init__(self, fleet, timeout_s: float):
        self.timeout_s = timeout_s
        self.cond, self.steps = threading.Condition(), 0
        start = fleet.background.start  # what runs each refit in the background lane

        def held_start(version, prepare, run, **kw):
            def held():
                with self.cond:
                    self.cond.wait_for(lambda: self.steps > version, timeout=self.timeout_s)
                return run()

            return start(version, prepare, held, **kw)

        fleet.background.start = held_start

    def stepped(self, step: float) -> None:
        with self.cond:
            self.steps = step
            self.cond.notify_all()


BREAKS = ("permute_experts", "scale_expert", "unload_layer", "stale_scale", "stale_tensor", "stale_draft",
          "unload_draft")
"""Ways :func:`break_post_load` breaks an engine's post-load step (the serving check must catch
each): the first MoE layer's experts 0 and 1 swapped after the load; its expert 0's down
projection x1.05; the first decoder layer left
as it was before the refit (not loaded); one FP8 weight dequantized with the last refit's
``weight_scale_inv`` (stale); one weight (the first layer's MLP down projection, of expert 0 in a
MoE layer) put back as it was before the refit after the load (one version stale); the speculative
draft's ``eh_proj`` (its MTP layer's, #67) put back the same way: a draft left a version behind; the
draft's whole MTP layer left as it was before the refit (an engine whose load skips its draft, as
vLLM's RFC #48296 met: at the first refit, the draft serves what the engine started with)."""


def break_post_load(storage, how: str, armed: list[bool]) -> None:
    """While ``armed[0]`` is set, the post-load step (``finalize``) of ``storage`` (an
    :class:`~megatron_refit.engines.hf.storage.HFStorage`) breaks the model as ``how`` says
    (:data:`BREAKS`); the bytes the refit wrote are right, the model the engine computes with is not."""
    if how not in BREAKS:
        raise ValueError(f"break_post_load: {how!r} is not one of {list(BREAKS)}")
    finalize, set_state = storage.finalize, storage.set_state
    specs = {spec.name: spec for spec in storage.target_specs()}  # what the refit writes (buffer(name))
    names = sorted(specs)
    stale = next((n for n in names if re.search(r"layers\.0\.mlp\.(experts\.0\.)?down_proj", n)), None)
    if how == "stale_tensor" and (stale is None or specs[stale].dtype.startswith("float8")):
        # an FP8 weight lands in a staging buffer, dequantized into the live one after the load:
        # putting the staged bytes back would leave what the engine computes with unbroken
        raise ValueError(f"break_post_load: stale_tensor needs the first layer's MLP down projection as a live "
                         f"weight the refit writes, got {stale!r}"
                         f"{' (FP8: staged; stale_scale breaks an FP8 engine)' if stale else ''}")
    draft = next((n for n in names if n.endswith(".eh_proj.weight")), None)
    if how in ("stale_draft", "unload_draft") and draft is None:
        raise ValueError(f"break_post_load: {how} needs an engine with an MTP draft (an eh_proj weight the "
                         f"refit writes), got none among {len(names)} targets")
    kept = {"stale_tensor": stale, "stale_draft": draft}.get(how)
    layer = f"model.layers.{storage.draft.first}." if how == "unload_draft" else "model.layers.0."
    before: dict = {}
    scales: dict = {}

    def snapshot(state, version):  # before the refit writes: the layer (or one weight) as it is
        if state == "updating" and armed[0] and how in ("unload_layer", "unload_draft"):
            model = storage.draft if how == "unload_draft" else storage.model
            before.update({n: t.detach().clone() for n, t in model.state_dict().items() if n.startswith(layer)})
        if state == "updating" and armed[0] and kept is not None:
            before[kept] = storage.buffer(kept).detach().clone()
        set_state(state, version)

    def broken():
        if armed[0] and how == "stale_scale":
            name = next(n for n in names if n.endswith("weight_scale_inv") and n in scales)
            storage.buffer(name).copy_(scales[name])
        scales.update({n: storage.buffer(n).clone() for n in names if n.endswith("weight_scale_inv")})
        finalize()
        if not armed[0]:
            return
        params = dict(storage.model.state_dict(keep_vars=True))
        if how == "permute_experts":
            for name in (f"{layer}mlp.experts.gate_up_proj", f"{layer}mlp.experts.down_proj"):
                params[name].data[[0, 1]] = params[name].data[[1, 0]].clone()
        elif how == "scale_expert":
            params[f"{layer}mlp.experts.down_proj"].data[0] *= 1.05
        elif how in ("unload_layer", "unload_draft"):
            params = dict((storage.draft if how == "unload_draft" else storage.model).state_dict(keep_vars=True))
            for name, old in before.items():
                params[name].data.copy_(old)
        elif kept is not None:
            for name, old in before.items():
                storage.buffer(name).data.copy_(old)

    storage.set_state, storage.finalize = snapshot, broken


def corrupt_forwarded(group, armed: list[bool], *, num_train: int) -> None:
    """While ``armed[0]``: every piece of dense rows this engine rank forwards to a peer
    (``refit.gen_dense_forward``: an engine rank's send to another) arrives with its first byte
    flipped, as a bad link would deliver it; its digest is the true one."""
    from megatron_refit.endpoint.stages import DIGEST_TAG

    isend = group.isend

    def corrupting(buffer, peer, tag):
        if armed[0] and peer >= num_train and buffer.numel() and tag < DIGEST_TAG:
            buffer = buffer.clone()
            buffer.view(-1).view(torch.uint8)[0] ^= 0xFF
        return isend(buffer, peer, tag)

    group.isend = corrupting
