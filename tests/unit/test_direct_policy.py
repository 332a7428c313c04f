"""Which transfers skip packing (``direct_bytes``): each transport's own default, and on a
shipped MoE config the NCCL default sends as many messages as the cost model charges."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from megatron_refit.tools import dryrun
from megatron_refit.config import RefitConfig
from megatron_refit.endpoint.receiver import Receiver
from megatron_refit.endpoint.sender import Refitter
import torch

from megatron_refit.endpoint.direct import resolve_direct_bytes
from megatron_refit.plan.gen_layout import ModelShape, gen_target_specs
from megatron_refit.plan.refit_plan import RefitPlan
from megatron_refit.transport import ProcessGroupTransport
from megatron_refit.transport.ipc import IpcTransport

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _group(device: str, rank: int = 0) -> ProcessGroupTransport:
    """A ProcessGroupTransport's policy without a process group: what its buffers' device decides."""
    group = object.__new__(ProcessGroupTransport)
    group.device, group.rank, group.world_size = torch.device(device), rank, 2
    return group


def _ipc(device: str) -> IpcTransport:
    return IpcTransport(_group(device), num_train=1)


def test_auto_is_each_transports_own():
    gloo, nccl = _group("cpu"), _group("cuda")
    assert resolve_direct_bytes("auto", gloo, 64 << 20) == ProcessGroupTransport.HOST_DIRECT_BYTES == 1 << 20
    assert resolve_direct_bytes("auto", nccl, 64 << 20) == 64 << 20
    assert resolve_direct_bytes(4096, nccl, 64 << 20) == 4096
    assert resolve_direct_bytes(None, gloo, 64 << 20) is None
    for device in ("cpu", "cuda"):  # colocated: every item through the shared buffers
        assert resolve_direct_bytes("auto", _ipc(device), 64 << 20) is None
        assert resolve_direct_bytes(4096, _ipc(device), 64 << 20) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, "big", True])
@pytest.mark.parametrize("device", ["cpu", "ipc"])
def test_bad_direct_bytes_is_named(bad, device):
    group = _ipc("cpu") if device == "ipc" else _group(device)
    with pytest.raises(ValueError, match=f"direct_bytes must be a positive int, 'auto' or None, got {bad!r}"):
        resolve_direct_bytes(bad, group, 1 << 20)


def test_endpoints_resolve_before_any_collective():
    # constructors only: no group call is made before prepare()
    nccl = _group("cuda")
    assert Refitter(nccl, [], num_train=1, num_gen=1, bucket_bytes=8 << 20).direct_bytes == 8 << 20
    gloo = _group("cpu", rank=1)
    backend = SimpleNamespace(target_specs=lambda: [], buffer=None, finalize=None)
    assert Receiver(gloo, backend, num_train=1, num_gen=1, bucket_bytes=8 << 20).direct_bytes == 1 << 20
    assert Receiver(gloo, backend, num_train=1, num_gen=1, bucket_bytes=8 << 20, direct_bytes=None).direct_bytes \
        is None
    with pytest.raises(ValueError, match="got 0"):
        Refitter(nccl, [], num_train=1, num_gen=1, direct_bytes=0)


def test_config_direct_mb():
    assert RefitConfig.from_dict({"enabled": True}).direct_bytes == "auto"
    assert RefitConfig.from_dict({"enabled": True, "direct_mb": 16}).direct_bytes == 16 << 20
    with pytest.raises(ValueError, match="refit.direct_mb must be positive, got 0"):
        RefitConfig.from_dict({"enabled": True, "direct_mb": 0})
    with pytest.raises(ValueError, match="refit.direct_mb: expected float or null, got 'x'"):
        RefitConfig.from_dict({"enabled": True, "direct_mb": "x"})


def _shipped_plan(config: str, backend: str) -> tuple[RefitPlan, int]:
    """The runtime plan of a shipped config at full size (every rank's specs from the dry
    run's enumeration cache), as ``prepare()`` would build it on ``backend``; and its bucket size."""
    path = os.path.join(ROOT, "configs", f"{config}.yaml")
    run = dryrun.build(path, prepare=False)
    refit, preset, layout = dryrun.load_config(path)
    key = dryrun.cache_key(refit.model, preset, layout, "bfloat16")
    train_specs, _, params, _, _ = dryrun._targets(run.cache_path, key, refit, preset, layout, run.gen)
    model = ModelShape(num_attention_heads=preset["num_attention_heads"],
                       num_kv_heads=preset.get("num_key_value_heads") or preset["num_attention_heads"],
                       vocab_size=preset["vocab_size"], num_experts=dryrun.num_experts(preset))
    gen_specs = gen_target_specs(params, run.gen, model, style="vllm")
    bucket = refit.bucket_bytes
    direct = resolve_direct_bytes(refit.direct_bytes, _group("cuda" if backend == "nccl" else "cpu"), bucket)
    return RefitPlan.build(train_specs, gen_specs, bucket_bytes=bucket, direct_bytes=direct), bucket


@pytest.mark.slow
def test_nccl_default_sends_what_the_cost_model_charges():
    """Qwen3-30B-A3B, EP8xPP2 -> vLLM TP8xDP2, 512 MiB buckets, 301,872 transfers: with the
    NCCL default every pair's transfers fill ceil(bytes / bucket) buckets, the cost model's
    count (``megatron_refit.plan.cost.predict``); with the gloo default (1 MiB) the same plan takes
    6x as many messages."""
    nccl, bucket = _shipped_plan("qwen3-30b-a3b", "nccl")
    assert bucket == 512 << 20
    route_bytes: dict[tuple[int, int], int] = {}
    big: dict[tuple[int, int], int] = {}
    for t in nccl.transfers:
        pair = (t.src_rank, t.dst_rank)
        route_bytes[pair] = route_bytes.get(pair, 0) + t.nbytes
        big[pair] = big.get(pair, 0) + (t.nbytes >= bucket)
    messages: dict[tuple[int, int], int] = {}
    for b in nccl.buckets:
        messages[b.src_rank, b.dst_rank] = messages.get((b.src_rank, b.dst_rank), 0) + 1
    charged = {pair: -(-n // bucket) for pair, n in route_bytes.items()}
    # the packer's bound: full buckets, plus at most one cut per transfer of a bucket or more
    assert all(charged[p] <= messages[p] <= charged[p] + 2 * big[p] for p in charged)
    assert sum(messages.values()) == sum(charged.values()) == 288
    gloo, _ = _shipped_plan("qwen3-30b-a3b", "gloo")
    assert gloo.bytes_sent == nccl.bytes_sent
    assert len(gloo.buckets) == 1824
