"""A GGUF model bound to its config: every tensor by its GGUF name, shapes checked.

Weights stay in the memory-mapped file. Types we compute in (F32, F16, BF16, Q4_0,
Q8_0) are used in place; the K-quants and Q5_0 that real files mix in are
converted once at load, to Q8_0 (matrices) or F32 (vectors).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .config import ModelConfig
from .errors import GGUFError
from .ggml_types import GGMLType, row_nbytes
from .gguf_file import GGUFFile
from .quants import DEQUANTIZABLE, dequantize, quantize

NATIVE_TYPES = {GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q8_0}
# Dequantising a whole expert tensor at once is fine below this; above it, per expert.
_WHOLE_F32_LIMIT = 64 << 20


@dataclass
class Weight:
    """One tensor: raw bytes in a ggml type plus a numpy-order shape."""
    name: str
    qtype: GGMLType
    shape: tuple
    raw: np.ndarray                      # uint8, a view into the mapped file where possible
    _f32: np.ndarray | None = field(default=None, repr=False)

    def f32(self) -> np.ndarray:
        """The whole tensor in float32 (cached: the reference reads it every token)."""
        if self._f32 is None:
            self._f32 = dequantize(self.raw, self.qtype, self.shape)
        return self._f32

    def release(self) -> None:
        """Drop the cached float32 copy (a pass over a large model holds one layer's at a time)."""
        self._f32 = None

    def rows(self, index: int) -> np.ndarray:
        """Slice `index` of the outermost dimension in float32 (one expert of a 3-D tensor)."""
        n_elem = int(np.prod(self.shape) * 4)
        if self._f32 is not None or n_elem <= _WHOLE_F32_LIMIT:
            return self.f32()[index]
        inner = self.shape[1:]
        nbytes = len(self.raw) // self.shape[0]
        return dequantize(self.raw[index * nbytes:(index + 1) * nbytes], self.qtype, inner)

    def take(self, ids) -> np.ndarray:
        """Float32 rows `ids` of a 2-D weight (embedding lookup) without dequantising the rest."""
        picked = self.select_rows(np.asarray(ids, dtype=np.int64), self.name)
        return dequantize(picked.raw, picked.qtype, picked.shape)

    def select_rows(self, rows: np.ndarray, name: str) -> "Weight":
        """A new 2-D weight made of some rows of this one (row order changes, not values)."""
        per_row = row_nbytes(self.qtype, self.shape[-1])
        raw = self.raw.reshape(self.shape[0], per_row)[rows].reshape(-1)
        return Weight(name, self.qtype, (len(rows), self.shape[-1]), raw)


class Layer:
    """Weights of one block; attribute names are the GGUF tensor names."""

    def __init__(self, index: int, kind: str):
        self.index = index
        self.kind = kind                 # "attention" or "gdn"

    def release(self) -> None:
        """Drop every weight's cached float32 copy."""
        for value in vars(self).values():
            if isinstance(value, Weight):
                value.release()


def expected_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple]:
    """Numpy-order shape of every tensor of block `layer`, from the config alone."""
    d, hd = cfg.n_embd, cfg.head_dim
    shapes = {
        "attn_norm": (d,), "post_attention_norm": (d,),
        "ffn_gate_inp": (cfg.n_expert, d),
        "ffn_gate_exps": (cfg.n_expert, cfg.n_ff_exp, d),
        "ffn_up_exps": (cfg.n_expert, cfg.n_ff_exp, d),
        "ffn_down_exps": (cfg.n_expert, d, cfg.n_ff_exp),
    }
    if cfg.n_ff_shexp:
        shapes.update({
            "ffn_gate_inp_shexp": (d,),
            "ffn_gate_shexp": (cfg.n_ff_shexp, d), "ffn_up_shexp": (cfg.n_ff_shexp, d),
            "ffn_down_shexp": (d, cfg.n_ff_shexp),
        })
    if cfg.is_attention(layer):
        shapes.update({
            "attn_q": (2 * cfg.n_head * hd, d), "attn_k": (cfg.n_head_kv * hd, d),
            "attn_v": (cfg.n_head_kv * hd, d), "attn_output": (d, cfg.n_head * hd),
            "attn_q_norm": (hd,), "attn_k_norm": (hd,),
        })
    else:
        hv = cfg.ssm_v_heads
        shapes.update({
            "attn_qkv": (cfg.conv_channels, d), "attn_gate": (cfg.ssm_d_inner, d),
            "ssm_conv1d": (cfg.conv_channels, cfg.ssm_conv_kernel),
            "ssm_dt": (hv,), "ssm_a": (hv,), "ssm_norm": (cfg.ssm_head_v_dim,),
            "ssm_out": (d, cfg.ssm_d_inner),
        })
        if cfg.arch == "qwen3next":
            shapes["ssm_ba"] = (2 * hv, d)
        else:
            shapes.update({"ssm_beta": (hv, d), "ssm_alpha": (hv, d)})
    return shapes


