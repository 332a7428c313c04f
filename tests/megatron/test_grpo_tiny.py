"""The tiny GRPO example end to end: refit every step, gen logprobs equal the trainer's; with a
speculative draft (#67), the engine's draft acceptance per step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_grpo_tiny_refits_every_step_and_logprobs_match():
    proc = subprocess.run([sys.executable, "scripts/grpo_tiny.py", "--steps", "4", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["steps"] == 4
    assert result["logprob_match"] is True and 0 <= result["max_logprob_diff"] <= 1e-5
    assert len(result["refit_seconds"]) == 4 and all(s > 0 for s in result["refit_seconds"])
    assert result["rewards"][-1] > result["rewards"][0]  # the policy-gradient update learns the toy task
    assert result["draft_acceptance"] is None and result["draft_greedy_acceptance"] is None  # no draft


def test_grpo_tiny_with_a_draft_logs_the_engines_acceptance_every_step():
    """``configs/examples/grpo_tiny_mtp.yaml``: the tiny DeepSeek-V3 with one MTP layer, its engine
    drafting with it. The refit delivers the trainer's MTP layer each step, which Megatron's MTP loss
    trains on the rollouts, and the engine scores it on its own rollouts: one acceptance per step,
    a chance, and a new value each step (the draft and the model it guesses both moved)."""
    proc = subprocess.run([sys.executable, "scripts/grpo_tiny.py", "--config", "configs/examples/grpo_tiny_mtp.yaml",
                           "--steps", "3", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] is True and result["steps"] == 3
    assert result["logprob_match"] is True and 0 <= result["max_logprob_diff"] <= 1e-5  # the DeepSeek-V3 too
    accept, greedy = result["draft_acceptance"], result["draft_greedy_acceptance"]
    assert len(accept) == len(greedy) == 3, result
    assert all(0.0 < a < 1.0 for a in accept) and all(0.0 <= a <= 1.0 for a in greedy), result
    assert len(set(accept)) == 3, accept  # not one constant: each step's draft scored afresh
    assert " accept  greedy" in proc.stdout  # the per-step columns


@pytest.mark.parametrize("config, argv, message", [
    ("grpo_tiny.yaml", ["--set", "refit.gen_draft=true"],
     "refit.gen_draft: the engine drafts with the trainer's MTP layer; set model.mtp_num_layers: 1"),
    ("grpo_tiny_mtp.yaml", ["--set", "model.mtp_num_layers=2"],
     "model.mtp_num_layers=2: this example's model has one MTP layer"),
    ("grpo_tiny_mtp.yaml", ["--set", "model.mtp_detach_heads=true"],
     "model.mtp_detach_heads=True: this example applies model.mtp_loss_scaling_factor of Megatron's MTP loss"),
    ("grpo_tiny.yaml", ["--set", "model.mtp_loss_scaling_factor=0.2"],
     "model.mtp_loss_scaling_factor=0.2: this example applies"),
    ("grpo_tiny_mtp.yaml", ["--set", "model.mtp_loss_scaling_factor=-1"],
     "model.mtp_loss_scaling_factor: expected a non-negative number, got -1"),
    ("grpo_tiny_mtp.yaml", ["--completion-len", "1"], "--completion-len must be >= 2 with a draft"),
])
def test_the_draft_settings_are_honoured_or_refused_by_name(config, argv, message, capfd, monkeypatch):
    """Before any rank starts: one ``error:`` line naming the setting, exit 2."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from grpo_tiny import main

    assert main(["--config", str(ROOT / "configs" / "examples" / config), *argv]) == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_grpo_math():
    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from grpo_tiny import TARGET, advantages, rewards

    seq = torch.tensor([[1, 2, TARGET, TARGET], [1, 2, 0, TARGET], [3, 3, 0, 0], [3, 3, TARGET, 0]])
    r = rewards(seq, prompt_len=2)
    assert r.tolist() == [1.0, 0.5, 0.0, 0.5]
    adv = advantages(r, group=2)
    assert adv[0] > 0 > adv[1] and adv[3] > 0 > adv[2]
    assert torch.allclose(adv.view(2, 2).sum(dim=1), torch.zeros(2), atol=1e-6)
