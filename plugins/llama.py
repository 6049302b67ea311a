"""Llama-family models: Llama (incl. linear and llama3 RoPE scaling), Mistral, Qwen2.

Their checkpoints already use zoo's parameter names, so this plugin describes
the architecture and, for scaled RoPE, gives the model a rotary module with
the scaled frequencies.
"""

from __future__ import annotations

import math

import torch

from zoo import ModelDescription, ZooError, hookimpl
from zoo.model import Rotary, rope_inverse_frequencies

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ScaledRotary(Rotary):
    """RoPE with ``linear`` or ``llama3`` frequency scaling (``description.extra["rope_scaling"]``)."""

    def inverse_frequencies(self) -> torch.Tensor:
        inv_freq = rope_inverse_frequencies(self.description)
        scaling = self.description.extra["rope_scaling"]
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "linear":
            return inv_freq / scaling["factor"]
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)


def _rope(hf: dict) -> tuple[float, dict | None]:
    # transformers 5 writes rope_parameters; older checkpoints rope_theta + rope_scaling.
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "linear", "llama3"):
            raise ZooError(f"rope scaling type {kind!r} is not supported yet (supported: default, linear, llama3)")
        if kind == "default":
            scaling = None
    return float(theta), scaling


def _qwen2_window(hf: dict) -> int | None:
    """Qwen2's window: ``layer_types`` (or layers ``max_window_layers`` onwards) attend in it, the rest fully."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28) else
                                      "full_attention" for i in range(layers)]
    windowed = sum(t == "sliding_attention" for t in types)
    if windowed == 0:
        return None
    if windowed < layers:
        raise ZooError(f"Qwen2 with a sliding window on {windowed} of its {layers} layers (max_window_layers="
                       f"{hf.get('max_window_layers')}): zoo applies one window to every layer or none")
    return hf["sliding_window"]


def describe(hf: dict) -> ModelDescription:
    theta, scaling = _rope(hf)
    architecture = hf["architectures"][0]
    heads = hf["num_attention_heads"]
    qwen2 = architecture == "Qwen2ForCausalLM"
    sliding = hf.get("sliding_window")
    if qwen2:  # transformers' Qwen2: a window only with use_sliding_window, on the layers from max_window_layers
        sliding = _qwen2_window(hf) if hf.get("use_sliding_window", False) else None
    return ModelDescription(
        architecture=architecture,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position=hf.get("max_position_embeddings", 2048),
        norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        activation={"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}[hf.get("hidden_act", "silu")],
        gated_mlp=True,
        position="rope",
        rope_theta=theta,
        qkv_bias=qwen2 or bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)) and not qwen2,
        mlp_bias=bool(hf.get("mlp_bias", False)),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=sliding,
        bos_token_id=hf.get("bos_token_id"),
        extra={"rope_scaling": dict(scaling)} if scaling else {},
    )


@hookimpl
def zoo_model_architectures():
    return {name: describe for name in ARCHITECTURES}


@hookimpl
def zoo_model_build(model, description):
    if "rope_scaling" in description.extra:  # this model's own setting, not another architecture's
        model.model.rotary = ScaledRotary(description)
