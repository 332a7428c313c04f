"""The layers docs/architecture.md draws, enforced: dependencies point one way (down the
table below) over the whole graph, ``megatron_refit`` and ``conversion`` together, lazy imports
included; no import cycles; the plan layer (and the wire format) imports no torch; no private name crosses a module;
invariants raise errors (no ``assert``); transports and engines behind registries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_refit"
FOLDERS = (PACKAGE, ROOT / "conversion")
ENTRY_POINTS = {"megatron_refit.demo", "megatron_refit.dryrun", "megatron_refit.costmodel"}
"""``python -m megatron_refit.<name>``: thin shims over ``megatron_refit.tools``."""

LAYERS = (
    ("megatron_refit", "megatron_refit.errors", "megatron_refit.families", "megatron_refit.registry"),
    ("megatron_refit.plan", "megatron_refit.wire"),
    ("megatron_refit.config",),
    ("megatron_refit.transport",),
    ("megatron_refit.endpoint",),
    ("megatron_refit.group",),
    ("megatron_refit.fleet", "megatron_refit.engine_side"),
    ("megatron_refit.refit",),
    ("megatron_refit.engines",),
    ("conversion",),
    ("conversion.testing",),
    ("megatron_refit.local",),
    ("megatron_refit.testing",),
    ("megatron_refit.tools", *sorted(ENTRY_POINTS)),
)
"""Bottom to top: a module imports modules of its own layer or of layers below, never above.
A module belongs to the layer of the longest prefix that names it (``megatron_refit.registry``,
the engines by name, is layer 0: every layer may ask it). The
runtime is everything below ``conversion.testing``: it never imports test builders, local runs
(``megatron_refit.local``: the demo's), test support (``megatron_refit.testing``) or tools; the
tools (the demo) import no test support either (:func:`test_the_tools_import_no_test_support`)."""


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Project modules ``path`` imports, at any depth (module level or inside a function)."""
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
    return {m for m in out if m.split(".")[0] in ("megatron_refit", "conversion")}


def _files() -> dict[str, Path]:
    return {_module(p): p for folder in FOLDERS for p in folder.rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    files = _files()
    return {m: {t for t in _imports(p) if t in files and t != m} for m, p in files.items()}


def _layer(module: str) -> int:
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, module
    return layer


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


def _part(module: str) -> str:
    """The part a module belongs to: its package two levels down (``megatron_refit.fleet``,
    ``megatron_refit.engines.vllm``), a top-level module itself (``megatron_refit.config``)."""
    parts = module.split(".")
    depth = 3 if parts[:2] == ["megatron_refit", "engines"] and len(parts) > 3 else 2
    return ".".join(parts[:depth])


def test_no_cycle_between_parts():
    """The graph of parts (packages: ``fleet``, ``endpoint``, ``engines.vllm``, ``config``...) is
    acyclic: config and the engines, the fleet and the endpoints, never import each other both ways."""
    parts: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        mine = _part(module)
        parts.setdefault(mine, set()).update(_part(t) for t in targets if _part(t) != mine)
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(parts.get(node, ())):
            assert state.get(nxt) != "open", f"parts import each other: {' -> '.join(stack[stack.index(nxt):] + [nxt])}"
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(parts):
        if node not in state:
            visit(node, [node])
    assert "megatron_refit.fleet" in parts and "megatron_refit.engines.vllm" in parts


def test_each_engine_keeps_its_trainer_process_and_engine_process_modules_apart():
    """``engines/<e>/trainer/`` (what runs in the train ranks' processes) and ``engines/<e>/worker/``
    (what runs inside the engine) never import each other; what both read lives beside them."""
    crossing = []
    for module, targets in _graph().items():
        for side, other in (("trainer", "worker"), ("worker", "trainer")):
            if f".{side}." in f"{module}." and module.startswith("megatron_refit.engines."):
                crossing += [f"{module} imports {t}" for t in targets if f".{other}." in f"{t}."]
    assert not crossing, crossing


TRAIN_SIDE = ("megatron_refit.fleet", "megatron_refit.refit", "megatron_refit.engines.control")
"""The train ranks' side (with every engine's ``trainer/``): nothing an engine process runs reaches it."""


def _chains(graph, starts, reached) -> list[str]:
    """Each import path from a module ``starts(m)`` to one ``reached(m)``, at any depth."""
    bad = []
    for start in graph:
        if not starts(start):
            continue
        seen, stack = {start: None}, [start]
        while stack:
            m = stack.pop()
            for t in graph.get(m, ()):
                if t in seen:
                    continue
                seen[t] = m
                if reached(t):
                    path, at = [t], m
                    while at is not None:
                        path.append(at)
                        at = seen[at]
                    bad.append(" -> ".join(reversed(path)))
                else:
                    stack.append(t)
    return bad


def _engine_side_reaches(graph) -> list[str]:
    """Each path from an engine-side module (``engine_side``, an engine's ``worker/``) to a
    train-side one, through any chain of imports."""
    def engine(m):
        return m.startswith(("megatron_refit.engine_side", "megatron_refit.engines.hf")) or \
            (m.startswith("megatron_refit.engines.") and ".worker." in f"{m}.")

    def train(m):
        return any(m == p or m.startswith(p + ".") for p in TRAIN_SIDE) or ".trainer." in f"{m}."

    return _chains(graph, engine, train)


DRY_RUN = ("megatron_refit.dryrun", "megatron_refit.costmodel", "megatron_refit.tools.dryrun",
           "megatron_refit.tools.costmodel")
"""The dry run and the cost model (``python -m megatron_refit.dryrun`` / ``costmodel``): what they
read (the presets, the layout arithmetic, the enumeration cache) lives outside ``*/testing/``."""


def _dry_run_reaches_testing(graph) -> list[str]:
    return _chains(graph, lambda m: m in DRY_RUN, lambda m: ".testing." in f"{m}.")


def test_the_dry_run_imports_no_test_support():
    """No chain of imports, lazy ones included, from the dry run or the cost model to a
    ``*/testing/`` module (the enumeration cache's builder runs as a child process)."""
    graph = _graph()
    assert set(DRY_RUN) <= set(graph)
    assert not _dry_run_reaches_testing(graph)


def test_the_dry_run_check_catches_a_chain_to_test_support():
    graph = {"megatron_refit.tools.dryrun": {"megatron_refit.tools.cli"},
             "megatron_refit.tools.cli": {"megatron_refit.testing.storages"}}
    assert _dry_run_reaches_testing(graph) == ["megatron_refit.tools.dryrun -> megatron_refit.tools.cli -> "
                                               "megatron_refit.testing.storages"]


def _tools_reach_test_support(graph) -> list[str]:
    return _chains(graph, lambda m: m.startswith("megatron_refit.tools") or m in ENTRY_POINTS,
                   lambda m: m == "megatron_refit.testing" or m.startswith("megatron_refit.testing."))


def test_the_tools_import_no_test_support():
    """No chain of imports, lazy ones included, from a tool (the demo, its end-to-end run in
    ``megatron_refit.local``) to ``megatron_refit.testing``: what ships runs without the tests'
    support."""
    graph = _graph()
    assert "megatron_refit.tools.demo" in graph and "megatron_refit.local.harness" in graph["megatron_refit.tools.demo"]
    assert not _tools_reach_test_support(graph)
    assert _tools_reach_test_support({"megatron_refit.tools.demo": {"megatron_refit.local.harness"},
                                      "megatron_refit.local.harness": {"megatron_refit.testing.storages"}}) == [
        "megatron_refit.tools.demo -> megatron_refit.local.harness -> megatron_refit.testing.storages"]


def test_the_engine_side_imports_nothing_of_the_train_side():
    """An engine process (``engine_side/``, every engine's ``worker/``, the HF engine) reaches no
    train-side module, directly or through any chain of imports: it runs with only its own side
    and what both share (``group/``, ``endpoint/``, ``transport/``, ``plan/``)."""
    assert not _engine_side_reaches(_graph())


def test_the_engine_side_check_catches_a_chain_to_the_train_side():
    graph = {"megatron_refit.engine_side.entry": {"megatron_refit.group.x"},
             "megatron_refit.group.x": {"megatron_refit.fleet.serving"}}
    assert _engine_side_reaches(graph) == ["megatron_refit.engine_side.entry -> megatron_refit.group.x -> "
                                           "megatron_refit.fleet.serving"]


def test_dependencies_point_down_the_layers():
    graph = _graph()
    assert len(graph) > 90 and "conversion.refit_callback" in graph and "megatron_refit.plan.spec" in graph
    upward = sorted(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
                    for m, targets in graph.items() for t in targets
                    if _layer(t) > _layer(m) and not m.startswith(t + "."))
    assert not upward, upward


def test_the_layer_check_catches_an_upward_import():
    assert _layer("megatron_refit.endpoint.sender") < _layer("megatron_refit.engines.fused.live")
    assert _layer("megatron_refit.registry") < _layer("megatron_refit.config")
    assert _layer("conversion.refit_callback") < _layer("conversion.testing.build") < _layer("megatron_refit.tools")


def test_runtime_imports_no_tooling_or_test_builders():
    graph = _graph()
    runtime = [m for m in graph if _layer(m) < _layer("conversion.testing")]
    assert "megatron_refit.endpoint.sender" in runtime and "conversion.refit_callback" in runtime
    bad = {m: sorted(t for t in graph[m] if t.startswith(("megatron_refit.tools", "megatron_refit.testing",
                                                          "conversion.testing")))
           for m in runtime}
    assert not {m: t for m, t in bad.items() if t}


def test_the_plan_layer_imports_no_torch():
    modules = sorted(m for m in _files() if m.startswith("megatron_refit.plan") or m == "megatron_refit.wire")
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))\n"
            "assert not bad, bad[:5]")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_root_holds_the_entry_points_and_little_else():
    """Layer 0 (config, errors, the engine registry, the wire format) and the entry points."""
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 9, root
    assert {"__init__.py", "errors.py", "registry.py", "refit.py"} <= set(root) and (PACKAGE / "config").is_dir()


