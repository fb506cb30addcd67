"""Test helper: copy a GGUF with some metadata or tensors changed, to make the
broken and unusual files real models meet (mixed types, MTP block, no LM head)."""
from __future__ import annotations

import numpy as np

from shared.gguf_file import GGUFFile
from modeltools.gguf_writer import GGUFWriter

DROP = object()


def rewrite_gguf(src, dst, meta=None, tensors=None, types=None):
    """meta: {key: value or DROP}; tensors: {name: (shape, qtype, raw bytes) or DROP};
    types: {key: GGUFValueType} for keys of meta that must not have the inferred type."""
    meta, tensors, types = meta or {}, tensors or {}, types or {}
    with GGUFFile(src) as f, GGUFWriter(dst) as w:
        for key, value in f.metadata.items():
            if key in meta:
                if meta[key] is not DROP:
                    w.add(key, meta[key])
            else:
                w.add(key, value, f.metadata_types[key])   # keep the exact type
        for key, value in meta.items():
            if key not in f.metadata and value is not DROP:
                w.add(key, value, types.get(key))
        plan = {}
        for name, info in f.tensors.items():
            plan[name] = (info.shape, info.qtype, np.array(f.raw(name)))
        plan.update(tensors)
        plan = {n: t for n, t in plan.items() if t is not DROP}
        for name, (shape, qtype, _) in plan.items():
            w.add_tensor(name, shape, qtype)
        for name, (_, _, raw) in plan.items():
            w.write_tensor(name, raw)
