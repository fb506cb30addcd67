"""Every key a benchmark prints is documented in its module.

A benchmark module's docstring holds one section that starts with a line beginning
"JSON keys" and lists every key of the JSON it prints, one a line, indented two spaces:
the key's path, then its unit and meaning (continued on lines indented deeper). A path is
written "section.key" for a key of a nested object, "list[].key" for a key of each item of
a list, and "<what>" for a segment that is any key (a map: process names, prompt lengths).
A line whose text says "the keys of bench.NAME" hands that object to bench/NAME.py's list;
"keys as PATH": the object has the keys documented at PATH of the same list (and any of its
own lines); "(free-form)": a value that is not the benchmark's (a model's output), not looked
into. The section ends at the first blank line."""
from __future__ import annotations

import importlib
import re

HEADING = "JSON keys"
DELEGATE = re.compile(r"the keys of (bench\.\w+)")
SAME = re.compile(r"keys as ([^\s,:;]+)")
FREE = "(free-form)"
ANY = "<>"


def _segments(path: str) -> list[str]:
    out = []
    for part in path.replace("[]", ".[]").split("."):
        if not part:
            raise ValueError(f"key {path!r}: an empty segment")
        out.append(ANY if part.startswith("<") and part.endswith(">") else part)
    return out


def documented_keys(module) -> dict[str, str]:
    """path -> description, from the module's JSON keys section; a malformed section (no
    section, a key without a description, a key listed twice) is an AssertionError."""
    lines = (module.__doc__ or "").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(HEADING)]
    assert len(starts) == 1, f"{module.__name__}: expected one {HEADING!r} section in its docstring, " \
                             f"found {len(starts)}"
    keys: dict[str, str] = {}
    last = None
    for line in lines[starts[0] + 1:]:
        if not line.strip():
            break
        indent = len(line) - len(line.lstrip(" "))
        assert indent >= 2, f"{module.__name__}: {line!r}: a key line is indented two spaces"
        if indent > 2:                                   # the previous key's description, continued
            assert last is not None, f"{module.__name__}: {line!r} continues no key"
            keys[last] += " " + line.strip()
            continue
        path, _, text = line.strip().partition(" ")
        assert path not in keys, f"{module.__name__}: key {path!r} documented twice"
        keys[path], last = text.strip(), path
    for path, text in keys.items():
        assert text, f"{module.__name__}: key {path!r} has no unit or meaning"
    assert keys, f"{module.__name__}: its {HEADING!r} section lists no key"
    return keys


def _tree(module) -> dict:
    """The documented paths as a tree of segments; a node's "" entry: its description."""
    root: dict = {}
    for path, text in documented_keys(module).items():
        node = root
        for seg in _segments(path):
            node = node.setdefault(seg, {})
        node[""] = text
    return root


def _node(root: dict, path: str, module) -> dict:
    node = root
    for seg in _segments(path):
        seg = seg if seg in node else ANY
        assert seg in node, f"{module.__name__}: {path!r} is not documented"
        node = node[seg]
    return node


def undocumented_keys(obj, module, prefix: str = "") -> list[str]:
    """The paths of the keys in `obj` (a benchmark's printed JSON, or the part of it at
    `prefix`) that `module` does not document."""
    root = _tree(module)
    missing: list[str] = []

    def walk(obj, node: dict, path: str) -> None:
        text = node.get("", "")
        if FREE in text:
            return
        found = DELEGATE.search(text)
        if found:
            missing.extend(f"{path}: {m}" for m in undocumented_keys(obj, importlib.import_module(found.group(1))))
            return
        found = SAME.search(text)
        if found:
            node = {**_node(root, found.group(1), module), **node}
        if isinstance(obj, dict):
            for key, value in obj.items():
                key = str(key)
                child = node.get(key) if key not in ("", "[]", ANY) else None
                child = child if child is not None else node.get(ANY)
                where = f"{path}.{key}" if path else key
                if child is None:
                    missing.append(where)
                else:
                    walk(value, child, where)
        elif isinstance(obj, list):
            for item in obj:                # items without a "list[]" entry may hold no keys
                walk(item, node.get("[]", {}), f"{path}[]")

    walk(obj, _node(root, prefix, module) if prefix else root, prefix)
    return missing


def assert_keys_documented(obj, module, prefix: str = "") -> None:
    """Every key of `obj`, recursively (list items included), has a line in `module`'s docstring."""
    missing = undocumented_keys(obj, module, prefix)
    assert not missing, f"{module.__name__}'s docstring does not document: {', '.join(sorted(set(missing)))}"