def gguf_tensor_name(layer: int, attr: str) -> str:
    suffix = {"ssm_dt": ".bias", "ssm_a": ""}.get(attr, ".weight")
    return f"blk.{layer}.{attr}{suffix}"


# Set in the metadata of every file `fermoe synth` writes (text model and mmproj).
RANDOM_WEIGHTS_KEY = "fermoe.random_weights"


def has_random_weights(metadata: dict) -> bool:
    return bool(metadata.get(RANDOM_WEIGHTS_KEY, False))


def random_weights_notice(model: str) -> str:
    """The one line every command prints (or logs) for a model of random weights."""
    return f"{model} has random weights (written by fermoe synth): its output is noise, for speed measurements only"


class Model:
    """A loaded model: `config`, `token_embd`, `output_norm`, `output`, `layers`."""

    def __init__(self, path, convert: bool = True):
        """convert=False: tensors of types the engines do not run are checked readable but
        left as they are, not converted (for a process that runs no layer: the coordinator)."""
        self.path, self.convert = str(path), convert
        self.file = GGUFFile(path)
        self.config = ModelConfig.from_metadata(self.file.metadata, self.path)
        cfg = self.config
        self.token_embd = self._weight("token_embd.weight", (cfg.n_vocab, cfg.n_embd))
        self.output_norm = self._weight("output_norm.weight", (cfg.n_embd,))
        if "output.weight" in self.file.tensors:
            self.output = self._weight("output.weight", (cfg.n_vocab, cfg.n_embd))
        else:                            # tied embeddings: llama.cpp falls back the same way
            self.output = self.token_embd
        self.layers = [self._load_layer(i) for i in range(cfg.n_layer)]
        self._tokenizer = None

    @property
    def fingerprint(self) -> str:
        return self.file.fingerprint

    def extend_context(self, positions: int) -> None:
        """Let sequences reach `positions` when that is more than the file's context length
        (the coordinator's --max-model-len above it: llama.cpp's -c beyond n_ctx_train). The
        RoPE is not rescaled: past the trained length the model's output is unreliable."""
        if positions > self.config.n_ctx_train:
            self.config = replace(self.config, n_ctx_train=positions)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from .tokenizer import Tokenizer
            self._tokenizer = Tokenizer.from_metadata(self.file.metadata)
        return self._tokenizer

    def close(self):
        self.file.close()

    def _load_layer(self, i: int) -> Layer:
        layer = Layer(i, "attention" if self.config.is_attention(i) else "gdn")
        for attr, shape in expected_shapes(self.config, i).items():
            setattr(layer, attr, self._weight(gguf_tensor_name(i, attr), shape))
        if hasattr(layer, "ssm_ba"):
            self._split_ssm_ba(layer)
        return layer

    def _split_ssm_ba(self, layer: Layer) -> None:
        """Qwen3-Next fuses beta and alpha: rows per key head are [b x r, a x r]."""
        hv, hk = self.config.ssm_v_heads, self.config.ssm_k_heads
        r = hv // hk
        order = np.arange(2 * hv).reshape(hk, 2, r)
        layer.ssm_beta = layer.ssm_ba.select_rows(order[:, 0].reshape(-1), f"blk.{layer.index}.ssm_beta")
        layer.ssm_alpha = layer.ssm_ba.select_rows(order[:, 1].reshape(-1), f"blk.{layer.index}.ssm_alpha")
        del layer.ssm_ba

    def _weight(self, name: str, shape: tuple) -> Weight:
        info = self.file.tensors.get(name)
        if info is None:
            raise GGUFError(self.path, f"missing tensor {name}")
        got = tuple(info.shape)
        # llama.cpp drops trailing 1-sized ggml dims, so [1, d] and [d] are the same tensor.
        while len(got) > len(shape) and got[0] == 1:
            got = got[1:]
        if got != tuple(shape):
            raise GGUFError(self.path, f"tensor {name} has shape {list(info.shape)}, "
                            f"but the metadata implies {list(shape)}")
        w = Weight(name, info.qtype, tuple(shape), self.file.raw(name))
        if info.qtype in NATIVE_TYPES:
            return w
        if not self.convert:
            if info.qtype not in DEQUANTIZABLE:
                raise GGUFError(self.path, f"tensor {name}: cannot dequantize {GGMLType(info.qtype).name}: only "
                                           f"{', '.join(t.name for t in DEQUANTIZABLE)}")
            return w
        return _convert_at_load(w, self.path)


def _convert_at_load(w: Weight, path: str) -> Weight:
    """K-quants and friends become Q8_0 (rows of whole blocks) or F32, once."""
    try:
        values = dequantize(w.raw, w.qtype, w.shape)
    except ValueError as e:         # a type we cannot read: one line naming the tensor, not a traceback
        raise GGUFError(path, f"tensor {w.name}: {e}") from None
    target = GGMLType.Q8_0 if len(w.shape) >= 2 and w.shape[-1] % 32 == 0 else GGMLType.F32
    return Weight(w.name, target, w.shape, quantize(values, target).reshape(-1))
