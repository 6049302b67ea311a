"""GLM-10B (``GLMModel``): 2-D positions through learned position and block-position embeddings.

GLM reads a prompt as a context, whose tokens see each other in both
directions, followed by ``<sop>`` that opens the generated block. Every token
has two position ids: row 1 counts through the context and then stays at the
mask position; row 2 is 0 in the context and counts 1, 2, ... from ``<sop>``
on. This module also holds that rule for ChatGLM-6B (``zoo_plugins.chatglm``),
which differs only in where the mask position comes from.
"""

from __future__ import annotations

from torch import nn

from zoo import ModelDescription, ZooError, hookimpl

ARCHITECTURE = "GLMModel"
MASK_TOKEN_IDS = (50260, 50263, 50264)  # [MASK], [sMASK], [gMASK] in GLM-10B's vocabulary


def two_d_positions(prompt_len: int, mask_position: int, indices) -> list[list[int]]:
    """Position rows of tokens ``indices`` of a GLM request whose prompt has ``prompt_len`` tokens.

    The context is the prompt without its last token (``<sop>``). A token at index ``i`` in the
    context has ``(i, 0)``; from ``<sop>`` on, ``(mask_position, i - prompt_len + 2)``.
    """
    context = prompt_len - 1
    rows = ([], [])
    for i in indices:
        rows[0].append(i if i < context else mask_position)
        rows[1].append(0 if i < context else i - context + 1)
    return [rows[0], rows[1]]


def glm_mask_position(prompt_ids, max_sequence_length: int) -> int:
    """The first mask token of the prompt, else the model's maximum context length."""
    return next((i for i, t in enumerate(prompt_ids) if t in MASK_TOKEN_IDS), max_sequence_length)


# What GLM-10B and ChatGLM-6B share: post-2021 GLM blocks with LayerNorm, a GeLU MLP and biases everywhere.
GLM_BLOCK = dict(norm="layer", norm_bias=True, activation="gelu_tanh", gated_mlp=False, qkv_bias=True, o_bias=True,
                 mlp_bias=True)
# Their per-layer checkpoint names, past the layer number, in zoo's names (q/k/v are split apart).
GLM_LAYER_NAMES = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm",
                   "attention.dense": "self_attn.o_proj", "mlp.dense_h_to_4h": "mlp.up_proj",
                   "mlp.dense_4h_to_h": "mlp.down_proj"}


def convert_glm_layer(rest: str, tensor, split_qkv) -> list:
    """``layers.N.<rest>`` of a GLM checkpoint in zoo's names; ``split_qkv`` splits the fused q/k/v."""
    layer, rest = rest.split(".", 1)
    module, kind = rest.rsplit(".", 1)
    prefix = f"model.layers.{layer}."
    if module == "attention.query_key_value":
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", split_qkv(tensor))]
    if module in GLM_LAYER_NAMES:
        return [(f"{prefix}{GLM_LAYER_NAMES[module]}.{kind}", tensor)]
    return []  # e.g. ChatGLM's rotary_emb.inv_freq: computed, not loaded


def describe(hf: dict) -> ModelDescription:
    if hf.get("relative_encoding"):
        raise ZooError("GLM with relative_encoding=true is not supported")
    if not hf.get("block_position_encoding", True):
        raise ZooError("GLM without block_position_encoding is not supported (zoo runs the 2-D layout)")
    hidden = hf["hidden_size"]
    length = hf["max_sequence_length"]
    return ModelDescription(
        architecture=ARCHITECTURE,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["num_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_attention_heads"],
        intermediate_size=4 * hidden,
        max_position=length + 1,  # both position tables have one row past the context length
        norm_eps=hf.get("layernorm_epsilon", 1e-5),
        position="learned",
        position_rows=2,
        tied_embeddings=True,  # GLM's output layer is its word embedding
        eos_token_ids=[t for t in [hf.get("eos_token_id")] if t is not None],
        extra={"max_sequence_length": length},
        **GLM_BLOCK,
    )


_TOP_NAMES = {"word_embeddings.weight": "model.embed_tokens.weight",
              "transformer.position_embeddings.weight": "model.embed_positions.weight",
              "transformer.block_position_embeddings.weight": "model.embed_block_positions.weight",
              "transformer.final_layernorm.weight": "model.norm.weight",
              "transformer.final_layernorm.bias": "model.norm.bias"}


@hookimpl
def zoo_model_architectures():
    return {ARCHITECTURE: describe}


@hookimpl
def zoo_weights_convert(name, tensor):
    name = name.removeprefix("glm.")
    if name in _TOP_NAMES:
        return [(_TOP_NAMES[name], tensor)]
    if not name.startswith("transformer.layers."):
        return []
    # q, k and v one after the other
    return convert_glm_layer(name.removeprefix("transformer.layers."), tensor, lambda t: t.chunk(3, dim=0))


@hookimpl
def zoo_model_build(model, description):
    model.model.embed_block_positions = nn.Embedding(description.max_position, description.hidden_size)


@hookimpl
def zoo_embed_modify(hidden, context, model):
    hidden += model.model.embed_block_positions(context.positions[1])  # row 2 indexes the block positions


def check_glm_request(request) -> str | None:
    """What GLM-10B and ChatGLM-6B refuse: explicit positions, and a prompt without context and <sop>."""
    if "position_ids" in request.extras:
        return ("GLM models take only their own 2-D position layout (context 0..L-2, then the mask "
                "position; block positions 0, then 1, 2, ... from <sop>): remove position_ids")
    if len(request.prompt_token_ids) < 2:
        return "a GLM prompt needs a context and a final <sop> token: at least 2 tokens"
    return None


@hookimpl
def zoo_request_fields():
    return ["position_ids"]  # read only to refuse it with a clear message


@hookimpl
def zoo_request_validate(request):
    return check_glm_request(request)


@hookimpl
def zoo_request_bidirectional_prefix(request):
    return len(request.prompt_token_ids) - 1  # the context, all but <sop>


@hookimpl
def zoo_request_admit(request, engine):
    mask = glm_mask_position(request.prompt_token_ids, engine.description.extra["max_sequence_length"])
    request.plugin_state["glm"] = mask


@hookimpl
def zoo_step_positions(request, indices, description):
    mask = request.plugin_state.get("glm")
    if mask is None:  # the CUDA memory-profile step's dummy requests are never admitted
        mask = glm_mask_position(request.prompt_token_ids, description.extra["max_sequence_length"])
    return two_d_positions(len(request.prompt_token_ids), mask, indices)
