"""megatron_refit.local.faults.break_post_load refuses a break it could not make real."""

import pytest

from megatron_refit.plan.spec import ShardSpec, full_box
from megatron_refit.local.faults import break_post_load


class _Storage:
    """What break_post_load reads of an HF storage: the names and dtypes the refit writes."""

    def __init__(self, dtype: str):
        shape = (4, 4)
        weight = "model.layers.0.mlp.down_proj.weight"
        self.specs = [ShardSpec(name=n, global_shape=shape, dtype=d, box=full_box(shape))
                      for n, d in ((weight, dtype), (weight + "_scale_inv", "float32"))]

    def target_specs(self):
        return self.specs

    def finalize(self):
        pass

    def set_state(self, state, version):
        pass


def test_a_stale_tensor_break_on_an_fp8_weight_is_refused_not_a_silent_no_op():
    """An FP8 weight lands in a staging buffer and is dequantized after the load: putting the
    staged bytes back would leave the live weight right, and the test that uses it would pass
    without a fault to catch."""
    with pytest.raises(ValueError, match=r"stale_tensor needs .*\(FP8: staged"):
        break_post_load(_Storage("float8_e4m3fn"), "stale_tensor", [False])
    break_post_load(_Storage("bfloat16"), "stale_tensor", [False])  # a live bf16 weight: armed
    with pytest.raises(ValueError, match="is not one of"):
        break_post_load(_Storage("bfloat16"), "nan_expert", [False])
