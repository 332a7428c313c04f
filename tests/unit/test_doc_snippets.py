"""The docs' Python snippets import what exists: every ``import`` / ``from … import …`` line of a
```python block in README.md and docs/*.md names a module that imports here and names it holds.
A renamed module, class or function then fails this test, not a user (#51).

The modules of the Megatron-Bridge side (``conversion``: importing them imports Megatron, ~20 s)
are checked in the main tier (tests/megatron/test_doc_snippets_megatron.py), the rest here.
Snippets for the engines' own processes import vLLM or SGLang, which live in venvs of their own
(``.venv-vllm``, ``.venv-sglang``): their own packages are not imported here, and a module of
this project that needs them is read instead (its top-level definitions and imports).
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PACKAGES = {"vllm", "sglang"}
"""Imported only inside the engines' venvs."""
MEGATRON_SIDE = {"conversion"}
"""Checked in the main tier."""


def _doc_imports() -> dict[tuple[str, str], set[str]]:
    """``(doc, module) -> names`` over every Python block of the docs (``set()``: ``import module``)."""
    found: dict[tuple[str, str], set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S):
            for line in block.splitlines():
                line = line.strip()
                if not line.startswith(("from ", "import ")):
                    continue
                node = ast.parse(line).body[0]
                rel = str(doc.relative_to(ROOT))
                if isinstance(node, ast.ImportFrom):
                    found.setdefault((rel, node.module), set()).update(a.name for a in node.names)
                else:
                    for alias in node.names:
                        found.setdefault((rel, alias.name), set())
    return found


def _defined(module: str) -> set[str]:
    """Top-level names a module of this project defines or imports, read from its source."""
    path = ROOT / Path(*module.split("."))
    source = path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"
    names = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def missing_names(module: str, names: set[str]) -> list[str]:
    """What of ``names`` ``module`` lacks (``[module]`` where the module itself is missing)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in ENGINE_PACKAGES or module.split(".")[0] in ENGINE_PACKAGES:
            return [module]
        try:  # a module of ours that imports an engine: read it
            return sorted(names - _defined(module))
        except (OSError, SyntaxError):
            return [module]
    return sorted(n for n in names if not hasattr(mod, n))


def test_the_docs_have_python_snippets_to_check():
    imports = _doc_imports()
    assert len({m for _, m in imports}) >= 20  # the README and the guides: a parse that finds nothing fails here
    assert ("docs/quickstart.md", "conversion.refit_callback") in imports


def doc_import_problems(packages: set[str]) -> list[str]:
    """Every import of the docs' snippets from ``packages`` (top-level names) that fails."""
    problems = []
    for (doc, module), names in sorted(_doc_imports().items()):
        if module.split(".")[0] not in packages:
            continue
        problems += [f"{doc}: from {module} import {m}" if m != module else f"{doc}: import {module}"
                     for m in missing_names(module, names)]
    return problems


def test_every_name_a_doc_snippet_imports_exists():
    every = {module.split(".")[0] for _, module in _doc_imports()}
    problems = doc_import_problems(every - ENGINE_PACKAGES - MEGATRON_SIDE)
    assert not problems, "the docs import what does not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("module,names,missing", [
    ("megatron_refit.endpoint.sender", {"Refitter", "Receiver"}, ["Receiver"]),  # the quickstart's old import
    ("megatron_refit.no_such_module", {"x"}, ["megatron_refit.no_such_module"]),
    ("megatron_refit.config", {"load_training_yaml"}, []),
])
def test_a_renamed_module_or_name_is_reported(module, names, missing):
    assert missing_names(module, names) == missing
