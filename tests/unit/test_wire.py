"""Metadata between refit ranks is plain JSON: what prepare() and colocated mode exchange
round-trips exactly, and bytes that are not refit metadata (a pickle, an unknown tag, a
spec outside its tensor) are refused by name instead of being executed or trusted."""

from __future__ import annotations

import pickle

import pytest
import torch

from megatron_refit import wire
from megatron_refit.plan.spec import ShardSpec, box_along


def test_what_prepare_exchanges_round_trips():
    spec = ShardSpec(name="model.layers.0.mlp.experts.3.up_proj.weight", global_shape=(64, 32), dtype="bfloat16",
                     box=box_along((64, 32), 0, 16, 32), pp_stage=1, is_expert=True)
    mine = ("train", [spec], "sampled", 1 << 20, None, [("a", "b")])
    prints = {"plan": "0123abcd", (0, 2): "ff", (1, 3): "ee"}
    for obj in (mine, prints, [("cpu", "psm_123", 4096)], None, b"\x00\xff", {"n": float("inf")}):
        back = wire.loads(wire.dumps(obj))
        assert back == obj and type(back) is type(obj)
    assert wire.loads(wire.dumps(mine))[1][0].box == ((16, 32), (0, 32))


def test_tensors_round_trip_bit_exactly():
    for t in (torch.randn(3, 5).to(torch.bfloat16), torch.arange(7, dtype=torch.int64), torch.empty(0, 4),
              torch.tensor([float("nan"), -0.0])):
        back = wire.loads(wire.dumps((t, t[:1])))[0]
        assert back.dtype == t.dtype and back.shape == t.shape
        assert torch.equal(back.view(torch.uint8) if t.numel() else back, t.view(torch.uint8) if t.numel() else t)


@pytest.mark.parametrize("data, match", [
    (pickle.dumps({"a": 1}), "not JSON"),
    (b'{"f": ["os.system", "echo hi"]}', "unknown tag 'f'"),
    (b'{"t": [1], "s": []}', "unexpected object"),
    (b'{"s": ["w", [4, 4], "float32", [[0, 8], [0, 4]], 0, false]}', "malformed 's' object.*outside global shape"),
    (b'{"x": ["Tensor", [1], ""]}', "unknown dtype 'Tensor'"),
    (b'{"d": [[[1, 2], 3]]}', "list as a dict key"),
])
def test_bytes_that_are_not_refit_metadata_are_refused(data, match):
    with pytest.raises(wire.WireError, match=match):
        wire.loads(data)


def test_only_plain_data_is_sent():
    with pytest.raises(TypeError, match="builtin_function_or_method cannot travel"):
        wire.dumps([print])
    with pytest.raises(TypeError, match="_TensorMeta cannot travel as refit metadata"):
        wire.dumps((torch.Tensor,))


def test_cuda_ipc_handle_travels_as_plain_data():
    """What ``reduce_tensor`` gives for a CUDA staging buffer (built here without a GPU) goes
    out without its classes and function, and comes back as the same rebuild arguments."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from megatron_refit.transport.ipc import cuda_handle, cuda_rebuild_args

    args = (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage, torch.uint8, 0, b"\x01" * 64,
            8192, 512, False, b"ref", 16, b"\x02" * 64, True)
    plain = cuda_handle((rebuild_cuda_tensor, args))
    assert cuda_rebuild_args(wire.loads(wire.dumps(plain))) == args
    with pytest.raises(TypeError, match="not a plain uint8"):
        cuda_handle((rebuild_cuda_tensor, (torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage,
                                           torch.float32, *args[6:])))
    with pytest.raises(ValueError, match="unexpected storage class 'os'"):
        cuda_rebuild_args([[4], [1], 0, "os", *args[6:]])
