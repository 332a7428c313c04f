"""The docs stay true to the code: the generated config reference is current, every raise
site's message is documented in docs/troubleshooting.md, and links resolve."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
SOURCES = ("megatron_refit", "conversion")
NOT_USER_ERRORS = {"SystemExit", "NotImplementedError", "AttributeError"}
"""Raised for control flow or by protocol (``__getattr__``), not as a message to a user."""
HOLE = "…"
"""A placeholder in a message template (an f-string field) and a wildcard in a documented pattern."""
MIN_WORDS = 2
"""A message template (and a documented pattern) needs this many literal words to be findable."""
NO_STABLE_WORDS: dict[tuple[str, str], str] = {}
"""Raise sites whose message has no literal words, by (file, template), and why they stay."""


def _gen_config_docs():
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- configuration.md ---------------------------------------------------------------------


def test_configuration_reference_is_current():
    gen = _gen_config_docs()
    assert gen.PAGE.read_text() == gen.render(), "docs/configuration.md is stale: run python scripts/gen_config_docs.py"


def test_configuration_reference_covers_every_field_at_its_default():
    from megatron_refit.config import RefitConfig

    gen = _gen_config_docs()
    names = [f["name"] for f in gen.fields()]
    assert names == [f for f in RefitConfig.__dataclass_fields__]
    block = gen.PAGE.read_text().split("```yaml\n")[-1].split("```")[0]
    with pytest.warns(UserWarning, match="ignored by training"):  # enabled: false, the rest set
        assert RefitConfig.from_dict(yaml.safe_load(block)["refit"]) == RefitConfig()


def test_configuration_generator_refuses_an_undocumented_field():
    gen = _gen_config_docs()
    source = gen.SOURCE.read_text().replace("    enabled: bool = False\n",
                                            "    shiny: int = 3\n    enabled: bool = False\n")
    assert source != gen.SOURCE.read_text()
    with pytest.raises(ValueError, match="RefitConfig.shiny has no docstring"):
        gen.render(source)
    changed = gen.SOURCE.read_text().replace('"""Turn refit on.', '"""Switch refit on.')
    assert changed != gen.SOURCE.read_text() and gen.render(changed) != gen.render()


# -- troubleshooting.md -------------------------------------------------------------------


def message_template(node: ast.expr | None) -> str | None:
    """The literal text of a message, ``…`` for each f-string field; None when the message is
    not a string literal (a variable or a call: nothing stable to document)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else HOLE for v in node.values)
    else:
        return None
    return re.sub(r"\s+", " ", text).strip()


def raise_sites(paths=None) -> list[tuple[str, str, str | None]]:
    """``(file:line, exception name, message template)`` of every ``raise E(...)``."""
    files = paths or sorted(f for d in SOURCES for f in (ROOT / d).rglob("*.py"))
    out = []
    for path in files:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)):
                continue  # bare re-raise, or ``raise exc`` of an exception made elsewhere
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "?")
            if name in NOT_USER_ERRORS:
                continue
            where = f"{Path(path).relative_to(ROOT) if Path(path).is_relative_to(ROOT) else path}:{node.lineno}"
            out.append((where, name, message_template(node.exc.args[0] if node.exc.args else None)))
    return out


def documented_patterns(text: str) -> dict[str, list[str]]:
    """``{exception: [patterns]}``: the code spans in the first cell of every table row,
    under a level-2 heading that names the exception."""
    out: dict[str, list[str]] = {}
    error = None
    for line in text.splitlines():
        if line.startswith("## "):
            m = re.search(r"\b(\w+(?:Error|Exception))\b", line)
            error = m.group(1) if m else None
        elif error and line.startswith("| `"):
            first_cell = re.split(r"(?<!\\)\|", line)[1]
            out.setdefault(error, []).extend(re.findall(r"`([^`]+)`", first_cell))
    return out


def _regex(pattern: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in pattern.split(HOLE)), re.DOTALL)


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z_]{2,}", text.replace(HOLE, " "))


