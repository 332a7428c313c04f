"""Nemotron-H (hybrid Mamba2 / attention / MoE) built on CPU or the meta device through
Megatron-Bridge, and a pure-torch forward for Megatron's MambaMixer on CPU.

Bridge builds Nemotron-H as Megatron's ``HybridModel`` with Transformer Engine everywhere and
the CUDA / Triton Mamba kernels. Here (see FEASIBILITY "Nemotron-H on CPU"):

- ``mamba_ssm`` imports with stand-ins for its CUDA extensions (:mod:`conversion.mamba_shim`);
- :func:`configure_provider` turns off what needs CUDA or TE and installs
  :func:`local_hybrid_stack_spec` (Megatron's local hybrid spec, torch norms);
- :func:`build_context` is entered around the build: ``torch.cuda.current_device()`` answers
  "cpu" / "meta", the CUDA RNG tracker's ``fork`` is a no-op (MambaMixer forks it while it
  initialises its parameters) and HybridStack's final norm, hard-coded to ``TENorm``, is a
  torch norm;
- on a machine whose Mamba kernels cannot run, ``MambaMixer.forward`` is
  :func:`mixer_forward_cpu` (training / no-cache forward only).

Parameters and names are exactly Bridge's: the same mapping registry exports and loads them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from conversion.testing.families import cpu_device_for_buffers


def configure_provider(provider, *, meta: bool) -> None:
    """Nemotron-H provider settings for a CPU / meta build (after ``make_provider``'s common
    ones): what Nemotron's bridge turns on that needs CUDA or TE, off."""
    from megatron.core.transformer.enums import AttnBackend

    _require_mamba_ssm()
    provider.persist_layer_norm = False  # WrappedTorchNorm refuses it
    provider.first_last_layers_bf16 = False
    provider.moe_shared_expert_overlap = False  # CUDA streams
    provider.moe_grouped_gemm = False  # SequentialMLP, local linears
    provider.moe_permute_fusion = False
    provider.moe_token_dispatcher_type = "allgather"
    provider.attention_backend = AttnBackend.local
    provider.hybrid_stack_spec = local_hybrid_stack_spec
    if not meta and mixer_kernels_unavailable():
        install_cpu_mixer_forward()


