"""The tiny GRPO example end to end: refit every step, gen logprobs equal the trainer's."""

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
