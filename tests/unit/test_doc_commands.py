"""Every shell command the docs give names what exists (#51): README.md and docs/*.md, their
```bash blocks and their inline `python …` / `make …` / `sbatch …` spans.

- ``make T``: ``T`` is a target of the Makefile;
- ``python -m M …`` / ``python S.py …`` (with or without ``.venv/bin/``): the module or script is
  in this repository (or one of the engines', run in its venv: only named);
- ``sbatch S``: the script exists and ``bash -n`` reads it.

This tier imports nothing heavy. The main tier (``tests/megatron/test_doc_commands_run.py``)
parses every documented command's arguments with the command's own parser and runs the ones
that finish in seconds on a CPU as written. A placeholder (``<model>``, ``...``, ``$MODEL``,
``my_….py``) is a blank to fill in: such a command is named, not run; ``a|b`` spans are
alternatives, each checked.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENGINE_MODULES = ("vllm.", "sglang.")
"""Modules of the engines' own venvs (``.venv-vllm*``, ``.venv-sglang``): named, run there."""
PLACEHOLDER = re.compile(r"<[^>]+>|\.\.\.|\$\{?[A-Z_]+|(^|/)my_\w+\.(py|yaml)$")
_BLOCK = re.compile(r"```(?:bash|sh|console|shell)\n(.*?)```", re.S)
_INLINE = re.compile(r"`((?:\.venv/bin/)?python3? [^`]+|make [a-z][^`]*|sbatch [^`]+)`")


@dataclass(frozen=True)
class Command:
    """One documented command: where it is written, and its words (environment assignments,
    comments and ``.venv/bin/`` left out; one alternative of each ``a|b``)."""

    where: str
    words: tuple[str, ...]
    inline: bool = False
    """Written inline in prose (a tool named with some of its options), not a line to type."""

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def placeholder(self) -> bool:
        return any(PLACEHOLDER.search(w) for w in self.words)

    def python(self) -> tuple[str, str, list[str]] | None:
        """``("module", M, args)`` or ``("script", path, args)`` of a ``python`` command; None
        for others."""
        if not self.words or not re.fullmatch(r"python3?", self.words[0]):
            return None
        if self.words[1:2] == ("-m",):
            return "module", self.words[2], list(self.words[3:])
        return "script", self.words[1], list(self.words[2:])


def _commands_in(text: str) -> list[tuple[str, bool]]:
    """``(command line, inline)`` of every command in ``text``."""
    lines = []
    for block in _BLOCK.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)  # a line continued with a backslash
        lines += [(line, False) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    # inline: `[--flag value]` is usage notation for an optional part
    lines += [(re.sub(r"[\[\]]", "", re.sub(r"\s+", " ", span)), True) for span in _INLINE.findall(text)]
    return lines


def _words(line: str) -> list[tuple[str, ...]]:
    """The words of one command line, one tuple per combination of its ``a|b`` alternatives."""
    line = line.split("&&")[-1]  # `make setup && python …`: the command after the setup
    words = shlex.split(line, comments=True)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):  # VAR=value before the command
        words.pop(0)
    words = [w.removeprefix(".venv/bin/") for w in words]
    choices = [_alternatives(w) if "|" in w and not w.startswith(("'", "{")) and "=" not in w else [w] for w in words]
    return [tuple(c) for c in itertools.product(*choices)]


def _alternatives(word: str) -> list[str]:
    """``a|b`` as ``[a, b]``; ``pkg.demo|dryrun`` as ``[pkg.demo, pkg.dryrun]`` (a module's
    siblings written by their last name)."""
    first, *rest = word.split("|")
    package = first.rpartition(".")[0] + "." if "." in first and "/" not in first else ""
    return [first] + [package + r if package and "." not in r else r for r in rest]


def doc_commands() -> list[Command]:
    """Every command the docs give, each alternative once, in the order they are written."""
    seen, out = set(), []
    for path in DOCS:
        for line, inline in _commands_in(path.read_text()):
            for words in _words(line):
                if words and (words, inline) not in seen and words[0] in ("python", "python3", "make", "sbatch"):
                    seen.add((words, inline))
                    out.append(Command(str(path.relative_to(ROOT)), words, inline))
    return out


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*):", makefile, re.M)}


def problems(commands: list[Command]) -> list[str]:
    """What a user typing ``commands`` would not find, one line each."""
    targets, out = make_targets(), []
    for cmd in commands:
        head = cmd.words[0]
        if head == "make":
            out += [f"{cmd.where}: `{cmd.text}`: no Makefile target {t!r}" for t in cmd.words[1:]
                    if not t.startswith("-") and "=" not in t and t not in targets]
        elif head == "sbatch" and not cmd.placeholder:
            script = ROOT / cmd.words[1]
            if not script.is_file():
                out.append(f"{cmd.where}: `{cmd.text}`: no script {cmd.words[1]}")
            elif subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode:
                out.append(f"{cmd.where}: `{cmd.text}`: bash -n fails on {cmd.words[1]}")
        elif (found := cmd.python()) is not None:
            kind, name, _ = found
            if kind == "module" and not name.startswith(ENGINE_MODULES):
                path = ROOT / Path(*name.split("."))
                if not (path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()):
                    out.append(f"{cmd.where}: `{cmd.text}`: no module {name} in this repository")
            elif kind == "script" and not PLACEHOLDER.search(name) and not (ROOT / name).is_file():
                out.append(f"{cmd.where}: `{cmd.text}`: no script {name}")
    return out


def test_the_docs_give_commands_of_every_kind():
    kinds = {c.words[0] for c in doc_commands()}
    assert {"make", "python", "sbatch"} <= kinds, kinds


def test_every_documented_command_names_a_target_module_or_script_that_exists():
    found = problems(doc_commands())
    assert not found, "the docs give commands that do not exist:\n" + "\n".join(found)


@pytest.mark.parametrize("line, missing", [
    ("make tset", "no Makefile target 'tset'"),
    ("python -m megatron_refit.dryrn --config x.yaml", "no module megatron_refit.dryrn in this repository"),
    (".venv/bin/python scripts/bench_refitt.py --json", "no script scripts/bench_refitt.py"),
    ("sbatch scripts/slurm/nope.sbatch", "no script scripts/slurm/nope.sbatch"),
])
def test_a_renamed_target_module_or_script_is_reported(line, missing):
    commands = [Command("docs/x.md", words) for words in _words(line)]
    assert [p.split(": ", 2)[2] for p in problems(commands)] == [missing]


def test_alternatives_continuations_and_environment_are_read_as_a_user_types_them():
    text = "```bash\nVLLM_X=1 .venv/bin/python -m megatron_refit.costmodel --placement a|b \\\n  --json  # note\n```\n"
    words = [w for line, _ in _commands_in(text) for w in _words(line)]
    assert words == [("python", "-m", "megatron_refit.costmodel", "--placement", "a", "--json"),
                     ("python", "-m", "megatron_refit.costmodel", "--placement", "b", "--json")]
    assert _words("python -m megatron_refit.demo|dryrun") == [("python", "-m", "megatron_refit.demo"),
                                                              ("python", "-m", "megatron_refit.dryrun")]
