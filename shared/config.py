"""ModelConfig: the one description of a model, built from GGUF metadata.

Every derived size (state bytes, conv channels, layer kinds) is computed here and
nowhere else, so the reference, the native engines and the state store agree.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .errors import GGUFError

ARCHITECTURES = ("qwen35moe", "qwen3next")


def metadata_value(meta: dict, path, full: str, kind=int, default=None):
    """GGUF metadata key `full` as `kind`; missing (without a default) or of the wrong type
    is a GGUFError naming the key."""
    value = meta.get(full, default)
    if value is None:
        raise GGUFError(path, f"missing metadata key {full}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise GGUFError(path, f"metadata key {full} has value {value!r}, expected {kind.__name__}") from None


@dataclass(frozen=True)
class ModelConfig:
    arch: str                 # qwen35moe (Qwen3.5/3.6) or qwen3next
    n_layer: int              # blocks that run (block_count minus the MTP blocks)
    n_embd: int               # hidden size
    n_vocab: int
    rms_eps: float
    # gated attention
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int             # rotated dims at the start of each head (partial RoPE)
    rope_theta: float
    full_attention_interval: int
    # Gated DeltaNet
    ssm_conv_kernel: int
    ssm_k_heads: int          # ssm.group_count
    ssm_v_heads: int          # ssm.time_step_rank
    ssm_head_k_dim: int       # ssm.state_size
    ssm_d_inner: int          # value heads x value head dim
    # MoE
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    rope_sections: tuple = (11, 11, 10, 0)   # M-RoPE; collapses to 1-D RoPE for text
    n_ctx_train: int = 262144                # context_length: positions a sequence may reach

    # ---- derived sizes -------------------------------------------------
    def is_attention(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval == 0

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_attention(i)]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if not self.is_attention(i)]

    @property
    def ssm_head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_v_heads

    @property
    def ssm_key_dim(self) -> int:
        return self.ssm_k_heads * self.ssm_head_k_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: q, k (key dims) and v (value dims)."""
        return 2 * self.ssm_key_dim + self.ssm_d_inner

    @property
    def v_heads_tiled(self) -> bool:
        """llama.cpp reorders Qwen3.5/3.6 value heads so head j uses key head j % k_heads;
        Qwen3-Next GGUFs keep HF's grouped order (key head j // ratio)."""
        return self.arch == "qwen35moe"

    def key_head_of(self, v_head: int) -> int:
        if self.v_heads_tiled:
            return v_head % self.ssm_k_heads
        return v_head // (self.ssm_v_heads // self.ssm_k_heads)

    @property
    def recurrent_state_floats(self) -> int:
        """fp32 values of one GDN layer's state: S [v_heads, k_dim, v_dim] plus the conv history."""
        s = self.ssm_v_heads * self.ssm_head_k_dim * self.ssm_head_v_dim
        return s + (self.ssm_conv_kernel - 1) * self.conv_channels

    @property
    def recurrent_state_bytes(self) -> int:
        """fp32 bytes of one sequence's recurrent state, all GDN layers."""
        return 4 * len(self.gdn_layers) * self.recurrent_state_floats

    # ---- GGUF metadata, both ways ----------------------------------------
    def to_metadata(self) -> dict:
        """The `{arch}.*` keys llama.cpp's converter writes for this config."""
        a = self.arch
        meta = {
            "general.architecture": a,
            f"{a}.block_count": self.n_layer,
            f"{a}.context_length": self.n_ctx_train,
            f"{a}.embedding_length": self.n_embd,
            f"{a}.vocab_size": self.n_vocab,
            f"{a}.attention.head_count": self.n_head,
            f"{a}.attention.head_count_kv": self.n_head_kv,
            f"{a}.attention.key_length": self.head_dim,
            f"{a}.attention.value_length": self.head_dim,
            f"{a}.attention.layer_norm_rms_epsilon": float(self.rms_eps),
            f"{a}.rope.freq_base": float(self.rope_theta),
            f"{a}.rope.dimension_count": self.rope_dim,
            f"{a}.expert_count": self.n_expert,
            f"{a}.expert_used_count": self.n_expert_used,
            f"{a}.expert_feed_forward_length": self.n_ff_exp,
            f"{a}.expert_shared_feed_forward_length": self.n_ff_shexp,
            f"{a}.ssm.conv_kernel": self.ssm_conv_kernel,
            f"{a}.ssm.state_size": self.ssm_head_k_dim,
            f"{a}.ssm.group_count": self.ssm_k_heads,
            f"{a}.ssm.time_step_rank": self.ssm_v_heads,
            f"{a}.ssm.inner_size": self.ssm_d_inner,
            f"{a}.full_attention_interval": self.full_attention_interval,
        }
        if a == "qwen35moe":
            # Interleaved M-RoPE sections; llama.cpp requires the key for qwen35moe.
            meta[f"{a}.rope.dimension_sections"] = list(self.rope_sections)
        return meta

    # ---- construction --------------------------------------------------
    @classmethod
    def from_metadata(cls, meta: dict, path: str = "<metadata>") -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(path, f"architecture {arch!r} is not supported (expected one of {', '.join(ARCHITECTURES)})")

        def key(name, kind=int, default=None):
            return metadata_value(meta, path, f"{arch}.{name}", kind, default)

        block_count = key("block_count")
        n_embd = key("embedding_length")
        n_head = key("attention.head_count")
        vocab = meta.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens") or ())
        cfg = cls(
            arch=arch,
            n_layer=block_count - key("nextn_predict_layers", default=0),
            n_embd=n_embd,
            n_vocab=int(vocab),
            rms_eps=key("attention.layer_norm_rms_epsilon", float, 1e-6),
            n_head=n_head,
            n_head_kv=key("attention.head_count_kv"),
            head_dim=key("attention.key_length", default=n_embd // max(n_head, 1)),
            rope_dim=key("rope.dimension_count"),
            rope_theta=key("rope.freq_base", float, 10000.0),
            full_attention_interval=key("full_attention_interval", default=4),
            ssm_conv_kernel=key("ssm.conv_kernel"),
            ssm_k_heads=key("ssm.group_count"),
            ssm_v_heads=key("ssm.time_step_rank"),
            ssm_head_k_dim=key("ssm.state_size"),
            ssm_d_inner=key("ssm.inner_size"),
            n_expert=key("expert_count"),
            n_expert_used=key("expert_used_count"),
            n_ff_exp=key("expert_feed_forward_length"),
            n_ff_shexp=key("expert_shared_feed_forward_length", default=0),
            rope_sections=tuple(meta.get(f"{arch}.rope.dimension_sections", (11, 11, 10, 0))),
            n_ctx_train=key("context_length"),
        )
        cfg.validate(path)
        return cfg

    def validate(self, path: str = "<config>") -> None:
        """Refuse configurations that no weights could satisfy, naming the field."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                if f.name != "n_ff_shexp":
                    raise GGUFError(path, f"metadata gives {f.name} = {value}; it must be positive")
        checks = [
            (self.n_head % self.n_head_kv == 0, "attention head_count must be a multiple of head_count_kv"),
            (self.ssm_v_heads % self.ssm_k_heads == 0, "ssm.time_step_rank must be a multiple of ssm.group_count"),
            (self.ssm_d_inner % self.ssm_v_heads == 0, "ssm.inner_size must be a multiple of ssm.time_step_rank"),
            (self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0, "rope.dimension_count must be even and <= key_length"),
            (self.n_expert_used <= self.n_expert, "expert_used_count exceeds expert_count"),
            (self.ssm_conv_kernel >= 2, "ssm.conv_kernel must be at least 2"),
        ]
        for ok, problem in checks:
            if not ok:
                raise GGUFError(path, problem)