def undocumented(sites, patterns: dict[str, list[str]]) -> list[str]:
    """Problems, one line each: raise sites no pattern of their exception matches, messages
    without literal words, patterns too vague, patterns no raise site matches any more."""
    problems = []
    compiled = {e: [(p, _regex(p)) for p in ps] for e, ps in patterns.items()}
    used = set()
    for where, error, template in sites:
        if (where.rsplit(":", 1)[0], template) in NO_STABLE_WORDS:
            continue
        if template is None or len(_words(template)) < MIN_WORDS:
            problems.append(f"{where}: {error} message {template!r} has no stable words to document; give it some")
            continue
        hits = [p for p, rx in compiled.get(error, []) if rx.fullmatch(template)]
        used.update((error, p) for p in hits)
        if not hits:
            problems.append(f"{where}: {error}({template!r}) is not in docs/troubleshooting.md under ## {error}")
    for error, ps in patterns.items():
        for p in ps:
            if len(_words(p)) < MIN_WORDS:
                problems.append(f"troubleshooting.md ## {error}: pattern {p!r} is too vague")
            elif (error, p) not in used:
                problems.append(f"troubleshooting.md ## {error}: pattern {p!r} matches no raise site")
    return problems


def test_every_raise_site_is_documented():
    sites = raise_sites()
    problems = undocumented(sites, documented_patterns(TROUBLESHOOTING.read_text()))
    present = {(where.rsplit(":", 1)[0], template) for where, _, template in sites}
    problems += [f"NO_STABLE_WORDS entry {key} matches no raise site: remove it" for key in NO_STABLE_WORDS
                 if key not in present]
    assert not problems, "\n".join(problems)


def test_the_check_fails_for_a_new_message_and_a_stale_pattern(tmp_path):
    module = tmp_path / "new.py"
    module.write_text('def f(x):\n    raise ValueError(f"widget {x} is too shiny")\n\n'
                      'def g(x):\n    raise PlanError(f"{x}: {x}")\n\n'
                      'def h(x):\n    raise ValueError(x)\n')
    sites = raise_sites([module])
    assert [s[1:] for s in sites] == [("ValueError", "widget … is too shiny"), ("PlanError", "…: …"),
                                      ("ValueError", None)]
    problems = undocumented(sites, {"ValueError": ["… is not one of …"], "PlanError": ["…"]})
    assert any("new.py:2: ValueError('widget … is too shiny') is not in" in p for p in problems)
    assert any("new.py:5: PlanError message '…: …' has no stable words" in p for p in problems)
    assert any("new.py:8: ValueError message None" in p for p in problems)
    assert any("pattern '… is not one of …' matches no raise site" in p for p in problems)
    assert any("pattern '…' is too vague" in p for p in problems)
    assert undocumented(sites[:1], {"ValueError": ["widget … is too shiny"]}) == []
    assert undocumented(sites[:1], {"PlanError": ["widget … is too shiny"]})  # the exception's own section


def test_documented_patterns_parse_sections_and_cells():
    text = ("## How to read\n| `not … an error` | x |\n## `PlanError` (a ValueError)\n| message | a | b |\n"
            "| `a … b` <br> `c … d` | meaning with `code` | fix |\n### sub\n| `e … f` | | |\n")
    assert documented_patterns(text) == {"PlanError": ["a … b", "c … d", "e … f"]}


# -- README and links ---------------------------------------------------------------------


def test_readme_starts_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    code = lines[lines.index("```bash") + 1: lines.index("```bash") + 3]
    assert lines.index("```bash") <= 3
    assert [line.split("#")[0].strip() for line in code] == ["make demo", "make test"]


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_and_anchors_resolve():
    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            path, _, anchor = target.partition("#")
            if re.match(r"[a-z]+://", path):
                continue
            linked = (page.parent / path) if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in _anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# -- guide-engines.md: the vLLM backend's snippets ----------------------------------------


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


