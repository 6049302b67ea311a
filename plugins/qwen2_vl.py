"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): a Qwen2 language model with mRoPE, and its vision encoder.

A request may bring ``images``: each a PNG/JPEG path (resized to multiples of
patch size times merge size, rescaled, normalised and cut into patches here) or
``{"pixel_values": FILE.safetensors, "image_grid_thw": [t, h, w]}`` of patches
already processed. The prompt carries one image-pad token per merged patch, or
one per image, which is widened to that as Qwen2-VL's processor does (what its
chat template writes).
Images are checked when the request arrives, encoded once when it is admitted,
and their features replace the image-pad embeddings in whichever prefill
chunks hold those tokens. Positions come from the ``mrope`` plugin.
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from zoo import ModelDescription, RequestError, Scope, ZooError, hookimpl
from zoo.model import rotate_half
from zoo_plugins.mrope import IMAGE_GRIDS, MultimodalRotary

zoo_scope = Scope(requires=("mrope",))  # its positions come from mrope
ARCHITECTURE = "Qwen2VLForConditionalGeneration"
STATE = "qwen2_vl"
PARSED = "qwen2_vl_images"  # the request's images, read in its prompt transform, until its validation
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the image processor's normalisation
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 1280


def describe(hf: dict) -> ModelDescription:
    text = hf.get("text_config") or hf  # transformers 5 nests the language model's settings
    vision = hf.get("vision_config")
    if not vision:
        raise ZooError("a Qwen2-VL config needs vision_config")
    rope = dict(text.get("rope_parameters") or {})
    scaling = text.get("rope_scaling") or hf.get("rope_scaling") or {}
    sections = rope.get("mrope_section") or scaling.get("mrope_section")
    heads = text["num_attention_heads"]
    head_dim = text["hidden_size"] // heads
    if not sections or sum(sections) != head_dim // 2:
        raise ZooError(f"mrope_section {sections} must add up to half the head size ({head_dim // 2})")
    return ModelDescription(
        architecture=ARCHITECTURE,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        num_layers=text["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=text.get("num_key_value_heads") or heads,
        intermediate_size=text["intermediate_size"],
        max_position=text.get("max_position_embeddings", 32768),
        norm="rms",
        norm_eps=text.get("rms_norm_eps", 1e-6),
        position="rope",
        position_rows=3,
        rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 1000000.0))),
        qkv_bias=True,
        tied_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        bos_token_id=text.get("bos_token_id"),
        extra={"mrope_section": list(sections), "image_token_id": hf["image_token_id"],
               "spatial_merge_size": vision.get("spatial_merge_size", 2), "vision": dict(vision)},
    )


# ---------------------------------------------------------------------------- vision encoder


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim)
        self.attn.proj = nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1 = nn.Linear(dim, mlp_dim)
        self.mlp.fc2 = nn.Linear(mlp_dim, dim)
        self.heads = heads

    def forward(self, x, cos, sin, segments: list[int]):
        n, dim = x.shape
        q, k, v = self.attn.qkv(self.norm1(x)).reshape(n, 3, self.heads, -1).unbind(1)
        # Rotary in float32, as the reference encoder does.
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        # Each frame of each image attends within itself only.
        outs = [F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
                for qs, ks, vs in zip(q.split(segments), k.split(segments), v.split(segments))]
        x = x + self.attn.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, dim))
        hidden = self.mlp.fc1(self.norm2(x))
        return x + self.mlp.fc2(hidden * torch.sigmoid(1.702 * hidden))  # quick_gelu


