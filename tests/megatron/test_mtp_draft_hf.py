"""#67: the trainer's MTP layer refitted into the engine's speculative draft, bit for bit: a tiny
DeepSeek-V3 with one MTP layer, Megatron TP2 with sequence parallelism and PP2 under the
recipe's pipeline layout (the MTP layer on the last stage, before the loss), bf16, into an HF
engine that holds the MTP layer as its draft (:class:`~megatron_refit.engines.hf.draft.MTPDraft`).
Every refit lands the draft with the main model (each against Bridge's ``export_hf_weights``), no
parameter is skipped, and the draft's weights move between refits as the trainer's do; an engine
with a draft whose trainer has no MTP layer is refused at start by name; a draft its engine leaves a
version behind after the load is caught by the serving check on that replica alone."""

from __future__ import annotations

import pytest
import torch

from megatron_refit.families import is_mtp_param
from megatron_refit.plan.gen_layout import GenLayout
from megatron_refit.plan.layout import TrainLayout
from megatron_refit.local.evaluate import evaluate
from megatron_refit.local.harness import RunSpec, run

pytestmark = pytest.mark.slow

DSV3_LAYOUT = [["embedding", "decoder", "decoder"], ["decoder", "mtp", "loss"]]
"""The recipe's list form: three decoder layers over two stages, the MTP layer on the last."""
MTP = {"num_nextn_predict_layers": 1}
LAYERS = 3


@pytest.mark.parametrize("delta,swap", [("off", "in_place"), ("on", "in_place"), ("off", "staged")])
def test_the_trainers_mtp_layer_lands_in_the_engines_draft_bit_exact(delta, swap):
    """``delta: on``: after the first refit only the elements that changed move, the draft's with the
    main model's (its copies kept like theirs), still bit for bit. ``swap: staged``: each version
    streams into a copy of the model and its draft while they serve, and the swap moves both."""
    spec = RunSpec(model="deepseek-v3", overrides=MTP, train=TrainLayout(tp=2, pp=2, sequence_parallel=True,
                                                                          layout=DSV3_LAYOUT, mtp_layers=1),
                   draft=True, dtype="bfloat16", lr=1e-3, refits=2 if delta == "off" else 3, delta=delta,
                   swap=swap, bucket_bytes=64 << 10, timeout_s=120.0)
    results = run(spec)
    result = evaluate(spec, results)
    if delta == "on":  # refits 2 and 3 sent deltas: less than the full bytes, the draft's included
        assert [r["delta"] for r in result["refits"]] == [False, True, True]
        assert all(r["bytes_sent"] < r["bytes_full"] for r in result["refits"][1:])
    train = [r for r in results if r["role"] == "train"]
    exports = [next(t["refits"][i]["export"] for t in train if t["refits"][i]["export"] is not None)
               for i in range(spec.refits)]
    mtp = sorted(n for n in exports[0] if is_mtp_param(n, LAYERS))
    assert len(mtp) > 20 and "model.layers.3.eh_proj.weight" in mtp  # a full decoder layer and its MTP parts
    assert result["skipped"] == [] and result["summary"]["num_skipped_params"] == 0  # nothing skipped by name
    assert all(r["skipped_params"] == 0 for r in result["refits"])
    assert result["bit_exact"] is True and all(r["bit_exact"] for r in result["refits"])  # the draft's names too
    gen = next(r for r in results if r["role"] == "gen")
    for i, export in enumerate(exports):
        weights = gen["refits"][i]["weights"]
        assert set(mtp) <= set(weights)
        assert all(weights[n].equal(export[n]) for n in mtp), f"refit {i + 1}: the draft is not the trainer's MTP layer"
    moved = [n for n in mtp if not exports[0][n].equal(exports[1][n])]
    assert moved, "the trainer's MTP layer did not train between the refits: the test could not see a stale draft"


FP8_GRID = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=32,
                qk_rope_head_dim=32, v_head_dim=32, head_dim=32, q_lora_rank=128, kv_lora_rank=128,
                intermediate_size=256, moe_intermediate_size=256)
"""The tiny DeepSeek-V3 with every shard of a quantized weight on the 128 grid at train TP2 (its MLA
up projections, attention output, dense, shared and routed MLPs)."""


