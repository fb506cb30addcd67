"""Write an mmproj GGUF: the element type of each tower tensor, then the file (streamed)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..convert import FILE_TYPE, Item, tensor_type as text_tensor_type
from shared.ggml_types import GGMLType
from ..gguf_writer import GGUFWriter
from shared.quants import quantize

# llama.cpp keeps the patch kernels in F16/F32 (MmprojModel.tensor_force_quant); the
# position table is added to every patch, so it keeps its precision the same way.
_FLOAT_ONLY = ("v.patch_embd.weight", "v.patch_embd.weight.1", "v.position_embd.weight")


def tensor_type(name: str, shape: tuple, out_type: GGMLType) -> GGMLType:
    """The ggml type a tower tensor is stored in for a file type: vectors F32, the
    patch kernels and positions F16 (F32 in an f32 file), matrices as the text model's."""
    if len(shape) < 2:
        return GGMLType.F32
    if name in _FLOAT_ONLY:
        return GGMLType.F32 if out_type == GGMLType.F32 else GGMLType.F16
    return text_tensor_type(name, shape, out_type)


def write_mmproj(out_path, meta: dict, items: list[Item], out_type: GGMLType, progress: bool = False) -> None:
    """Declare every tensor, then stream them one at a time."""
    from tqdm import tqdm

    meta = dict(meta, **{"general.file_type": FILE_TYPE[out_type]})
    types = {it.name: tensor_type(it.name, it.shape, out_type) for it in items}
    with GGUFWriter(out_path) as w:
        for k, v in meta.items():
            w.add(k, v)
        for it in items:
            w.add_tensor(it.name, it.shape, types[it.name])
        for it in tqdm(items, desc=f"writing {Path(out_path).name}", unit="tensor", disable=not progress):
            data = np.asarray(it.produce(), dtype=np.float32).reshape(it.shape)
            w.write_tensor(it.name, quantize(data, types[it.name]))
