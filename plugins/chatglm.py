"""ChatGLM-6B (``ChatGLMModel``): 2-D rotary positions, alpha-scaled residuals, GeLU MLP.

Each head's dimensions are split in two halves: the first is rotated by
position row 1, the second by row 2 (the block position), each with
rotate-half RoPE over its own half. The residual branch carries the normalised
input times ``alpha = sqrt(2 * num_layers)``. ChatGLM's query-key layer
scaling divides q by ``layer + 1`` and multiplies the scores back, which only
guards fp16 range: zoo computes the same softmax with the plain
``1/sqrt(head_dim)`` scale. The prompt (without its final ``<sop>``) attends
bidirectionally; the mask position is the token before ``<sop>`` (``[gMASK]``).
"""

from __future__ import annotations

import math

import torch

from zoo import ModelDescription, ZooError, hookimpl
from zoo.model import Rotary, rotate_half
from zoo_plugins.glm import GLM_BLOCK, convert_glm_layer, two_d_positions
# GLM's request rules, as hook implementations of this plugin too: position_ids refused, a context plus
# <sop> required, the context bidirectional. (The two plugins never take part in the same run.)
from zoo_plugins.glm import zoo_request_bidirectional_prefix, zoo_request_fields, zoo_request_validate  # noqa: F401

ARCHITECTURE = "ChatGLMModel"


class TwoHalvesRotary(Rotary):
    """RoPE on each half of the head dimensions, with its own row of positions."""

    rotate_half_tables = False

    def inverse_frequencies(self) -> torch.Tensor:
        dim = self.description.head_dim // 2
        return 1.0 / (self.description.rope_theta ** (torch.arange(0, dim, 2).float() / dim))

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.tables(positions[0], dtype), self.tables(positions[1], dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, tables):
        def rotate(x):
            halves = x.chunk(2, dim=-1)
            return torch.cat([h * cos + rotate_half(h) * sin for h, (cos, sin) in zip(halves, tables)], dim=-1)

        return rotate(q), rotate(k)


def describe(hf: dict) -> ModelDescription:
    if not hf.get("position_encoding_2d", True):
        raise ZooError("ChatGLM with position_encoding_2d=false is not supported")
    hidden, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_layers"]
    if (hidden // heads) % 4:
        raise ZooError(f"ChatGLM's head size {hidden // heads} must be a multiple of 4 (two rotated halves)")
    return ModelDescription(
        architecture=ARCHITECTURE,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        intermediate_size=hf.get("inner_hidden_size") or 4 * hidden,
        max_position=hf.get("max_sequence_length", 2048),
        norm_eps=hf.get("layernorm_epsilon", 1e-5),
        position="rope",
        position_rows=2,
        residual="normed",
        residual_scale=math.sqrt(2 * layers),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=[t for t in [hf.get("eos_token_id")] if t is not None],
        **GLM_BLOCK,
    )


_TOP_NAMES = {"word_embeddings.weight": "model.embed_tokens.weight",
              "final_layernorm.weight": "model.norm.weight", "final_layernorm.bias": "model.norm.bias"}


@hookimpl
def zoo_model_architectures():
    return {ARCHITECTURE: describe}


@hookimpl
def zoo_weights_convert(description, name, tensor):
    if name == "lm_head.weight":
        return [(name, tensor)]
    name = name.removeprefix("transformer.")
    if name in _TOP_NAMES:
        return [(_TOP_NAMES[name], tensor)]
    if not name.startswith("layers."):
        return []
    heads, head_dim = description.num_heads, description.head_dim

    def split_qkv(fused):  # per head: its q rows, then k, then v ([heads * 3 * head_dim, ...])
        per_head = fused.reshape(heads, 3, head_dim, *fused.shape[1:])
        return [per_head[:, j].reshape(heads * head_dim, *fused.shape[1:]) for j in range(3)]

    return convert_glm_layer(name.removeprefix("layers."), tensor, split_qkv)


@hookimpl
def zoo_model_build(model, description):
    model.model.rotary = TwoHalvesRotary(description)


@hookimpl
def zoo_step_positions(request, indices):
    prompt_len = len(request.prompt_token_ids)
    return two_d_positions(prompt_len, prompt_len - 2, indices)  # the mask sits just before <sop>