def test_the_draft_takes_the_trainers_fp8_with_the_main_model():
    """``trainer_quantize_fp8`` with ``gen_draft``: the MTP layer's linear weights arrive as FP8 data
    and ``weight_scale_inv`` tiles, quantized by the main model's roles, and its ``eh_proj`` in bf16
    (a plain linear in vLLM's and SGLang's drafts), bit for bit against Bridge's export quantized the
    same way, at every refit."""
    spec = RunSpec(model="deepseek-v3", overrides={**MTP, **FP8_GRID},
                   train=TrainLayout(tp=2, pp=2, sequence_parallel=True, layout=DSV3_LAYOUT, mtp_layers=1),
                   draft=True, fp8="trainer", dtype="bfloat16", lr=1e-3, refits=2, bucket_bytes=256 << 10,
                   timeout_s=180.0)
    results = run(spec)
    result = evaluate(spec, results)
    assert result["skipped"] == [] and result["summary"]["num_skipped_params"] == 0
    assert result["bit_exact"] is True and all(r["bit_exact"] for r in result["refits"])
    weights = next(r for r in results if r["role"] == "gen")["refits"][-1]["weights"]
    quantized = "model.layers.3.mlp.experts.0.down_proj.weight"  # the MTP layer's own decoder layer
    assert weights[quantized].dtype == torch.float8_e4m3fn and f"{quantized}_scale_inv" in weights
    assert weights["model.layers.3.self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert weights["model.layers.3.eh_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.3.eh_proj.weight_scale_inv" not in weights


def test_an_engine_with_a_draft_and_a_trainer_without_mtp_is_refused_at_start():
    spec = RunSpec(model="deepseek-v3", overrides=MTP, train=TrainLayout(), draft=True, refits=1, timeout_s=60.0)
    with pytest.raises(Exception, match=r"model.layers.3.* is not produced by the trainer: it is in model.layers.3, "
                                        r"past the trainer's last decoder layer \(model.layers.2\), so the engine "
                                        r"holds an MTP layer"):
        run(spec)


def test_a_draft_left_a_version_behind_is_caught_on_its_replica():
    """The HF engine's post-load step puts its draft's ``eh_proj`` back as it was before refit 2
    (``stale_draft``): the serving check's read-back of the live weights names it on that replica
    alone, and the next (full) refit lands the draft again."""
    spec = RunSpec(model="deepseek-v3", overrides=MTP, train=TrainLayout(tp=2, sequence_parallel=True, mtp_layers=1),
                   gen=GenLayout(tp=1, dp=2), draft=True, dtype="bfloat16", lr=1e-3, refits=3,
                   bucket_bytes=64 << 10, verify_serving="on", breaks=((1, 2, "stale_draft"),), timeout_s=120.0)
    results = run(spec)
    refits = evaluate(spec, results)["refits"]
    assert [r["bit_exact"] for r in refits] == [True, False, True]  # the stale draft is real
    export = next(t["refits"][1]["export"] for t in results if t["role"] == "train" and t["refits"][1]["export"])
    off = {g["gen_index"]: sorted(n for n, t in g["refits"][1]["weights"].items() if not t.equal(export[n]))
           for g in results if g["role"] == "gen"}
    assert off == {0: [], 1: ["model.layers.3.eh_proj.weight"]}  # the draft alone, on replica 1 alone
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [1], []]
    why = refits[1]["failed_replicas"][1]
    # named by the read-back of the live weights (the bucket that carried eh_proj): the main model's
    # log-probs cannot see the draft, which the engine does not score with
    assert why.startswith("ServingMismatchError: refit 2: engine replica 1 does not serve the trainer's model: its "
                          "weights, read back after its post-load step, no longer hold the bytes"), why


def test_the_drafts_log_probs_are_the_trainers_mtp_layers_and_a_draft_never_loaded_fails_its_replica():
    """Proof of serving covers the draft: the HF engine scores the probe through its draft too (the
    first MTP layer's log-prob of the token after the next) and the verdict holds it to the
    trainer's own MTP layer's, here with the read-back of the live weights off (``refit.verify:
    off``), so the log-probs alone judge. Clean: every replica's draft is checked, within bf16
    rounding; replica 1's engine skips its draft at refit 1 (``unload_draft``: the draft serves what
    the engine started with, as an engine whose load leaves its MTP head out does) and fails by name,
    and the next refit lands it."""
    spec = RunSpec(model="deepseek-v3", overrides=MTP, train=TrainLayout(tp=2, sequence_parallel=True, mtp_layers=1),
                   gen=GenLayout(tp=1, dp=2), draft=True, dtype="bfloat16", lr=1e-3, refits=3, verify="off",
                   bucket_bytes=64 << 10, verify_serving="on", breaks=((1, 1, "unload_draft"),), timeout_s=120.0)
    results = run(spec)
    refits = evaluate(spec, results)["refits"]
    assert [sorted(r["failed_replicas"]) for r in refits] == [[1], [], []]
    why = refits[0]["failed_replicas"][1]
    assert why.startswith("ServingMismatchError: refit 1: engine replica 1 does not serve the trainer's model"), why
    assert "[in its speculative draft: the MTP layer's log-prob of the token after the next" in why, why
    summaries = [t["refits"] for t in results if t["role"] == "train"][0]
    checked = [r["report"]["summary"]["refit/serving_draft_checked"] for r in summaries]
    worst = [r["report"]["summary"]["refit/serving_draft_max_dlogprob"] for r in summaries]
    assert checked == [1, 2, 2], checked  # refit 1: the failed replica's draft is not counted as checked
    assert all(0.0 < w < 0.02 for w in worst), worst  # bf16: the draft computes what the trainer's MTP layer does


def test_a_draft_one_step_behind_stays_within_the_bound_and_is_reported_as_drift():
    """Replica 1's engine puts its draft's ``eh_proj`` back as it was before refit 2 (``stale_draft``,
    read-back off): its log-probs move far less than the rounding bound allows, so it does not fail,
    but beyond :data:`~megatron_refit.fleet.draft_check.DRIFT_MARGIN` times the draft's clean noise
    (its first check's): ``refit/serving_draft_drift`` says so (and a WARNING); clean checks stay near 1."""
    from megatron_refit.fleet.draft_check import DRIFT_MARGIN

    spec = RunSpec(model="deepseek-v3", overrides=MTP, train=TrainLayout(tp=2, sequence_parallel=True, mtp_layers=1),
                   gen=GenLayout(tp=1, dp=2), draft=True, dtype="bfloat16", lr=1e-3, refits=3, verify="off",
                   bucket_bytes=64 << 10, verify_serving="on", breaks=((1, 2, "stale_draft"),), timeout_s=120.0)
    results = run(spec)
    refits = evaluate(spec, results)["refits"]
    assert [sorted(r["failed_replicas"]) for r in refits] == [[], [], []]
    summaries = [r["report"]["summary"] for r in [t["refits"] for t in results if t["role"] == "train"][0]]
    drift = [s["refit/serving_draft_drift"] for s in summaries]
    assert drift[0] == 0.0 and drift[1] > 4 * DRIFT_MARGIN and drift[2] < DRIFT_MARGIN, drift
    assert all(s["refit/serving_draft_checked"] == 2 for s in summaries)
