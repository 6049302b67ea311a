"""Multimodal rotary positions (mRoPE, Qwen2-VL): three rows per token, temporal, height and width.

Text tokens have the same position in all three rows, counting on from the
previous token. The tokens of an image (its patches after the spatial merge,
``t * h * w / merge**2`` image-pad tokens in a row) all start from the position
after the text before them: the temporal row adds the frame, the height and
width rows the patch's row and column. Text after an image continues from its
start plus ``max(h, w) / merge``. Generated tokens take ``index + delta``
in all three rows, ``delta`` fixed per request at admission (the largest prompt
position plus one, minus the prompt length).

The rotary module then takes, for each frequency, the row its section of
``mrope_section`` names (temporal, height, width, in turn), so its tables keep
the rotate-half form and the fused GPU kernel applies them.

This plugin takes part only when an architecture plugin that takes part
requires it (``qwen2_vl``); that plugin sets ``extra["mrope_section"]``,
``extra["image_token_id"]`` and ``extra["spatial_merge_size"]`` in its
description and stores each request's image grids under
``request.plugin_state[IMAGE_GRIDS]`` before admission.
"""

from __future__ import annotations

import torch

from zoo import RequestError, Scope, hookimpl
from zoo.model import Rotary

zoo_scope = Scope(on_demand=True)
STATE = "mrope"
# The plugin_state key under which a vision plugin leaves a request's image grids, [(t, h, w), ...] in
# prompt order, before admission: the one key mrope reads from another plugin.
IMAGE_GRIDS = "image_grids"


class MultimodalRotary(Rotary):
    """RoPE whose frequency sections follow the temporal, height and width position rows."""

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype):
        sections = self.description.extra["mrope_section"]
        freqs = positions[:3].float()[:, :, None] * self.inv_freq[None, None, :]  # [3, T, dim/2]
        chosen = torch.cat([part[i % 3] for i, part in enumerate(freqs.split(sections, dim=-1))], dim=-1)
        emb = torch.cat((chosen, chosen), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def prompt_positions(token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                     merge: int) -> tuple[list[list[int]], int]:
    """The three position rows of a prompt and its generation delta.

    ``grids`` are the images' (t, h, w) patch grids in prompt order; each image needs
    ``t * h * w / merge**2`` image-pad tokens in a row.
    """
    rows: list[list[int]] = [[], [], []]
    next_position, i, image = 0, 0, 0
    while i < len(token_ids):
        if token_ids[i] != image_token_id:
            for row in rows:
                row.append(next_position)
            next_position += 1
            i += 1
            continue
        if image == len(grids):
            raise RequestError(f"the prompt has more image-pad tokens than its {len(grids)} image(s) fill")
        t, h, w = grids[image]
        gh, gw = h // merge, w // merge
        count = t * gh * gw
        if token_ids[i:i + count] != [image_token_id] * count:
            run = next((k for k, tok in enumerate(token_ids[i:]) if tok != image_token_id), len(token_ids) - i)
            raise RequestError(f"image {image} has a {t}x{h}x{w} patch grid, {count} tokens after merging, but "
                               f"{run} image-pad tokens stand in a row at its place")
        for frame in range(t):
            for y in range(gh):
                for x in range(gw):
                    rows[0].append(next_position + frame)
                    rows[1].append(next_position + y)
                    rows[2].append(next_position + x)
        next_position += max(gh, gw)  # as transformers' get_rope_index: frames do not advance the text
        i += count
        image += 1
    if image != len(grids):
        raise RequestError(f"the prompt has image-pad tokens for {image} image(s), but {len(grids)} were given")
    return rows, max(max(row) for row in rows) + 1 - len(token_ids)


@hookimpl
def zoo_request_admit(request, engine):
    extra = engine.description.extra
    grids = request.plugin_state.get(IMAGE_GRIDS, [])
    try:
        rows, delta = prompt_positions(request.prompt_token_ids, extra["image_token_id"], grids,
                                       extra["spatial_merge_size"])
    except RequestError as exc:
        request.finish("error", str(exc))
        return
    request.plugin_state[STATE] = (rows, delta)


@hookimpl
def zoo_step_positions(request, indices):
    rows, delta = request.plugin_state.get(STATE, (None, 0))
    if rows is None:  # a text-only layout (the CUDA memory-profile step's dummy requests)
        return [list(indices)] * 3
    prompt_len = len(rows[0])
    return [[row[i] if i < prompt_len else i + delta for i in indices] for row in rows]
