"""ParamOffloader: parameters keep their identity, lose their storage while offloaded, and
come back bit for bit."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.endpoint.offload import ParamOffloader


def test_offload_round_trip():
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    params = list(layer.parameters())
    off = ParamOffloader(params)
    off.offload()
    assert off.offloaded and all(p.numel() == 0 for p in params)
    assert list(layer.parameters()) == params  # same Parameter objects (optimizer, local shards)
    with pytest.raises(RuntimeError, match="already offloaded"):
        off.offload()
    off.onload()
    assert not off.offloaded
    for n, p in layer.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, before[n])
    with pytest.raises(RuntimeError, match="not offloaded"):
        off.onload()
    with pytest.raises(ValueError, match="at least one parameter"):
        ParamOffloader([])