class VisionEncoder(nn.Module):
    """Patches ``[N, channels * temporal * patch * patch]`` of images with grids (t, h, w) to LM features."""

    def __init__(self, vision: dict, lm_hidden: int):
        super().__init__()
        if vision.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise ZooError(f"Qwen2-VL vision hidden_act {vision['hidden_act']!r} is not supported")
        dim, heads = vision["embed_dim"], vision["num_heads"]
        self.patch, self.temporal = vision.get("patch_size", 14), vision.get("temporal_patch_size", 2)
        self.channels, self.merge = vision.get("in_channels", 3), vision.get("spatial_merge_size", 2)
        self.theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.head_dim = dim // heads
        kernel = (self.temporal, self.patch, self.patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.channels, dim, kernel_size=kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, int(dim * vision.get("mlp_ratio", 4)))
                                    for _ in range(vision["depth"]))
        merged = dim * self.merge ** 2
        self.merger = nn.Module()
        self.merger.ln_q = nn.LayerNorm(dim, eps=1e-6)
        self.merger.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, lm_hidden))

    @property
    def patch_values(self) -> int:
        return self.channels * self.temporal * self.patch * self.patch

    def _rotary(self, grids, device):
        """cos, sin ``[N, 1, head_dim]``: half the frequencies follow the patch's row, half its column."""
        spatial = self.head_dim // 2
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        rows, cols = [], []
        for t, h, w in grids:
            m = self.merge
            # patches come merge-block by merge-block, as the image processor lays them out
            r = torch.arange(h, device=device)[:, None].expand(h, w).reshape(h // m, m, w // m, m)
            c = torch.arange(w, device=device)[None, :].expand(h, w).reshape(h // m, m, w // m, m)
            rows.append(r.transpose(1, 2).flatten().repeat(t))
            cols.append(c.transpose(1, 2).flatten().repeat(t))
        freqs = torch.cat([torch.cat(rows)[:, None] * inv_freq, torch.cat(cols)[:, None] * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    def forward(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        # The 3-D convolution's kernel is its stride, so it is one matrix product per patch; as a product it
        # also stays in float32 on GPUs, where cuDNN would run the convolution in TF32.
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight).view(pixels.shape[0], -1), weight.view(weight.shape[0], -1))
        cos, sin = self._rotary(grids, x.device)
        segments = [h * w for t, h, w in grids for _ in range(t)]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        return self.merger.mlp(self.merger.ln_q(x).view(-1, x.shape[-1] * self.merge ** 2))


# ---------------------------------------------------------------------------- image input


def smart_size(height: int, width: int, factor: int) -> tuple[int, int]:
    """The nearest size with both sides multiples of ``factor`` and the pixel count in range."""
    if max(height, width) / min(height, width) > 200:
        raise RequestError(f"an image of {width}x{height} is too elongated (aspect ratio over 200)")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > MAX_PIXELS:
        beta = math.sqrt(height * width / MAX_PIXELS)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def image_patches(path: str, vision: dict) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Read, resize, normalise and patchify an image file like Qwen2-VL's image processor."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise RequestError("reading image files needs Pillow: pip install 'zoo-runtime[images]'") from None
    if not Path(path).is_file():
        raise RequestError(f"image file not found: {path}")
    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
    except (UnidentifiedImageError, OSError) as exc:
        raise RequestError(f"cannot read {path} as an image ({exc})") from None
    patch, merge, temporal = vision.get("patch_size", 14), vision.get("spatial_merge_size", 2), \
        vision.get("temporal_patch_size", 2)
    height, width = smart_size(img.height, img.width, patch * merge)
    if (height, width) != (img.height, img.width):
        img = img.resize((width, height), Image.Resampling.BICUBIC)
    pixels = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(height, width, 3)
    pixels = pixels.permute(2, 0, 1).float() / 255
    pixels = (pixels - torch.tensor(CLIP_MEAN)[:, None, None]) / torch.tensor(CLIP_STD)[:, None, None]
    gh, gw = height // patch, width // patch
    blocks = pixels.reshape(3, gh // merge, merge, patch, gw // merge, merge, patch).permute(1, 4, 2, 5, 0, 3, 6)
    # One still image fills every temporal slot of a patch.
    blocks = blocks.unsqueeze(5).expand(-1, -1, -1, -1, -1, temporal, -1, -1)
    return blocks.reshape(gh * gw, 3 * temporal * patch * patch), (1, gh, gw)


def processed_patches(entry: dict, vision: dict) -> tuple[torch.Tensor, tuple[int, int, int]]:
    from safetensors.torch import load_file

    path, grid = entry.get("pixel_values"), entry.get("image_grid_thw")
    if not isinstance(path, str) or not (isinstance(grid, list) and len(grid) == 3
                                         and all(isinstance(g, int) and g > 0 for g in grid)):
        raise RequestError('a processed image is {"pixel_values": FILE.safetensors, "image_grid_thw": [t, h, w]}')
    if not Path(path).is_file():
        raise RequestError(f"pixel_values file not found: {path}")
    try:
        tensors = load_file(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the request's error
        raise RequestError(f"cannot read {path} as safetensors ({exc})") from None
    pixels = tensors.get("pixel_values", next(iter(tensors.values())) if len(tensors) == 1 else None)
    values = vision.get("in_channels", 3) * vision.get("temporal_patch_size", 2) * vision.get("patch_size", 14) ** 2
    t, h, w = grid
    merge = vision.get("spatial_merge_size", 2)
    if h % merge or w % merge:
        raise RequestError(f"image_grid_thw {grid}: h and w must be multiples of the merge size {merge}")
    if pixels is None or tuple(pixels.shape) != (t * h * w, values):
        shape = None if pixels is None else list(pixels.shape)
        raise RequestError(f"pixel_values of shape {shape} do not match image_grid_thw {grid}: "
                           f"expected [{t * h * w}, {values}]")
    return pixels.float(), (t, h, w)


# ---------------------------------------------------------------------------- hooks


@hookimpl
def zoo_model_architectures():
    return {ARCHITECTURE: describe}


@hookimpl
def zoo_weights_convert(name, tensor):
    if name.startswith("model.language_model."):  # transformers 5's module names
        name = "model." + name.removeprefix("model.language_model.")
    elif name.startswith("model.visual."):
        name = name.removeprefix("model.")
    return [(name, tensor)]


@hookimpl
def zoo_model_build(model, description):
    model.model.rotary = MultimodalRotary(description)
    model.visual = VisionEncoder(description.extra["vision"], description.hidden_size)


@hookimpl
def zoo_request_fields():
    return ["images"]


def pads_needed(parsed: list, merge: int) -> list[int]:
    """Each image's image-pad tokens: one per merged patch of its grid."""
    return [t * h * w // merge ** 2 for _, (t, h, w) in parsed]


@hookimpl
def zoo_prompt_transform(request, description):
    """Read the request's images; where its prompt has one pad per image (as Qwen2-VL's chat template writes
    them), widen each to its image's merged patches, as Qwen2-VL's processor does."""
    images = request.extras.get("images")
    if images is None:
        return
    if not isinstance(images, list):
        raise RequestError("images must be a list of file paths or processed-image objects")
    vision, merge = description.extra["vision"], description.extra["spatial_merge_size"]
    parsed = []
    base = request.source_dir or Path(".")  # paths in an input file are relative to its folder
    for i, entry in enumerate(images):
        try:
            if isinstance(entry, str):
                parsed.append(image_patches(str(base / entry), vision))
            elif isinstance(entry, dict):
                entry = {**entry, "pixel_values": str(base / entry["pixel_values"])} if isinstance(
                    entry.get("pixel_values"), str) else entry
                parsed.append(processed_patches(entry, vision))
            else:
                raise RequestError("each image is a file path or a processed-image object")
        except RequestError as exc:
            raise RequestError(f"image {i}: {exc}") from None
    request.plugin_state[PARSED] = parsed
    pad, prompt = description.extra["image_token_id"], request.prompt_token_ids
    sizes = pads_needed(parsed, merge)
    if prompt.count(pad) == len(parsed) != sum(sizes):
        widths = iter(sizes)
        request.prompt_token_ids = [t for token in prompt for t in ([pad] * next(widths) if token == pad else [token])]


@hookimpl
def zoo_request_validate(request, description):
    parsed = request.plugin_state.pop(PARSED, None)
    if parsed is None:
        return None
    merge = description.extra["spatial_merge_size"]
    pads = request.prompt_token_ids.count(description.extra["image_token_id"])
    needed = sum(pads_needed(parsed, merge))
    if pads != needed:
        grids = ", ".join(f"{t}x{h}x{w}" for _, (t, h, w) in parsed)
        return (f"the prompt has {pads} image-pad tokens, but the images' grids ({grids}, merged {merge}x{merge}) "
                f"need {needed}")
    pixels = torch.cat([p for p, _ in parsed]) if parsed else None
    grids = [g for _, g in parsed]
    request.plugin_state[IMAGE_GRIDS] = grids  # mrope's positions
    if parsed:
        digest = hashlib.sha256(pixels.numpy().tobytes())
        digest.update(repr(grids).encode())
        request.plugin_state[STATE] = {"pixels": pixels, "digest": digest.hexdigest()}  # encoded at admission
    return None


@hookimpl
def zoo_request_cache_key(request):
    # Equal prompts with other images must not share K/V.
    state = request.plugin_state.get(STATE)
    return state["digest"] if state else None


@hookimpl
def zoo_request_admit(request, engine):
    state = request.plugin_state.get(STATE)
    if state is None:
        return
    with torch.inference_mode():
        state["features"] = engine.model.visual(state.pop("pixels").to(engine.device),
                                                request.plugin_state[IMAGE_GRIDS])
    image_token = engine.description.extra["image_token_id"]
    state["pads"] = [i for i, t in enumerate(request.prompt_token_ids) if t == image_token]


@hookimpl
def zoo_engine_start(setup):
    # a graph leaves the image features out: steps of prompts with images run eagerly
    setup.run_eagerly_when(lambda scheduled: any(
        STATE in e.request.plugin_state and e.start < len(e.request.prompt_token_ids) for e in scheduled))


@hookimpl
def zoo_embed_modify(hidden, context):
    batch = context.batch
    if batch is None:  # a graph-captured decode step: its tokens are never prompt image pads
        return
    for entry, offset in zip(batch.scheduled, batch.token_offsets):
        state = entry.request.plugin_state.get(STATE)
        if state is None:
            continue
        pads, features = state["pads"], state["features"]
        first, last = bisect_left(pads, entry.start), bisect_left(pads, entry.start + entry.num_tokens)
        if first < last:  # this chunk holds image pads first..last-1
            rows = torch.tensor([offset + pads[j] - entry.start for j in range(first, last)], device=hidden.device)
            hidden[rows] = features[first:last].to(hidden.dtype)


@hookimpl
def zoo_request_finished(request):
    request.plugin_state.pop(STATE, None)
    request.plugin_state.pop(PARSED, None)  # refused between its prompt transform and its validation
