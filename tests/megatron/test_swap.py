"""Zero-downtime refits (``refit.swap: staged``): the engine generates while refits arrive,
every forward pass is tagged with one version and computes exactly with that version's
weights, and the pause is a small part of the transfer. In place, generation waits for the
whole refit and still never sees two versions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

pytestmark = pytest.mark.slow

SHAPE = dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, ffn=768, vocab=2048)


def _spec(swap, budget=None):
    from megatron_refit.plan.gen_layout import GenLayout
    from megatron_refit.plan.layout import TrainLayout
    from megatron_refit.local.harness import RunSpec

    return RunSpec(model="qwen3", overrides=SHAPE, train=TrainLayout(tp=2), gen=GenLayout(tp=1, dp=1), refits=5,
                   swap=swap, bucket_bytes=1 << 20, swap_budget_bytes=budget)


def test_staged_swap_serves_during_the_transfer_and_no_pass_mixes_versions():
    from bench_swap import run_swap

    result = run_swap(_spec("staged"), hold_swap=True)  # each swap waits for one pass (a loaded machine)
    assert result["bit_exact"] and result["tags_consistent"] and result["tags_monotonic"]
    assert result["tokens_during_transfer"] > 0
    assert result["pause_ratio"] <= 0.10, result
    assert result["versions_served"] == [1, 2, 3, 4, 5]
    # passes inside a refit's window: the previous version until the swap, then the new one
    for r in result["per_refit"]:
        assert set(r["versions_during_transfer"]) <= {r["version"] - 1, r["version"]}, r
    # the engine served the previous version while the next one streamed in
    assert any(r["version"] - 1 in r["versions_during_transfer"] for r in result["per_refit"])


def test_a_partial_budget_pauses_from_the_first_unstaged_write_and_never_mixes_versions():
    from bench_swap import run_swap

    result = run_swap(_spec("staged", budget=4 << 20))  # the embedding and about half the layers
    assert result["bit_exact"] and result["tags_consistent"] and result["tags_monotonic"]
    assert 0 < result["pause_ratio"] < 1.0


def test_in_place_generation_waits_for_the_whole_refit():
    from bench_swap import run_swap

    result = run_swap(_spec("in_place"))
    assert result["bit_exact"] and result["tags_consistent"] and result["tags_monotonic"]
    assert result["tokens_during_transfer"] == 0 and result["pause_ratio"] == 1.0


def test_staged_receiver_keeps_serving_after_a_failed_refit_and_follows_a_reallocated_model():
    from transformers import Qwen3Config

    from megatron_refit.engines.hf.staged import StagedHFStorage

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    recv = StagedHFStorage.from_config(cfg)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    name = "model.embed_tokens.weight"
    # version 1 into the shadow; the swap makes it live at once, tagged 1
    recv.set_state("updating", None)
    recv.expect_version(1)
    recv.buffer(name).fill_(0.5)
    recv.finalize()
    recv.set_state("ready", 1)
    logits, version = recv.step(tokens)
    assert version == 1 and torch.all(recv.model.model.embed_tokens.weight == 0.5)
    assert recv.last_pause_s < 0.05 and recv.swaps == 1
    # version 2 fails half-way: only the shadow was written, version 1 keeps serving
    recv.set_state("updating", 1)
    recv.expect_version(2)
    recv.buffer(name).fill_(-1.0)
    recv.set_state("stale", 1)
    assert recv.state == "ready" and recv.weights_version == 1
    assert torch.equal(recv.step(tokens)[0], logits)
    # the engine re-allocates its parameters: the next refit is a full one into a fresh shadow
    assert recv.refresh_targets() is False
    recv.model.model.embed_tokens.weight.data = recv.model.model.embed_tokens.weight.data.clone()
    assert recv.refresh_targets() is True and recv.refresh_targets() is False


def test_the_serving_probe_is_scored_by_one_version_one_batch_per_length():
    """``HFStorage.score`` holds the serving lock for the whole probe (a staged swap waits for it:
    no probe is scored half by one version, half by the next) and runs one forward per sequence
    length; each sequence's log-probs equal its own forward's."""
    from transformers import Qwen3Config

    from megatron_refit.engines.hf.staged import StagedHFStorage

    cfg = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    recv = StagedHFStorage.from_config(cfg)
    recv.set_state("ready", 1)
    held = []
    hook = recv.model.register_forward_hook(lambda module, args, out: held.append((recv.serving.locked(),
                                                                                   args[0].shape[0])))
    probe = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]
    scored = recv.score(probe)
    hook.remove()
    assert held == [(True, 2), (True, 1)]  # two lengths: two forwards, each under the lock
    for sequence, row in zip(probe, scored, strict=True):
        logits = recv.step(torch.tensor([sequence]))[0]
        want = torch.log_softmax(logits[0, :-1], dim=-1).gather(-1, torch.tensor(sequence[1:])[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(row), want, atol=1e-6)
