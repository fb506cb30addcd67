"""docs/development.md's package map names every module of the source tree, the way the
benchmark keys are held to their documentation: a module added without a word there fails."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAP = ROOT / "docs" / "development.md"
PACKAGES = ["shared", "modeltools", "coordinator", "frontend", "fermoe", "cpu_worker", "gpu_worker", "native",
            "bench", "tools"]
UNNAMED = {"__init__", "__main__"}          # a package's own files: the package's line names them


def package_map() -> dict[str, str]:
    """Each top-level folder's entry in the map (the code block that lists them)."""
    block = MAP.read_text().split("```\nshared/", 1)[1].split("```", 1)[0]
    entries = re.split(r"^(?=[a-z_]+/\s)", "shared/" + block, flags=re.M)
    return {e.split("/", 1)[0]: e for e in entries if e.strip()}


def unnamed_modules() -> list[str]:
    entries = package_map()
    missing = []
    for package in PACKAGES:
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", entries.get(package, "")))
        for path in sorted((ROOT / package).rglob("*.py")):
            inside = path.relative_to(ROOT / package)
            names = [p for p in inside.parts[:-1]] + [path.stem]
            if path.stem in UNNAMED or "data" in inside.parts:
                continue
            if any(name not in words for name in names):
                missing.append(str(path.relative_to(ROOT)))
    return missing


def test_every_module_is_named_in_the_package_map():
    missing = unnamed_modules()
    assert not missing, f"name these in docs/development.md's package map: {missing}"
