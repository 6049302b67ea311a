"""GPT-2: learned absolute positions, LayerNorm, GELU (tanh), Conv1D weights.

GPT-2 stores linear weights as ``[in, out]`` (Conv1D) and fuses q/k/v into
``c_attn``; the converter transposes and splits them into zoo's names.
"""

from __future__ import annotations

from zoo import ModelDescription, ZooError, hookimpl

ARCHITECTURE = "GPT2LMHeadModel"

_LAYER_NAMES = {
    "ln_1": "input_layernorm",
    "ln_2": "post_attention_layernorm",
    "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
_TOP_NAMES = {"wte.weight": "model.embed_tokens.weight", "wpe.weight": "model.embed_positions.weight",
              "ln_f.weight": "model.norm.weight", "ln_f.bias": "model.norm.bias"}


def describe(hf: dict) -> ModelDescription:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ZooError(f"GPT-2 option {flag}=true is not supported")
    hidden = hf["n_embd"]
    activation = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}
    return ModelDescription(
        architecture=ARCHITECTURE,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        num_layers=hf["n_layer"],
        num_heads=hf["n_head"],
        num_kv_heads=hf["n_head"],
        intermediate_size=hf.get("n_inner") or 4 * hidden,
        max_position=hf["n_positions"],
        norm="layer",
        norm_bias=True,
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=activation[hf.get("activation_function", "gelu_new")],
        gated_mlp=False,
        position="learned",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        tied_embeddings=hf.get("tie_word_embeddings", True),
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        bos_token_id=hf.get("bos_token_id"),
    )


@hookimpl
def zoo_model_architectures():
    return {ARCHITECTURE: describe}


@hookimpl
def zoo_weights_convert(name, tensor):
    name = name.removeprefix("transformer.")
    if name in _TOP_NAMES:
        return [(_TOP_NAMES[name], tensor)]
    if name == "lm_head.weight":
        return [(name, tensor)]
    if not name.startswith("h."):
        return []  # e.g. cached causal-mask buffers
    _, layer, rest = name.split(".", 2)
    prefix = f"model.layers.{layer}."
    module, kind = rest.rsplit(".", 1)
    if kind == "weight" and module.endswith(("c_attn", "c_proj", "c_fc")):
        tensor = tensor.t()  # Conv1D keeps [in, out]
    if module == "attn.c_attn":
        q, k, v = tensor.chunk(3, dim=0)
        return [(f"{prefix}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if module in _LAYER_NAMES:
        return [(f"{prefix}{_LAYER_NAMES[module]}.{kind}", tensor)]
    return []
