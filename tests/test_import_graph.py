"""The packages' layering: each imports only packages below it (so there is no cycle), and
no serving process's package imports the offline model tools, benchmarks or commands; the
HTTP front end, a process of its own, imports only shared/; and no two modules import
each other, directly or round a longer circle."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A package may import the packages listed before it, never one after it.
LAYERS = ["shared", "native", "modeltools", "cpu_worker", "gpu_worker", "coordinator", "frontend", "bench", "fermoe",
          "tools"]
SERVING = {"shared", "native", "cpu_worker", "gpu_worker", "coordinator", "frontend"}
OFFLINE = {"modeltools", "bench", "fermoe", "tools"}


def imports_of(path: Path) -> set[str]:
    """The top-level project packages `path` imports, lazily inside functions included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & set(LAYERS)


def package_graph() -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = {p: {} for p in LAYERS}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in imports_of(path) - {package}:
                graph[package].setdefault(target, []).append(str(path.relative_to(ROOT)))
    return graph


def test_every_package_imports_only_packages_below_it():
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = [f"{src} imports {dst} in {files}" for src, targets in package_graph().items()
              for dst, files in targets.items() if rank[dst] > rank[src]]
    assert not upward, "\n".join(upward)


def test_no_serving_package_imports_the_offline_tools():
    graph = package_graph()
    bad = [f"{src} imports {dst} in {graph[src][dst]}" for src in SERVING for dst in OFFLINE if dst in graph[src]]
    assert not bad, "\n".join(bad)


def test_the_front_end_imports_only_shared():
    """frontend/ is the HTTP process, a client of the coordinator: what it shares with the daemon
    (the wire messages, the HTTP options) is in shared/; the daemon only runs `python -m frontend`."""
    graph = package_graph()
    assert set(graph["frontend"]) <= {"shared"}, graph["frontend"]
    importers = {src: targets["frontend"] for src, targets in graph.items() if "frontend" in targets}
    assert set(importers) <= {"fermoe"}, importers      # `fermoe serve` runs a front end alone


def test_the_graph_is_read_from_the_code(tmp_path):
    """The reader sees lazy imports inside functions (what a serving process would hit late)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from modeltools.synth import preset_config\n    import shared.model\n")
    assert imports_of(module) == {"modeltools", "shared"}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, modules: set[str], root: Path = ROOT) -> set[str]:
    """The project modules `path` imports, lazily inside functions included, relative imports
    resolved: `from .x import y` is x (or x.y where y is a module), `from . import y` is y."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:       # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def module_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for package in LAYERS for p in sorted((ROOT / package).rglob("*.py"))}
    return {name: module_imports(path, set(paths)) for name, path in paths.items()}


def circles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_module_imports_one_that_imports_it_back():
    """A circle of imports (a imports b, b imports a, lazily or not) makes neither module readable
    without the other; what both need goes in a third module they import."""
    found = circles(module_graph())
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_module_graph_resolves_relative_and_lazy_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from .a import g\n")
    (package / "c.py").write_text("from pkg.b import f\nimport pkg.a\n")
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c"}
    graph = {f"pkg.{m}": module_imports(package / f"{m}.py", modules, tmp_path) for m in "abc"}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b", "pkg.a"}}
    assert circles(graph) == [("pkg.a", "pkg.b")]
