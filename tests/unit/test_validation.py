"""Bad layouts and bad inputs: ValueErrors naming the culprit, before anything starts."""

from __future__ import annotations

import pytest

from conversion.presets import hf_config
from conversion.validate import check_train_layout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.transport import ProcessGroupTransport

pytestmark = pytest.mark.reliability


@pytest.mark.parametrize(
    "model,layout,match",
    [
        ("qwen3", TrainLayout(tp=3, dp=1), "num_attention_heads=4 is not divisible by train tp=3"),
        ("qwen3", TrainLayout(tp=4), "num_key_value_heads=2 is not divisible by train tp=4"),
        ("qwen3", TrainLayout(pp=3), "num_layers=2 does not split over pipeline_model_parallel_size=3"),
        ("qwen3", TrainLayout(pp=2, mtp_layers=1), r"mtp_num_layers=1 but the model has only 0 MTP layers"),
        ("qwen3-moe", TrainLayout(ep=3, dp=3), "num_experts=4 is not divisible by train ep=3"),
        ("qwen3", TrainLayout(ep=2, dp=2), "has expert parallelism but the model has no experts"),
    ],
)
def test_train_layout_that_does_not_divide_the_model(model, layout, match):
    with pytest.raises(ValueError, match=match):
        check_train_layout(hf_config(model), layout)


def test_layout_values():
    with pytest.raises(ValueError, match="TrainLayout.tp must be a positive int, got 0"):
        TrainLayout(tp=0)
    with pytest.raises(ValueError, match="not divisible by etp\\*ep=4"):
        TrainLayout(tp=1, dp=2, ep=4)


@pytest.mark.parametrize("kw,match", [
    (dict(rank=2, world_size=2), "refit rank 2 outside world of 2"),
    (dict(rank=0, world_size=1, backend="mpi"), "backend must be one of"),
    (dict(rank=0, world_size=1, timeout_s=0), "timeout_s must be positive"),
])
def test_refit_group_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ProcessGroupTransport.connect(host="127.0.0.1", port=1, **kw)


def test_endpoint_world_must_match_train_plus_gen():
    from megatron_refit.endpoint.sender import Refitter

    class Group:
        rank, world_size = 0, 3

    with pytest.raises(ValueError, match="refit group has 3 ranks but num_train=2 \\+ num_gen=2"):
        Refitter(Group(), [], num_train=2, num_gen=2)


def test_unknown_model_preset():
    with pytest.raises(ValueError, match="unknown model preset 'llama9'"):
        hf_config("llama9")


def test_cuda_harness_runs_colocated_only():
    from megatron_refit.local.harness import RunSpec

    with pytest.raises(ValueError, match="device 'cuda' runs colocated at train PP 1"):
        RunSpec(device="cuda")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        RunSpec(device="tpu")
    with pytest.raises(ValueError, match="device 'cuda' trains bf16 over NCCL .*one train rank on the one GPU: got 2"):
        RunSpec(device="cuda", colocated=True, dtype="bfloat16", train=TrainLayout(tp=2))
