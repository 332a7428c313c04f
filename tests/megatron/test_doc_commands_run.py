"""Every documented ``python`` command parses with its own parser, and the quick ones run as
written (#51; the docs are read by tests/unit/test_doc_commands.py).

- **Parsed**: each command's arguments go through the argument parser of the module or script it
  names, in this process (the parser is stopped right after it parsed): a renamed option, a
  removed choice or a stale flag fails here. A placeholder (``<model>``, ``...``, ``$X``) is
  filled with a value of the right kind first. A command written inline in prose names a tool
  and some of its options: its required arguments may be left out.
- **Run as written**: the commands that finish in seconds on a CPU (the dry run, the cost model,
  ``--help``) run from the repository root in the project's Python, exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import subprocess
import sys

import pytest

from tests.unit.test_doc_commands import ENGINE_MODULES, PLACEHOLDER, ROOT, Command, doc_commands

QUICK = ("megatron_refit.dryrun", "megatron_refit.costmodel")
"""Modules whose documented commands run as written (seconds each); others with ``--help``."""
FILL = {"configs/<model>.yaml": "configs/qwen3-4b.yaml", "...": "configs/qwen3-4b.yaml"}


class _Parsed(Exception):
    def __init__(self, extras: list[str]):
        super().__init__(extras)
        self.extras = extras


def _python_commands() -> list[Command]:
    return [c for c in doc_commands() if (p := c.python())
            and not (p[0] == "module" and p[1].startswith(ENGINE_MODULES))
            and not (p[0] == "script" and PLACEHOLDER.search(p[1]))]


def _filled(args: list[str]) -> list[str]:
    return [FILL.get(a, re.sub(r"<[^>]+>|\$\{?[A-Z_]+\}?", "x", a)) for a in args]


def parse_only(command: Command) -> str | None:
    """Run ``command``'s module or script until its parser has parsed the arguments; None when
    they parse, else what its parser said."""
    kind, name, args = command.python()
    original = argparse.ArgumentParser.parse_known_args

    def stop(self, args=None, namespace=None):
        namespace, extras = original(self, args, namespace)
        raise _Parsed(extras)

    argv, err = sys.argv, io.StringIO()
    sys.argv = [name, *_filled(args)]
    argparse.ArgumentParser.parse_known_args = stop
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if kind == "module":
                runpy.run_module(name, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(str(ROOT / name), run_name="__main__")
        return "ran to the end without parsing arguments"
    except _Parsed as parsed:
        return f"unrecognized arguments: {parsed.extras}" if parsed.extras else None
    except SystemExit as exc:  # --help exits 0; a parse error exits 2 with its message
        said = err.getvalue().strip().splitlines()[-1] if exc.code else None
        if said and command.inline and "the following arguments are required" in said:
            return None  # prose names a tool and some of its options, not every required one
        return said
    finally:
        argparse.ArgumentParser.parse_known_args = original
        sys.argv = argv


def test_every_documented_python_command_parses_with_its_own_parser():
    commands = _python_commands()
    assert len(commands) >= 20, [c.text for c in commands]
    failed = [f"{c.where}: `{c.text}`: {why}" for c in commands if (why := parse_only(c))]
    assert not failed, "documented commands their own parser refuses:\n" + "\n".join(failed)


def test_a_stale_flag_is_refused_by_the_commands_parser():
    stale = Command("docs/x.md", ("python", "-m", "megatron_refit.costmodel", "--config", "configs/qwen3-4b.yaml",
                                  "--nic-gbit", "50"))
    assert "--nic-gbit" in parse_only(stale)


@pytest.mark.parametrize("command", [c for c in _python_commands() if not c.placeholder and (
    (c.python()[1] in QUICK and not c.inline) or "--help" in c.words)], ids=lambda c: c.text)
def test_quick_documented_commands_run_as_written(command):
    done = subprocess.run([sys.executable, *command.words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command.where}: `{command.text}` exited {done.returncode}:\n{done.stderr[-2000:]}"
