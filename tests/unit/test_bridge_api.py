"""The private Megatron-Bridge / Megatron-Core names ``conversion/`` uses are all in
``conversion/bridge_api.py``: each resolves at the pinned versions, and no other module of
``conversion/`` touches a private name of theirs."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

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
                      for a in node.names if _private_path(f"{node.module}.{a.name}")]
        if isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno}: {a.name}"
                      for a in node.names if a.name.startswith("megatron") and _private_path(a.name)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                and _private_path(node.args[1].value)):
            found.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def _private_path(dotted: str) -> bool:
    """A dotted name with a ``_``-prefixed (not dunder) part: a private module or attribute."""
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def test_private_names_resolve_at_the_pinned_versions():
    from conversion.bridge_api import PRIVATE_NAMES, missing_private_names

    assert len(PRIVATE_NAMES) == 13
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
    module.write_text("import megatron.core._priv.m\nfrom megatron.bridge._x import y\n\n"
                      "def f(b):\n    return getattr(b, '_model_bridge')\n")
    assert sorted(private_uses(module)) == ["new.py:1: megatron.core._priv.m", "new.py:2: megatron.bridge._x.y",
                                            "new.py:5: getattr(..., '_model_bridge')"]


def test_a_name_gone_from_the_packages_is_reported(monkeypatch):
    from conversion import bridge_api

    monkeypatch.setattr(bridge_api, "PRIVATE_NAMES", bridge_api.PRIVATE_NAMES + (
        ("megatron.bridge.models.conversion.model_bridge", "MegatronModelBridge._no_such_name", "method"),
        ("megatron.bridge.models.conversion.model_bridge", "_HFNameSuffixMapping._no_such_field", "instance"),
        ("megatron.bridge.no_such_module", "f", "function"),
    ))
    assert bridge_api.missing_private_names() == [
        "megatron.bridge.models.conversion.model_bridge.MegatronModelBridge._no_such_name (method)",
        "megatron.bridge.models.conversion.model_bridge._HFNameSuffixMapping._no_such_field (instance)",
        "megatron.bridge.no_such_module.f (function)",
    ]


def test_the_adapter_on_bridge_objects():
    from conversion import bridge_api
    from megatron.bridge.models.conversion import param_mapping as pm

    inner = pm.AutoMapping(megatron_param="decoder.layers.*.mlp.linear_fc1.weight",
                           hf_param="model.layers.*.mlp.up_proj.weight")
    wrapped = bridge_api.SuffixMapping(inner, "_scale_inv")
    assert bridge_api.suffix_parts(wrapped) == ("_scale_inv", inner)
    assert bridge_api.suffix_parts(inner) is None
