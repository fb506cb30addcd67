"""The training text of the built-in `tiny` model: the Python standard library's own
documentation strings (PSF License, the same text on every CPython 3.11 install).

Recipe, exactly:
  1. every *.py file under the running interpreter's stdlib directory
     (sysconfig "stdlib"), sorted by relative path, except site-packages/ and any
     path with a directory named test, tests or idle_test;
  2. from each, the docstrings of the module and of every class and function
     (ast.get_docstring: dedented as inspect.cleandoc does), in ast.walk order;
     pydoc_data/topics.py instead gives its `topics` texts (the language reference
     sections pydoc shows), one document per topic, in key order;
  3. exact duplicates dropped (the first one kept), documents joined by a blank line;
  4. split by source: crc32 of the file's relative path (of "pydoc_data/topics.py:NAME"
     for a topic) modulo 20 is 0 for the held-out text, 1 for the calibration text,
     anything else for training.

`python3 tools/stdlib_text.py OUT_DIR` writes train.txt, heldout.txt and calib.txt
there; the held-out and calibration texts are committed as shared/data/stdlib/*.txt
(not in shared/data/ itself: its *.txt teach the synthetic vocabulary), so tests and
figures do not depend on the local Python's patch release.
"""
from __future__ import annotations

import ast
import sys
import sysconfig
import zlib
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages"}
TOPICS = "pydoc_data/topics.py"
SPLITS = {0: "heldout", 1: "calib"}          # crc32 % 20; everything else is train


def stdlib_files(root: Path) -> list[Path]:
    return sorted((p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts[:-1])),
                  key=lambda p: p.relative_to(root).as_posix())


def docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one file, in ast.walk order."""
    try:
        tree = ast.parse(source)
    except SyntaxError:          # a few lib2to3 fixtures are not Python 3
        return []
    nodes = (n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                                         ast.AsyncFunctionDef)))
    return [d for d in map(ast.get_docstring, nodes) if d]


def topics(source: str) -> dict[str, str]:
    """pydoc_data.topics.topics without importing it."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "topics":
            return ast.literal_eval(node.value)
    return {}


def documents(root: Path) -> list[tuple[str, str]]:
    """(split key, text) of every document, duplicates removed."""
    out, seen = [], set()
    for path in stdlib_files(root):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8", errors="replace")
        pairs = ([(f"{rel}:{k}", v.strip()) for k, v in sorted(topics(source).items())] if rel == TOPICS
                 else [(rel, d.strip()) for d in docstrings(source)])
        for key, text in pairs:
            if text and text not in seen:
                seen.add(text)
                out.append((key, text))
    return out


def split_texts(root: Path) -> dict[str, str]:
    parts: dict[str, list[str]] = {"train": [], "heldout": [], "calib": []}
    for key, text in documents(root):
        parts[SPLITS.get(zlib.crc32(key.encode()) % 20, "train")].append(text)
    return {name: "\n\n".join(docs) + "\n" for name, docs in parts.items()}


def main(argv=None) -> None:
    out = Path((argv or sys.argv[1:])[0])
    out.mkdir(parents=True, exist_ok=True)
    root = Path(sysconfig.get_paths()["stdlib"])
    for name, text in split_texts(root).items():
        (out / f"{name}.txt").write_text(text, encoding="utf-8")
        print(f"{name}: {len(text)} characters", file=sys.stderr)
    print(f"from {root} (Python {sys.version.split()[0]})", file=sys.stderr)


if __name__ == "__main__":
    main()
