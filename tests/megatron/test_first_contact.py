"""First contact: spawned ranks are quiet by default (the demo's output is its report): third-party
warnings are dropped in each rank, ours still show; ``quiet=False`` (``demo --verbose``)
shows everything."""

from __future__ import annotations

import warnings

import pytest

from megatron_refit.local.launch import run_spawned


def _warn_rank(rank, world, port):
    from megatron_refit.local.launch import quiet

    warnings.warn_explicit("Apex is not installed. Falling back to Torch Norm", UserWarning, "backends.py", 34,
                           module="megatron.core.models.backends")
    warnings.warn_explicit("`all_gather_into_tensor` is deprecated", FutureWarning, "c10d_logger.py", 83,
                           module="torch.distributed.c10d_logger")
    warnings.warn_explicit("refit.enabled is false: ['gen_tp'] are ignored", UserWarning, "section.py", 1,
                           module="megatron_refit.config.section")
    return quiet()


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_ranks_drop_third_party_warnings_only(quiet, capfd, monkeypatch):
    monkeypatch.setenv("REFIT_SPAWN_PRELOAD", "")  # fresh ranks, as the demo starts them (their stderr is this test's)
    assert run_spawned(_warn_rank, 1, timeout_s=60, quiet=quiet) == [quiet]
    err = capfd.readouterr().err
    assert "refit.enabled is false" in err  # ours, always
    assert ("Apex is not installed" in err) is not quiet and ("is deprecated" in err) is not quiet


def test_a_bad_layout_is_one_error_line(capfd):
    """``demo --train-tp 3`` (4 heads): one line naming the bad value, exit 2, before any rank
    starts (an error a rank finds ends the same way: :attr:`SpawnError.innermost`)."""
    from megatron_refit.tools.demo import main

    assert main(["--train-tp", "3", "--refits", "1"]) == 2
    out, err = capfd.readouterr()
    assert err.strip().splitlines() == ["error: model num_attention_heads=4 is not divisible by train tp=3 "
                                        "(layout TP3xPP1xDP1)"], err
    assert out == ""


def test_spawn_error_innermost_reads_the_rank_traceback():
    from megatron_refit.local.launch import SpawnError

    err = SpawnError("rank 1 failed:\nTraceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
                     "megatron_refit.plan.refit_plan.PlanError: gen rank 2 holds nothing\n")
    assert err.innermost == ("PlanError", "gen rank 2 holds nothing")
    assert SpawnError("rank 3 died with exit code -9").innermost is None


def test_dry_run_of_a_layout_the_model_does_not_divide_is_one_error_line(tmp_path, capfd):
    """It used to end in the enumeration child's traceback."""
    from pathlib import Path

    from megatron_refit.tools.dryrun import main

    text = (Path(__file__).resolve().parents[2] / "configs" / "qwen3-4b.yaml").read_text()
    assert "tensor_model_parallel_size: 2" in text
    config = tmp_path / "tp3.yaml"
    config.write_text(text.replace("tensor_model_parallel_size: 2", "tensor_model_parallel_size: 3"))
    assert main(["--config", str(config), "--cache-dir", str(tmp_path / "cache")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == ["error: model num_attention_heads=32 is not divisible by train tp=3 (layout TP3xPP1xDP4xSP)"], err
    assert not (tmp_path / "cache").exists()  # nothing enumerated


@pytest.mark.parametrize("script, argv, message", [
    ("bench_refit", ["--train-tp", "3", "--reps", "1", "--no-delta"], "num_attention_heads=16 is not divisible by "
                                                                      "train tp=3"),
    ("bench_refit", ["--reps", "0"], "--reps must be >= 1, got 0"),
    ("bench_fp8", ["--bucket-mb", "0"], "--bucket-mb must be positive, got 0"),
    ("grpo_tiny", ["--steps", "0"], "--steps must be >= 1, got 0"),
    ("grpo_tiny", ["--set", "model.tensor_model_parallel_size=3"], "not divisible by train tp=3"),
])
def test_benchmarks_and_examples_print_one_error_line(script, argv, message, capfd, monkeypatch):
    """The benchmarks and the GRPO example: a bad value is one ``error:`` line and exit 2,
    before any rank starts."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    module = importlib.import_module(script)
    assert module.main(argv) == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err
    sys.modules.pop(script, None)
