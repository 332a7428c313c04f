"""The commands as a user meets them (#51): ``--help`` is plain text, and a Python outside the
project's venv gets one line that says what to run."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_refit.tools.cli import plain

ROOT = Path(__file__).resolve().parents[2]


def test_plain_turns_rest_into_words():
    assert plain("``python -m x`` and :mod:`a.b.c`, :func:`~a.b.build`, :class:`Plan`") == \
        "python -m x and a.b.c, build, Plan"


@pytest.mark.parametrize("command", ["demo", "dryrun", "costmodel"])
def test_help_is_plain_text(command, capsys):
    """What ``python -m megatron_refit.<command> --help`` prints (its ``main``, in this process)."""
    main = importlib.import_module(f"megatron_refit.tools.{command}").main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and f"usage: python -m megatron_refit.{command}" in out
    assert not any(mark in out for mark in ("``", ":mod:", ":func:", ":class:", ":meth:")), out


def test_outside_the_venv_a_command_says_in_one_line_what_to_run():
    """Run as ``python -m megatron_refit.demo`` by a Python without the venv's packages (here: this
    interpreter with its site-packages left out)."""
    code = ("import runpy, sys; sys.path[:] = [p for p in sys.path if 'site-packages' not in p]; "
            "sys.argv = ['demo', '--help']; runpy.run_module('megatron_refit.demo', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0, out.stderr  # one line, no traceback
    assert "megatron_refit's commands need torch and omegaconf" in out.stderr
    assert "source .venv/bin/activate" in out.stderr


def test_the_demos_plan_line_is_a_sentence_that_agrees_with_its_table():
    from megatron_refit.tools.demo import plan_line

    summary = {"local": "train rank 0", "num_train_ranks": 2, "num_gen_ranks": 1, "num_transfers": 41,
               "num_buckets": 1, "num_unused_train_params": 0, "num_skipped_params": 0, "bytes_sent": 375296,
               "bytes_minimal": 375296, "max_bytes_from_one_train_rank": 187776,
               "min_bytes_from_one_train_rank": 187520, "max_bucket_bytes": 187776}
    line = plan_line(summary, replicas=2)
    assert "{" not in line and "375,296 bytes to each replica (750,592 to all 2)" in line  # the table's 750,592
    assert "(2 train + 1 gen ranks)" in line and "to all" not in plan_line(summary, replicas=1)


def _refit(version, **kw):
    base = dict(version=version, bit_exact=True, max_logit_diff=1e-7, bytes_sent=100, bytes_minimal=100,
                bytes_full=100, density=1.0, refit_s=0.1, failed_replicas={}, replicas_ok=2, pause_s=None,
                serving={"checked": 2, "max_dlogprob": 1e-6, "s": 0.01},
                seconds=dict(total=0.1, pack=0.01, transfer=0.02, load=0.03, onload=0.004, offload=0.005))
    return base | kw


def test_the_demo_table_shows_what_each_mode_is_for():
    from megatron_refit.tools.demo import format_table

    summary = {"num_train_ranks": 2, "num_gen_ranks": 1, "num_transfers": 3, "num_buckets": 1, "bytes_sent": 50,
               "max_bytes_from_one_train_rank": 25, "min_bytes_from_one_train_rank": 25, "max_bucket_bytes": 25}
    result = dict(model="qwen3", dtype="float32", train=dict(tp=2, pp=1, ep=1, dp=1), gen=dict(tp=1, dp=2),
                  summary=summary, ok=True, offload=True,
                  refits=[_refit(1, pause_s=0.0007), _refit(2, failed_replicas={1: "RuntimeError: boom"},
                                                            replicas_ok=1, pause_s=0.0009)])
    header, first, second = format_table(result).splitlines()[2:5]
    assert "onload s" in header and "offload s" in header and "pause s" in header and "failed" in header
    assert first.split()[-4:] == ["0.0040", "0.0050", "0.0007", "-"]
    assert second.split()[-1] == "1"  # the failed replica in its refit's row
    tp2 = dict(result, gen=dict(tp=2, dp=2), offload=False,
               refits=[_refit(1, max_logit_diff=None, serving={"checked": 0})])
    text = format_table(tp2)
    assert "n/a at gen TP2" in text and "pause s" not in text and "failed" not in text.splitlines()[2]
