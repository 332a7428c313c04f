"""The package layout docs/architecture.md draws: no import cycles, the runtime imports no
tooling, invariants raise errors (no ``assert``), transports behind a registry."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_refit"
ENTRY_POINTS = {"megatron_refit.demo", "megatron_refit.dryrun", "megatron_refit.costmodel"}
"""``python -m megatron_refit.<name>``: thin shims over ``megatron_refit.tools``."""


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """megatron_refit modules ``path`` imports, at any depth (module level or inside a function)."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}  # `from pkg import module`
    return {m for m in out if m.startswith("megatron_refit")}


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {t for t in _imports(p) if t in files and t != m} for m, p in files.items()}


def test_no_import_cycles():
    graph = _graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # a package importing its own submodules (its __init__ re-exporting them) is not a cycle
    cycles = [c for c in cycles if not all(m.startswith(c[0] + ".") or m == c[0] for m in c)]
    assert not cycles, cycles


def test_runtime_imports_no_tooling():
    graph = _graph()
    runtime = [m for m in graph if not m.startswith("megatron_refit.tools") and m not in ENTRY_POINTS]
    assert "megatron_refit.driver" in runtime and "megatron_refit.transport" in runtime
    bad = {m: sorted(t for t in graph[m] if t.startswith("megatron_refit.tools")) for m in runtime}
    assert not {m: t for m, t in bad.items() if t}


def test_invariants_raise_errors_not_asserts():
    # `python -O` strips asserts: a broken invariant must still stop the refit
    found = [f"{p.relative_to(ROOT)}:{node.lineno}" for folder in (PACKAGE, ROOT / "conversion")
             for p in folder.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Assert)]
    assert not found, found


def test_transport_registry():
    from megatron_refit.transport import RefitGroup, Transport, open_transport, register_transport, transport_names
    from megatron_refit.transport.ipc import IpcGroup

    assert {"gloo", "nccl", "ipc"} <= set(transport_names())
    assert issubclass(RefitGroup, Transport) and issubclass(IpcGroup, Transport)
    with pytest.raises(ValueError, match=r"unknown transport 'rdma'; registered: \["):
        open_transport("rdma", host="127.0.0.1", port=1, rank=0, world_size=1, timeout_s=1, num_train=1)
    with pytest.raises(ValueError, match="'gloo' is already registered"):
        register_transport("gloo", lambda **kw: None)
    register_transport("test-not-a-transport", lambda **kw: object())
    with pytest.raises(TypeError, match="'test-not-a-transport' returned a object, not a Transport"):
        open_transport("test-not-a-transport", host="127.0.0.1", port=1, rank=0, world_size=1, timeout_s=1,
                       num_train=1)


def test_a_registered_transport_serves_a_refit_group():
    """``open_transport`` with the built-in gloo transport: a one-rank group that exchanges
    a control message with itself."""
    from megatron_refit.tools.launch import free_ports
    from megatron_refit.transport import RefitGroup, open_transport

    (port,) = free_ports(1)
    group = open_transport("gloo", host="127.0.0.1", port=port, rank=0, world_size=1, timeout_s=30, num_train=1)
    try:
        assert isinstance(group, RefitGroup) and group.backend == "gloo" and group.direct_ok
        from megatron_refit.transport.process_group import HEADER_VALUES

        assert group.exchange("message", [7]) == [[7] + [0] * (HEADER_VALUES - 1)]
    finally:
        group.close()
