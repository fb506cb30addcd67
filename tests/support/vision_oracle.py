"""Tiny random Hugging Face vision towers (Qwen3_5MoeVisionModel) and multimodal models
as oracles: built, re-scaled so activations are O(1), read through the converter's
name map, and run on pixels already a multiple of 32 (so nothing is resized)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = __import__("pytest").importorskip("torch")
transformers = __import__("pytest").importorskip("transformers")

from shared.vision.config import VisionConfig  # noqa: E402
from modeltools.vision.convert import plan  # noqa: E402

# Shapes: the real position table (48 x 48, so resampling is real), odd head counts,
# one and three blocks; every width whole 32-blocks so Q8_0 files quantise them.
TOWERS = {
    "a": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=64),
    "b": dict(depth=3, hidden_size=96, intermediate_size=160, num_heads=3, out_hidden_size=32),
    "c": dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=96,
              num_position_embeddings=256),
}
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                "size": {"longest_edge": 16777216, "shortest_edge": 65536}}


def hf_vision_config(shape: str):
    kw = dict(patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304)
    kw.update(TOWERS[shape])
    return transformers.Qwen3_5MoeVisionConfig(**kw)


@torch.no_grad()
def rescale(module, seed: int) -> None:
    """O(1) activations; LayerNorms away from (1, 0) so their weights and biases are tested."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in module.named_parameters():
        rand = torch.randn(p.shape, generator=g)
        if "norm" in name:
            p.copy_((1 if name.endswith("weight") else 0) + 0.1 * rand)
        elif name.endswith("bias"):
            p.copy_(0.1 * rand)
        elif "pos_embed" in name:
            p.copy_(0.5 * rand)
        else:
            p.copy_(rand / np.sqrt(p[0].numel()))


def build_hf_tower(shape: str, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeVisionModel._from_config(hf_vision_config(shape), attn_implementation="eager")
    rescale(model, seed)
    return model.eval()


class _StateDict:
    """A state dict read as a Checkpoint (names, shape, load)."""

    def __init__(self, module, prefix: str = "model.visual."):
        self.tensors = {prefix + k: v.detach().float().numpy() for k, v in module.state_dict().items()}
        self.names = list(self.tensors)

    def shape(self, name):
        return self.tensors[name].shape

    def load(self, name):
        return self.tensors[name]


class StateDictTower:
    """An HF tower's weights under llama.cpp's names, through the converter's own map."""

    def __init__(self, module):
        c = module.config
        self.config = VisionConfig(n_embd=c.hidden_size, n_ff=c.intermediate_size, n_layer=c.depth,
                                   n_head=c.num_heads, patch_size=c.patch_size,
                                   image_size=int(np.sqrt(c.num_position_embeddings)) * c.patch_size,
                                   n_merge=c.spatial_merge_size, projection_dim=c.out_hidden_size)
        self._items = {it.name: it for it in plan(_StateDict(module), self.config)}

    def f32(self, name):
        return np.asarray(self._items[name].produce(), np.float32)


def hf_patchify(img: np.ndarray) -> np.ndarray:
    """[3, H, W] normalised pixels -> [gh*gw, 1536] rows (Hugging Face's processor steps, in torch)."""
    t = torch.from_numpy(np.ascontiguousarray(img, np.float32))
    gh, gw = t.shape[1] // 16, t.shape[2] // 16
    return (t.reshape(3, gh // 2, 2, 16, gw // 2, 2, 16).permute(1, 4, 2, 5, 0, 3, 6)
            .unsqueeze(5).expand(-1, -1, -1, -1, -1, 2, -1, -1).reshape(gh * gw, 1536)).numpy()


@torch.no_grad()
def hf_encode(model, images: list[np.ndarray]):
    """(pooler_output per image, hidden_states of the batch) of HF's tower on normalised images,
    in the model's dtype (model.double() for a float64 oracle)."""
    dtype = next(model.parameters()).dtype
    pixels = torch.from_numpy(np.concatenate([hf_patchify(im) for im in images])).to(dtype)
    thw = torch.tensor([[1, im.shape[1] // 16, im.shape[2] // 16] for im in images])
    out = model(pixels, grid_thw=thw, output_hidden_states=True)
    sizes = [im.shape[1] * im.shape[2] // 16 ** 2 // 4 for im in images]
    return np.split(out.pooler_output.numpy(), np.cumsum(sizes)[:-1]), [h.numpy() for h in out.hidden_states]


def random_image(h: int, w: int, seed: int) -> np.ndarray:
    """A normalised [3, h, w] image in [-1, 1] with structure (a gradient plus noise)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * yy + c) * np.cos(4 * xx - c) for c in range(3)])
    return np.clip(0.7 * base + 0.3 * rng.uniform(-1, 1, (3, h, w)), -1, 1).astype(np.float32)


def vision_token_ids() -> dict:
    """The config's vision token ids: those of the synthetic tokenizer the checkpoint is saved with."""
    from modeltools.synth_vocab import synth_tokenizer_metadata
    from tests.support.hf_oracle import VOCAB
    tokens = synth_tokenizer_metadata(VOCAB, seed=0)["tokenizer.ggml.tokens"]
    names = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
             "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
    return {key: tokens.index(text) for key, text in names.items()}


@torch.no_grad()
def hf_multimodal_logits(model, ids, images: list[np.ndarray]) -> np.ndarray:
    """HF's logits of every position of an expanded prompt with its images (normalised [3, H, W])."""
    pixels = torch.from_numpy(np.concatenate([hf_patchify(im) for im in images]))
    thw = torch.tensor([[1, im.shape[1] // 16, im.shape[2] // 16] for im in images])
    ids = torch.tensor([ids])
    mm = (ids == model.config.image_token_id).long()
    return model(input_ids=ids, pixel_values=pixels, image_grid_thw=thw, mm_token_type_ids=mm,
                 use_cache=False).logits[0].numpy()


def save_multimodal(directory: Path, seed: int = 0, tower: str = "a", text_hidden: int = 64) -> Path:
    """A tiny Qwen3_5MoeForConditionalGeneration checkpoint with a tokenizer and preprocessor_config.json."""
    # four layers, two of them attention: the M-RoPE positions reach the logits
    text = dict(vocab_size=520, hidden_size=text_hidden, num_hidden_layers=4, full_attention_interval=2,
                num_attention_heads=2,
                num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
                linear_key_head_dim=16, linear_value_head_dim=16, moe_intermediate_size=32,
                shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                     mrope_section=[2, 1, 1], mrope_interleaved=True))
    vision = dict(hf_vision_config(tower).to_dict(), out_hidden_size=text_hidden)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **vision_token_ids())
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval()
    from tests.support.hf_oracle import _rescale, save_checkpoint
    _rescale(model, seed)                              # the text model's O(1) activations, as its oracle's
    rescale(model.model.visual, seed)
    save_checkpoint(model, directory)                  # with a tokenizer, so the text converts too
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return model
