"""What the generic decoder-only transformer needs to know about a model.

An architecture plugin turns an HF ``config.json`` into a ``ModelDescription``;
the core builds :class:`zoo.model.DecoderModel` from it and never looks at the
HF config again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelDescription:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    max_position: int = 2048
    norm: str = "rms"  # "rms" | "layer"
    norm_eps: float = 1e-6
    activation: str = "silu"  # "silu" | "gelu" | "gelu_tanh" | "relu"
    gated_mlp: bool = True  # SwiGLU-style gate_proj * up_proj
    position: str = "rope"  # "rope" | "learned" | "none"
    position_rows: int = 1  # rows of position ids per token (2 for GLM, 3 for mRoPE)
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    norm_bias: bool = False
    tied_embeddings: bool = False
    residual: str = "input"  # "input": the residual is the sublayer's input | "normed": its normalised input
    residual_scale: float = 1.0  # with residual="normed", the factor on it (ChatGLM's alpha)
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    sliding_window: int | None = None
    attention_sinks: int = 0  # with a window: the first tokens every query also sees (StreamingLLM)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # plugin-private settings

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
