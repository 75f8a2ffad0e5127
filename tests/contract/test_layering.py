"""The architecture as tests: the core imports no app, nothing imports in a cycle, the
wheel ships every package under one import name (that the registry needs no torch,
in fresh interpreters: tests/integration/agent/test_registry_without_torch.py).

The core is every module physically under ``edgepfl/`` except the command-line entry
points (``cli``, ``__main__``), which start the apps. The apps are ``coordinator/``,
``edge_agent/`` and ``export/``, installed as ``edgepfl.coordinator`` and so on.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
APPS = {"coordinator": "edgepfl.coordinator", "edge_agent": "edgepfl.edge_agent", "export": "edgepfl.export"}
ENTRY_POINTS = {"edgepfl.cli", "edgepfl.__main__"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] in APPS:
        parts = APPS[parts[0]].split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for top in ("edgepfl", *APPS):
        for path in (ROOT / top).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, *, module_level_only: bool, type_checking: bool = False) -> set[str]:
    """Absolute names of the edgepfl modules ``name`` imports (relative imports resolved);
    with ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    nodes: list[ast.AST] = []

    def collect(body: list[ast.stmt]) -> None:  # `if TYPE_CHECKING:` blocks never run
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                collect(node.body if type_checking else [])
                collect(node.orelse)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and module_level_only:
                continue
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                nodes.append(node)
            else:
                for field in ("body", "orelse", "finalbody", "handlers"):
                    collect(getattr(node, field, None) or [])

    collect(tree.body)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return {m for m in out if m == "edgepfl" or m.startswith("edgepfl.")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_app(name: str) -> bool:
    return any(name == a or name.startswith(a + ".") for a in APPS.values())


def test_the_core_imports_no_app_package():
    modules = _modules()
    offenders = []
    for name, path in sorted(modules.items()):
        if _is_app(name) or name in ENTRY_POINTS:
            continue
        for imported in _imports(name, path, module_level_only=False):
            if _is_app(imported):
                offenders.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert not offenders, "the core must not import the apps:\n" + "\n".join(offenders)


#: the only imports from one app into another (docs/ARCHITECTURE.md): the coordinator exports
#: its releases with the export app's ONNX exporter; the head agent runs the exported encoder
#: and heads (and ``serve`` runs them for the device's owner), and fits a release's heads in a
#: child process (``head_fit``).
#: Everything else between apps goes through the protocol, or is wired together by an entry point
#: (``edgepfl simulate --in-process`` hands the coordinator the agent app's in-process trainers).
ALLOWED_APP_EDGES = {
    ("edgepfl.coordinator", "edgepfl.export"): {"edgepfl.coordinator.releases.release -> edgepfl.export.onnx_export"},
    ("edgepfl.edge_agent", "edgepfl.export"): {"edgepfl.edge_agent.head_fit -> edgepfl.export.heads",
                                               "edgepfl.edge_agent.head_tier -> edgepfl.export.heads",
                                               "edgepfl.edge_agent.head_tier -> edgepfl.export.predict",
                                               "edgepfl.edge_agent.serve -> edgepfl.export.predict"},
}


def _app_of(name: str) -> str | None:
    return next((a for a in APPS.values() if name == a or name.startswith(a + ".")), None)


def test_the_apps_import_each_other_only_where_the_architecture_allows():
    """Counting imports inside functions too: a lazy import is still an edge."""
    modules = _modules()
    edges = set()
    for name, path in sorted(modules.items()):
        app = _app_of(name)
        if app is None:
            continue
        for imported in _imports(name, path, module_level_only=False):
            other = _app_of(imported)
            if other is not None and other != app:
                edges.add(f"{name} -> {_resolve(imported, modules)}")
    allowed = set().union(*ALLOWED_APP_EDGES.values())
    assert edges <= allowed, "app -> app imports the architecture does not allow:\n" + "\n".join(sorted(edges - allowed))
    assert allowed <= edges, f"stale entries in ALLOWED_APP_EDGES: {sorted(allowed - edges)}"


def test_the_protocol_imports_neither_the_config_nor_the_method_registry():
    """Tasks and releases carry the run spec; validating it against methods is the receivers' job."""
    modules = _modules()
    forbidden = ("edgepfl.config", "edgepfl.methods")
    offenders = [f"{path.relative_to(ROOT)} imports {imported}"
                 for name, path in sorted(modules.items()) if name.startswith("edgepfl.protocol")
                 for imported in _imports(name, path, module_level_only=False)
                 if any(imported == f or imported.startswith(f + ".") for f in forbidden)]
    assert not offenders, "\n".join(offenders)


def test_no_import_cycle():
    """Counting imports inside functions and under ``TYPE_CHECKING`` too: a lazy or a
    type-only import hides a cycle, it does not remove it."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {_resolve(m, modules) for m in _imports(name, path, module_level_only=False, type_checking=True)}
        # importing a submodule runs its package's __init__ first; that edge is not a cycle of ours
        graph[name] = {d for d in deps if d and d != name and not name.startswith(d + ".")}
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_wheel_lists_every_package_under_the_edgepfl_name():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    present = {_module_name(p) for top in ("edgepfl", *APPS) for p in (ROOT / top).rglob("__init__.py")}
    assert listed == present, f"missing from pyproject: {sorted(present - listed)}; stale: {sorted(listed - present)}"
    assert all(p == "edgepfl" or p.startswith("edgepfl.") for p in listed)
    assert config["package-dir"] == {v: k for k, v in APPS.items()}


def test_the_coordinator_class_is_only_the_round_loop():
    """Run directory, rollback, results, tasks, buffered states, waiting and the
    closed rounds' windows live in their own modules; the class that reads like the protocol
    stays at most 300 lines, so the next feature lands beside it, not in it."""
    import inspect

    from edgepfl.coordinator.rounds import Coordinator

    lines = inspect.getsource(Coordinator).splitlines()
    assert len(lines) <= 300, f"Coordinator has {len(lines)} lines"


def test_every_test_module_has_a_name_of_its_own():
    """One subject, one name: two test files of one base name in two folders leave a reader
    (and pytest's -k, and a failure line) unsure which subject failed."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")) + sorted((ROOT / "research").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"test files sharing a name: {twins}"


def test_the_coordinator_side_is_wired_in_one_place():
    """The composition root builds the coordinator's collaborators (coordinator/wiring.py), so
    ``Coordinator.__init__`` stays short, and one place on the coordinator side reads its key files."""
    tree = ast.parse((ROOT / "coordinator" / "rounds.py").read_text())
    coordinator = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Coordinator")
    init = next(n for n in coordinator.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert init.end_lineno is not None and init.end_lineno - init.lineno + 1 <= 20
    loaders = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "coordinator").rglob("*.py")
                     if "load_signer(" in path.read_text())
    assert loaders == ["coordinator/credentials.py"]
