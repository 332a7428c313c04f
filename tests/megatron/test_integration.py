"""The integration calls a training loop makes: argument checks before any rendezvous.

The calls themselves run in every end-to-end test (the harness goes through them) and in
the GRPO example (tests/megatron/test_grpo_tiny.py, driven by configs/examples/grpo_tiny.yaml).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_refit.config import RefitConfig
from megatron_refit.engine_side.entry import engine_refit

ROOT = Path(__file__).resolve().parents[2]
ON = RefitConfig(enabled=True, engine="hf", port=1)  # port 1: a rendezvous there would fail, not hang


@pytest.mark.parametrize("cfg,kw,message", [
    (RefitConfig(), dict(gen_index=0, num_train=1), "refit.enabled is false"),
    (ON, dict(gen_index=-1, num_train=1), "gen_index must be a non-negative int, got -1"),  # any replica may join
    (ON, dict(gen_index=0, num_train=0), "num_train must be a positive int, got 0"),
    (RefitConfig(enabled=True, engine="hf", lora_sync="merged", port=1), dict(gen_index=0, num_train=1, lora=(4, 8)),
     "refit.lora_sync 'merged' .* is not implemented"),
])
def test_engine_refit_refuses_bad_arguments_before_connecting(cfg, kw, message):
    with pytest.raises(ValueError, match=message):
        engine_refit(cfg, storage=None, **kw)


def test_grpo_example_refuses_a_config_with_refit_off(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("model:\n  tensor_model_parallel_size: 2\nrefit:\n  enabled: false\n")
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "grpo_tiny.py"), "--config", str(config)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "refit.enabled is false" in run.stderr