ENGINE_SIDE = ("megatron_refit.engines.vllm.worker.engine", "megatron_refit.engines.vllm.worker.info")
"""Modules that import vLLM itself: their snippets' imports are checked in tests/engines/vllm."""


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_snippet_imports_from_the_current_paths():
    """Every Python block of the README and the docs parses, and every name it imports from
    megatron_refit or conversion exists where it says (a module moved or renamed fails here)."""
    checked = 0
    for page in _doc_pages():
        for block in _python_blocks(page):
            for node in ast.walk(ast.parse(block)):
                if isinstance(node, ast.ImportFrom) and node.module.split(".")[0] in ("megatron_refit", "conversion") \
                        and node.module not in ENGINE_SIDE:
                    module = importlib.import_module(node.module)
                    missing = [a.name for a in node.names if not hasattr(module, a.name)
                               and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
                    assert not missing, f"{page.name}: {node.module} has no {missing}"
                    checked += 1
    assert checked >= 20


def test_the_architecture_example_runs():
    """docs/architecture.md's box example, run as written: the four transfers it draws."""
    import contextlib
    import io

    (block,) = [b for b in _python_blocks(ROOT / "docs" / "architecture.md") if "RefitPlan.build(train, gen)" in b]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "architecture.md", "exec"), {})
    assert out.getvalue().splitlines() == ["0 -> 0 ((0, 4), (0, 8))", "1 -> 0 ((4, 6), (0, 8))",
                                           "1 -> 1 ((6, 8), (0, 8))", "2 -> 1 ((8, 12), (0, 8))"]


def test_engine_guide_snippets_parse_and_bind():
    """The guide's blocks (and the README's) are there; the trainer engine's call binds to its
    real signature."""
    import inspect

    blocks = _python_blocks(ROOT / "docs" / "guide-engines.md") + _python_blocks(ROOT / "README.md")
    assert len(blocks) >= 6
    from megatron_refit.engines.vllm.trainer.engine import MegatronRefitTrainerEngine, MegatronRefitTrainerInitInfo

    inspect.signature(MegatronRefitTrainerEngine.trainer_init).bind(
        MegatronRefitTrainerInitInfo(refit={}, num_train=1, rank=0), client=None, source=None)
    inspect.signature(MegatronRefitTrainerEngine.send_weights).bind(None, 3)


def test_engine_guide_single_controller_example_is_the_gpu_checks_code():
    """The single-controller snippets are lines the GPU check runs (scripts/gpu_check_vllm.py)."""
    text = (ROOT / "docs" / "guide-engines.md").read_text()
    section = text.split("### A single controller")[1].split("\n### ")[0]
    script = re.sub(r"\s+", " ", (ROOT / "scripts" / "gpu_check_vllm.py").read_text())
    statements = []
    for block in re.findall(r"```python\n(.*?)```", section, flags=re.S):
        statements += [ast.get_source_segment(block, node) for node in ast.parse(block).body]
    assert len(statements) >= 3
    for statement in statements:
        assert re.sub(r"\s+", " ", statement) in script, statement


def test_quickstart_callback_snippet_is_what_the_pretrain_test_runs():
    """docs/quickstart.md's training-loop snippet: its config and callback lines are the ones
    tests/megatron/test_refit_callback.py runs inside Bridge's pretrain()."""
    text = (ROOT / "docs" / "quickstart.md").read_text()
    section = text.split("## 3. In Megatron-Bridge's training loop")[1].split("\n## ")[0]
    test = re.sub(r"\s+", " ", (ROOT / "tests" / "megatron" / "test_refit_callback.py").read_text())
    blocks = _python_blocks_of(section)
    assert blocks
    statements = [ast.get_source_segment(block, node) for block in blocks for node in ast.parse(block).body]
    checked = [s for s in statements if "RefitCallback" in s]
    assert checked, statements
    for statement in checked:
        assert re.sub(r"\s+", " ", statement) in test, statement
    assert "pretrain(config, forward_step_func, callbacks=callbacks)" in section  # Bridge's own call


def _python_blocks_of(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)