def test_no_private_name_crosses_a_module():
    """``from x import _name`` or ``x._name`` on a project module, outside tests (Bridge's and
    vLLM's private names are behind conversion/bridge_api.py; tests/unit/test_bridge_api.py audits it)."""
    files = _files()
    found = []
    for folder in (*FOLDERS, ROOT / "scripts"):
        for path in folder.rglob("*.py"):
            tree = ast.parse(path.read_text())
            modules = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in files:
                    found += [f"{path.relative_to(ROOT)}:{node.lineno} {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
                    modules |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in files}
                elif isinstance(node, ast.Import):
                    modules |= {a.asname for a in node.names if a.asname and a.name in files}
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                        node.value.id in modules and node.attr.startswith("_") and not node.attr.startswith("__"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value.id}.{node.attr}")
    assert not found, found


def test_invariants_raise_errors_not_asserts():
    # `python -O` strips asserts: a broken invariant must still stop the refit
    found = [f"{p.relative_to(ROOT)}:{node.lineno}" for folder in (PACKAGE, ROOT / "conversion")
             for p in folder.rglob("*.py") for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Assert)]
    assert not found, found


def test_transport_registry():
    from megatron_refit.transport import (ProcessGroupTransport, Transport, open_transport, register_transport,
                                          transport_names)
    from megatron_refit.transport.ipc import IpcTransport

    assert {"gloo", "nccl", "ipc"} <= set(transport_names())
    assert issubclass(ProcessGroupTransport, Transport) and issubclass(IpcTransport, Transport)
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
    from megatron_refit.local.launch import free_ports
    from megatron_refit.transport import ProcessGroupTransport, open_transport

    (port,) = free_ports(1)
    group = open_transport("gloo", host="127.0.0.1", port=port, rank=0, world_size=1, timeout_s=30, num_train=1)
    try:
        assert isinstance(group, ProcessGroupTransport) and group.backend == "gloo" and group.direct_ok
        assert group.auto_direct_bytes(64 << 20) == 1 << 20  # host memory: 1 MiB goes direct
        from megatron_refit.transport.process_group import HEADER_VALUES

        assert group.exchange("message", [7]) == [[7] + [0] * (HEADER_VALUES - 1)]
    finally:
        group.close()


