"""The recipes' parallel settings end to end on CPU: Megatron train ranks (bf16, Megatron's
DistributedOptimizer, a real step before every refit) built with sequence parallelism, a virtual
pipeline, a list-form pipeline layout with an MTP layer, and context parallelism, refitting HF
engine replicas under ``verify_serving: auto``.

Each run is checked three ways:

- what Megatron built on every train rank is what :class:`TrainLayout` says (the layers each
  model chunk holds, its MTP layers, its CP coordinates, sequence parallelism): the setting is
  in the model, not dropped on the way (a test without it here would pass either way);
- every refit lands bit-exactly against Bridge's own ``export_hf_weights``, bytes sent = minimal;
- the serving check ran on every replica's first refit and the replica's log-probs equal the
  trainer's own forward (through every stage, virtual stage and CP rank).
"""

from __future__ import annotations

import pytest

from megatron_refit.families import is_mtp_param
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run

pytestmark = pytest.mark.slow

DSV3_LAYOUT = [["embedding", "decoder", "decoder"], ["decoder", "mtp", "loss"]]

COMMON = dict(dtype="bfloat16", lr=1e-3, verify_serving="auto", bucket_bytes=64 << 10, timeout_s=60.0)
CASES = {
    "tp2-pp2-sequence-parallel": RunSpec(model="qwen3", train=TrainLayout(tp=2, pp=2, sequence_parallel=True),
                                         refits=2, **COMMON),
    "pp2-vpp2": RunSpec(model="qwen3", overrides={"layers": 4}, train=TrainLayout(pp=2, vpp=2), refits=2, **COMMON),
    "deepseek-v3-mtp-list-layout": RunSpec(model="deepseek-v3", overrides={"num_nextn_predict_layers": 1},
                                           train=TrainLayout(pp=2, layout=DSV3_LAYOUT, mtp_layers=1), refits=2,
                                           **COMMON),
    # the fleet (two replicas) and delta refits on the CP layout
    "cp2-fleet-delta": RunSpec(model="qwen3", train=TrainLayout(cp=2), gen=GenLayout(tp=1, dp=2), delta="on",
                               refits=3, **COMMON),
}

NUM_LAYERS = {"tp2-pp2-sequence-parallel": 2, "pp2-vpp2": 4, "deepseek-v3-mtp-list-layout": 3, "cp2-fleet-delta": 2}


@pytest.mark.parametrize("case", list(CASES))
def test_recipe_setting_refits_bit_exact_and_serves(case):
    spec = CASES[case]
    results = run(spec)
    result = evaluate(spec, results)
    layout = spec.train
    chunks = layout.chunk_layers(NUM_LAYERS[case])
    mtp = layout.mtp_stages()
    train = [r for r in results if r["role"] == "train"]
    assert len(train) == layout.world_size
    for rank, out in enumerate(train):
        built, coords = out["parallel"], layout.coordinates(rank)
        assert (built["pp_rank"], built["cp_rank"], built["cp"]) == (coords["pp"], coords["cp"], layout.cp), rank
        assert built["layers"] == [list(chunks[coords["pp"], vp]) for vp in range(layout.num_chunks)], rank
        assert built["mtp"] == [mtp.get((coords["pp"], vp), 0) for vp in range(layout.num_chunks)], rank
        assert built["sequence_parallel"] == layout.sequence_parallel
        assert built["bytes_sent"] > 0, rank  # DP and CP replicas share the sending
    assert result["bit_exact"] is True
    for r in result["refits"]:
        assert r["bit_exact"] and r["bytes_full"] == r["bytes_minimal"] > 0, r["version"]
        assert r["bytes_sent"] == r["bytes_minimal"] or r["delta"], r["version"]
    first = result["refits"][0]["serving"]  # auto: every replica's first refit is checked
    assert first["checked"] == spec.gen.dp and 0 <= first["max_dlogprob"] <= 0.05, first
    assert result["max_logit_diff"] is not None and result["max_logit_diff"] < 0.1
    assert result["refits"][0]["loss"] != result["refits"][1]["loss"]  # real steps changed the weights
    if layout.mtp_layers:  # the MTP layer's parameters: skipped by name, counted, and only they
        export = next(t["refits"][0]["export"] for t in train if t["refits"][0]["export"] is not None)
        mtp_names = sorted(n for n in export if is_mtp_param(n, NUM_LAYERS[case]))
        assert mtp_names and result["skipped"] == mtp_names
        assert result["summary"]["num_skipped_params"] == len(mtp_names)
        assert all(r["skipped_params"] == len(mtp_names) for r in result["refits"])  # refit/skipped_params
    else:
        assert result["skipped"] == []
    if spec.delta == "on":  # deltas after the first refit, every replica landing them
        assert all(r["delta"] and r["bytes_sent"] < r["bytes_full"] for r in result["refits"][1:])
        assert all(r["replicas_ok"] == spec.gen.dp for r in result["refits"])
