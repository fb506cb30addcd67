"""The packages' layering: each imports only packages below it (so there is no cycle), and
no serving process's package imports the offline model tools, benchmarks or commands."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A package may import the packages listed before it, never one after it.
LAYERS = ["shared", "native", "modeltools", "cpu_worker", "gpu_worker", "coordinator", "bench", "fermoe", "tools"]
SERVING = {"shared", "native", "cpu_worker", "gpu_worker", "coordinator"}
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


def test_the_graph_is_read_from_the_code(tmp_path):
    """The reader sees lazy imports inside functions (what a serving process would hit late)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from modeltools.synth import preset_config\n    import shared.model\n")
    assert imports_of(module) == {"modeltools", "shared"}