def local_hybrid_stack_spec():
    """Megatron's local (non-TE) hybrid stack spec with local core attention; its norms
    (``modelopt.layers.Norm``, a TE wrapper) are ``WrappedTorchNorm``."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from conversion.bridge_api import hybrid_stack_local_spec

    return hybrid_stack_local_spec(WrappedTorchNorm)


@contextlib.contextmanager
def build_context(meta: bool):
    """Entered around ``provide_distributed_model``: the current device answers "cpu" /
    "meta" and the CUDA RNG tracker's fork is a no-op (both only without CUDA; build.py's
    :func:`~conversion.testing.build.cpu_forward` with :func:`~conversion.testing.families.cpu_device_for_buffers`
    inside it), and HybridStack's final norm is ``WrappedTorchNorm`` (the local spec's norm)."""
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from conversion.testing.build import cpu_forward

    saved_norm = hybrid_block.TENorm
    hybrid_block.TENorm = WrappedTorchNorm
    try:
        with cpu_forward(), cpu_device_for_buffers(meta):
            yield
    finally:
        hybrid_block.TENorm = saved_norm


def _require_mamba_ssm() -> None:
    from megatron.core.ssm import mamba_mixer

    if not mamba_mixer.HAVE_MAMBA_SSM:
        raise ImportError(
            "Nemotron-H needs mamba_ssm (Megatron's MambaMixer refuses to build without it): run "
            "make setup (installs mamba-ssm and causal-conv1d without their CUDA builds), and "
            "import megatron.bridge through conversion.te_shim.import_bridge"
        )


def mixer_kernels_unavailable() -> bool:
    """Whether Megatron's Mamba kernels cannot run here: no CUDA, or mamba_ssm's CUDA
    extensions are stand-ins."""
    from conversion import mamba_shim

    return not torch.cuda.is_available() or mamba_shim.active()


def install_cpu_mixer_forward() -> None:
    """``MambaMixer.forward`` := :func:`mixer_forward_cpu` (idempotent; Megatron's is kept as
    ``MambaMixer.megatron_forward``)."""
    from megatron.core.ssm.mamba_mixer import MambaMixer

    if MambaMixer.forward is not mixer_forward_cpu:
        MambaMixer.megatron_forward = MambaMixer.forward
        MambaMixer.forward = mixer_forward_cpu


def mixer_forward_cpu(self, hidden_states, inference_context=None, *, inference_params=None,
                      packed_seq_params=None):
    """Megatron's ``MambaMixer.forward`` (training / no-cache path) in plain torch, on this
    rank's heads and groups. ``hidden_states`` ``[seq, batch, hidden]``; returns
    ``(out, out_bias)`` of the mixer's row-parallel ``out_proj`` (which all-reduces over TP).

    What ``mamba_split_conv1d_scan_combined`` + ``self.norm`` compute: depthwise causal conv1d
    over [x, B, C] and SiLU; ``dt = softplus(dt + dt_bias)`` (no clamp: Megatron's
    ``dt_limit`` is (0, inf)); ``A = -exp(A_log)``; the sequential scan
    ``h = exp(dt*A) h + dt B x``, ``y = C.h + D x``; ``y * silu(z)``, then RMSNorm per group
    of ``d_inner / ngroups`` channels. Computed in float32, returned in the input dtype."""
    if inference_context is not None or inference_params is not None:
        raise NotImplementedError("mixer_forward_cpu: no inference cache (pass no inference context)")
    if packed_seq_params is not None:
        raise NotImplementedError("mixer_forward_cpu: no packed sequences")
    if self.cp.cp_size != 1:
        raise NotImplementedError(f"mixer_forward_cpu: no context parallelism (cp={self.cp.cp_size})")
    zxBCdt, _ = self.in_proj(hidden_states)  # [seq, batch, local z x B C dt]
    seq, batch, _ = zxBCdt.shape
    heads, groups, p, n = self.nheads_local_tp, self.ngroups_local_tp, self.headdim, self.d_state
    inner = self.d_inner_local_tp
    z, xBC, dt = zxBCdt.float().split([inner, inner + 2 * groups * n, heads], dim=-1)
    conv = F.conv1d(xBC.permute(1, 2, 0), self.conv1d_weight.float(), self.conv1d_bias.float(),
                    padding=self.d_conv - 1, groups=xBC.shape[-1])[..., :seq]  # causal: [batch, ch, seq]
    x, B, C = F.silu(conv).permute(2, 0, 1).split([inner, groups * n, groups * n], dim=-1)  # [seq, batch, .]
    x = x.reshape(seq, batch, heads, p)
    B = B.reshape(seq, batch, groups, n).repeat_interleave(heads // groups, dim=2)  # per head
    C = C.reshape(seq, batch, groups, n).repeat_interleave(heads // groups, dim=2)
    dt = F.softplus(dt + self.dt_bias.float())  # [seq, batch, heads]
    A = -torch.exp(self.A_log.float())
    D = self.D.float().reshape(heads, p) if self.D_has_hdim else self.D.float()[:, None]
    state = x.new_zeros(batch, heads, p, n)
    ys = []
    for t in range(seq):
        decay = torch.exp(dt[t] * A)[..., None, None]  # [batch, heads, 1, 1]
        state = state * decay + (dt[t, ..., None] * x[t])[..., None] * B[t, :, :, None, :]
        ys.append((state * C[t, :, :, None, :]).sum(-1) + D * x[t])
    y = torch.stack(ys).reshape(seq, batch, inner) * F.silu(z)
    if self.rmsnorm:
        g = y.reshape(seq, batch, groups, inner // groups)
        y = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + self.norm.eps)).reshape(seq, batch, inner)
        y = y * self.norm.weight.float()
    return self.out_proj(y.to(hidden_states.dtype))
