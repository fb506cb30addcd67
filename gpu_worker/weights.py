"""The model's weights on the GPU side: every non-expert tensor resident in VRAM in
the type the kernels read (F32, F16, Q4_0, Q8_0; vectors and BF16 become F32), and
the routed experts laid out per layer for streaming: expert e of a layer is
[gate_e | up_e | down_e], experts one after the other, so a layer crosses PCIe as
one copy and one expert as one copy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.errors import FermoeError
from shared.expert_segment import EXPERT_TENSORS, pack_layer
from shared.ggml_types import GGMLType, tensor_nbytes
from shared.model import Layer, Model, Weight

from .buffers import DeviceArray
from .kernels import KERNEL_TYPES

F32_ONLY = ("ssm_conv1d",)          # read element by element by gdn_conv


@dataclass
class GpuWeight:
    data: DeviceArray        # raw rows in `wtype`
    wtype: str               # f32, f16, q4_0, q8_0
    shape: tuple             # numpy order: [rows, cols] or [n]

    def __int__(self):
        return int(self.data)


def kernel_form(w: Weight) -> tuple[np.ndarray, str]:
    """The bytes and type a weight is kept in on the GPU."""
    if _as_f32(w):
        return np.ascontiguousarray(w.f32(), np.float32).view(np.uint8).reshape(-1), "f32"
    return w.raw, KERNEL_TYPES[w.qtype]


def _as_f32(w: Weight) -> bool:
    return len(w.shape) == 1 or w.qtype not in KERNEL_TYPES or w.name.split(".")[-2] in F32_ONLY


def kernel_nbytes(w: Weight) -> int:
    return 4 * int(np.prod(w.shape)) if _as_f32(w) else tensor_nbytes(w.qtype, w.shape)


def upload_weight(device, w: Weight) -> GpuWeight:
    raw, wtype = kernel_form(w)
    host = raw.view(np.float32).reshape(w.shape) if wtype == "f32" else raw
    return GpuWeight(DeviceArray.of(device, host), wtype, w.shape)


def resident_tensors(layer: Layer) -> dict[str, Weight]:
    """The tensors of a block that stay in VRAM: all but the routed experts; the shared
    expert's gate and up as one matrix of their rows, ffn_gate_up_shexp (one GEMM, its
    SwiGLU fused into the down projection's load)."""
    out = {name: w for name, w in vars(layer).items() if isinstance(w, Weight) and name not in EXPERT_TENSORS}
    if "ffn_gate_shexp" in out:
        out["ffn_gate_up_shexp"] = _stack_rows(out.pop("ffn_gate_shexp"), out.pop("ffn_up_shexp"))
    return out


def _stack_rows(a: Weight, b: Weight) -> Weight:
    """[a; b]: b's rows after a's, in their type when they share one (F32 otherwise)."""
    name = a.name.replace("ffn_gate_shexp", "ffn_gate_up_shexp")
    shape = (a.shape[0] + b.shape[0], a.shape[1])
    if a.qtype == b.qtype and not _as_f32(a):
        return Weight(name, a.qtype, shape, np.concatenate([a.raw, b.raw]))
    values = np.concatenate([a.f32(), b.f32()]).astype(np.float32)
    return Weight(name, GGMLType.F32, shape, values.view(np.uint8).reshape(-1))


def resident_nbytes(model: Model) -> int:
    """VRAM the resident weights take (the LM head and final norm included; the
    embedding table stays on the host: a prompt's rows are gathered there)."""
    total = kernel_nbytes(model.output) + kernel_nbytes(model.output_norm)
    for layer in model.layers:
        total += sum(kernel_nbytes(w) for w in resident_tensors(layer).values())
    return total


class ResidentWeights:
    """Every non-expert tensor of the model in VRAM: `layers[i][gguf name]`, `output`, `output_norm`."""

    def __init__(self, device, model: Model):
        self.output = upload_weight(device, model.output)
        self.output_norm = upload_weight(device, model.output_norm)
        self.layers = [{name: upload_weight(device, w) for name, w in resident_tensors(layer).items()}
                       for layer in model.layers]


@dataclass(frozen=True)
class ExpertLayout:
    """Where an expert's matrices sit in its [gate | up | down] record."""
    gate_up_type: str
    down_type: str
    expert_bytes: int
    down_offset: int

    @classmethod
    def of(cls, layer: Layer) -> "ExpertLayout":
        gate, up, down = (getattr(layer, name) for name in EXPERT_TENSORS)
        types = [KERNEL_TYPES.get(w.qtype) for w in (gate, up, down)]
        if None in types or types[0] != types[1]:
            raise FermoeError(f"blk.{layer.index}: experts in {gate.qtype.name}/{up.qtype.name}/{down.qtype.name}; "
                              "the GPU engine streams F32, F16, Q4_0 or Q8_0 experts, gate and up alike")
        g, u, d = (tensor_nbytes(w.qtype, w.shape[1:]) for w in (gate, up, down))
        return cls(types[0], types[2], g + u + d, g + u)


def pack_experts(layer: Layer, out: np.ndarray) -> None:
    """Write a layer's experts into `out` as consecutive [gate | up | down] records."""
    ExpertLayout.of(layer)                  # refuses what the kernels cannot read
    pack_layer(layer, out)
