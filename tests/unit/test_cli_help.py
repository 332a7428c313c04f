"""The commands as a user meets them (#51): ``--help`` is plain text, and a Python outside the
project's venv gets one line that says what to run."""

from __future__ import annotations

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
def test_help_is_plain_text(command):
    out = subprocess.run([sys.executable, "-m", f"megatron_refit.{command}", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"usage: python -m megatron_refit.{command}" in out.stdout
    assert not any(mark in out.stdout for mark in ("``", ":mod:", ":func:", ":class:", ":meth:")), out.stdout


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
