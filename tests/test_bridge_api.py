"""The private Megatron-Bridge / Megatron-Core names ``conversion/`` uses are all in
``conversion/bridge_api.py``: each resolves at the pinned versions, and no other module of
``conversion/`` touches a private name of theirs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NOT_MEGATRON = {"_version"}  # torch's Tensor._version (a counter torch documents for autograd)
"""Underscore attributes used in conversion/ that are not Bridge's or Megatron-Core's."""


def private_uses(path: Path) -> list[str]:
    """``file:line: what`` for every private attribute of another object used in ``path``,
    and every underscore name imported from megatron.*."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "sys"):
                continue
            if node.attr not in NOT_MEGATRON:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            found += [f"{path.name}:{node.lineno}: {node.module}.{a.name}"
                      for a in node.names if a.name.startswith("_")]
    return found


def test_private_names_resolve_at_the_pinned_versions():
    from conversion.bridge_api import PRIVATE_NAMES, missing_private_names

    assert len(PRIVATE_NAMES) == 12
    assert missing_private_names() == []


def test_only_the_adapter_touches_private_names():
    others = [p for p in sorted((ROOT / "conversion").glob("*.py")) if p.name != "bridge_api.py"]
    assert others and not [use for p in others for use in private_uses(p)]
    # the adapter itself uses every name it lists, and lists every one it uses
    from conversion.bridge_api import PRIVATE_NAMES

    used = {use.rsplit(".", 1)[-1] for use in private_uses(ROOT / "conversion" / "bridge_api.py")}
    listed = {path.rsplit(".", 1)[-1] for _, path, _ in PRIVATE_NAMES}
    assert used == listed


def test_the_check_sees_a_new_private_use(tmp_path):
    module = tmp_path / "new.py"
    module.write_text("from megatron.bridge.x import _hidden\n\ndef f(bridge):\n    return bridge._model_bridge\n")
    assert private_uses(module) == ["new.py:1: megatron.bridge.x._hidden", "new.py:4: ._model_bridge"]