def test_refit_transport_selects_from_the_registry():
    """``refit.transport``: ``auto`` follows the mode and the device; a registered name is taken
    as it is; an unknown one is refused by name before anything connects."""
    import torch

    from megatron_refit.config import RefitConfig
    from megatron_refit.group.connect import connect
    from megatron_refit.transport import register_transport, transport_name

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert transport_name("auto", colocated=False, device=cpu) == "gloo"
    assert transport_name("auto", colocated=False, device=gpu) == "nccl"
    assert transport_name("auto", colocated=True, device=gpu) == "ipc"
    assert transport_name("gloo", colocated=False, device=gpu) == "gloo"
    register_transport("test-selected", lambda **kw: None)
    assert transport_name("test-selected", colocated=False, device=cpu) == "test-selected"
    cfg = RefitConfig(enabled=True, transport="rdma", port=1)
    with pytest.raises(ValueError, match=r"refit.transport: 'rdma' is not 'auto' or a registered transport \["):
        connect(cfg, refit_rank=0, num_train=1, device=cpu, replica=0, incarnation="a")
    with pytest.raises(ValueError, match="refit.transport must be 'auto' or a registered transport's name"):
        RefitConfig(transport="")


def test_a_transport_registered_by_name_is_what_connect_opens():
    import torch

    from megatron_refit.config import RefitConfig
    from megatron_refit.group.connect import connect
    from megatron_refit.transport import register_transport

    opened = []

    class Opened(Exception):
        pass

    def factory(**kw):
        opened.append(kw)
        raise Opened

    register_transport("test-opened", factory)
    with pytest.raises(Opened):
        connect(RefitConfig(enabled=True, transport="test-opened", port=7, gen_tp=2, gen_dp=3), refit_rank=1,
                num_train=2, device=torch.device("cpu"), replica=2, incarnation="a1")
    # one replica's group: the train ranks and its gen_tp ranks, in the train ranks' store
    assert opened[0]["rank"] == 1 and opened[0]["world_size"] == 4 and opened[0]["port"] == 7
    assert opened[0]["namespace"] == "megatron_refit/replica/2/a1"


PER_REFIT = ("probe_due", "placement", "heartbeat", "on_close", "gate")
"""What one refit tells its group (its serving probe is due, its fanout placement) and what a
member or receiver is built with (its heartbeat, its leave announcement, its engine's traffic
gate): arguments, never attributes another object sets afterwards (#66)."""


def _set_from_outside(files: dict) -> list[str]:
    found = []
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if isinstance(t, ast.Attribute) and t.attr in PER_REFIT and not (
                        isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"{module}:{node.lineno} sets .{t.attr} on another object")
    return found


def test_no_object_sets_anothers_per_refit_state_or_collaborators():
    assert not _set_from_outside(_files())


def test_the_outside_setter_check_catches_one(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(endpoint, x):\n    endpoint.placement = x\n    self_ = 1\n")
    assert _set_from_outside({"m": path}) == ["m:2 sets .placement on another object"]
