"""Qwen2-VL with images against transformers' Qwen2VLForConditionalGeneration.

A random-init tiny model is saved with ``save_pretrained`` and loaded by zoo's
loader. Positions are checked against ``get_rope_index``; greedy tokens and
logits against ``generate`` given the same ``pixel_values`` and
``image_grid_thw``, for batches mixing text-only and image requests, with
prefill chunks cutting through images and with prefix caching.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from test_parity import LogitsRecorder
from zoo import LLM, SamplingParams
from zoo_plugins.mrope import prompt_positions

transformers = pytest.importorskip("transformers")

IMAGE, START, END = 290, 292, 293
LOGIT_ATOL = 1e-4  # float32
PATCH_VALUES = 3 * 2 * 14 * 14


def write_qwen2_vl(folder):
    """A random-init tiny Qwen2-VL saved in ``folder`` (the ``qwen2_vl`` fixture of conftest.py); its model."""
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.1, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.1),
        image_token_id=IMAGE, video_token_id=291, vision_start_token_id=START, vision_end_token_id=END,
        initializer_range=0.1)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def make_image(folder, name, grid, seed):
    t, h, w = grid
    pixels = torch.randn(t * h * w, PATCH_VALUES, generator=torch.Generator().manual_seed(seed))
    path = folder / f"{name}.safetensors"
    save_file({"pixel_values": pixels}, str(path))
    return {"pixel_values": str(path), "image_grid_thw": list(grid)}, pixels


def image_prompt(before, grid, after):
    t, h, w = grid
    return before + [START] + [IMAGE] * (t * h * w // 4) + [END] + after


def hf_greedy(model, prompt, pixels, grid, n):
    ids = torch.tensor([prompt])
    kwargs = {"attention_mask": torch.ones_like(ids)}  # not inferred from pad_token_id: token 0 is a real token
    if pixels is not None:
        kwargs.update(pixel_values=pixels, image_grid_thw=torch.tensor([grid]),
                      mm_token_type_ids=(ids == IMAGE).int())
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([l[0] for l in out.logits])


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 6, 4), (1, 2, 2)], [(2, 4, 4)], []])
def test_positions_equal_get_rope_index(qwen2_vl, grids):
    _, model = qwen2_vl
    prompt = [5, 6, 7]
    for i, grid in enumerate(grids):
        prompt = image_prompt(prompt, grid, [10 + i, 11 + i])
    ids = torch.tensor([prompt])
    expected, delta = model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    rows, our_delta = prompt_positions(prompt, IMAGE, grids, merge=2)
    assert rows == expected[:, 0].tolist()
    assert our_delta == int(delta[0, 0])


def requests_and_references(qwen2_vl, tmp_path, n=6):
    """A batch mixing text-only and image requests, with transformers' greedy tokens and logits."""
    _, model = qwen2_vl
    g = torch.Generator().manual_seed(3)

    def text(k):
        return torch.randint(0, 280, (k,), generator=g).tolist()

    specs = [(text(9), None), (text(4), (1, 4, 6)), (text(13), None), (text(2), (1, 6, 4)), (text(5), (1, 2, 2))]
    requests, references = [], []
    for i, (before, grid) in enumerate(specs):
        if grid is None:
            prompt, pixels, request = before, None, {"prompt_ids": before}
        else:
            image, pixels = make_image(tmp_path, f"img{i}", grid, seed=i)
            prompt = image_prompt(before, grid, text(3))
            request = {"prompt_ids": prompt, "images": [image]}
        requests.append(request)
        references.append(hf_greedy(model, prompt, pixels, grid, n))
    return requests, references


@pytest.mark.parametrize("runtime", [
    {},
    {"max_num_batched_tokens": 5, "block_size": 4},  # prefill chunks cut through every image
    {"max_num_seqs": 2, "block_size": 4, "num_kv_blocks": 64},  # few at a time, preemption and prefix caching
])
def test_greedy_matches_transformers_with_images(qwen2_vl, tmp_path, runtime):
    folder, _ = qwen2_vl
    requests, references = requests_and_references(qwen2_vl, tmp_path)
    recorder = LogitsRecorder()
    llm = LLM(str(folder), model="qwen2_vl", plugins=[recorder], **runtime)
    if llm.engine.device.type == "cuda" and not runtime:
        assert llm.engine.uses_cuda_graphs  # three position rows replay in graphs
    outs = llm.generate(requests, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for i, (out, (tokens, logits)) in enumerate(zip(outs, references)):
        assert out.error is None
        assert out.token_ids == tokens
        torch.testing.assert_close(torch.stack(recorder.rows[i]), logits, atol=LOGIT_ATOL, rtol=0)


def test_prefix_cache_keeps_images_apart(qwen2_vl, tmp_path):
    """Equal prompt ids with other pixels must not reuse K/V; the same image again may."""
    folder, model = qwen2_vl
    grid = (1, 4, 8)  # 8 image-pad tokens: two full blocks of 4
    prompt = image_prompt([1, 2, 3], grid, [4, 5, 6, 7])
    first, pixels_a = make_image(tmp_path, "a", grid, seed=10)
    other, pixels_b = make_image(tmp_path, "b", grid, seed=11)
    llm = LLM(str(folder), model="qwen2_vl", block_size=4, max_num_seqs=1)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_ids": prompt, "images": [first]}, {"prompt_ids": prompt, "images": [other]},
                         {"prompt_ids": prompt, "images": [first]}], params)
    assert llm.engine.blocks.prefix_hit_tokens > 0  # the third request reused the first one's blocks
    for out, pixels in zip(outs, (pixels_a, pixels_b, pixels_a)):
        assert out.token_ids == hf_greedy(model, prompt, pixels, grid, 4)[0]


def test_image_files_are_processed_like_transformers(qwen2_vl, tmp_path):
    from PIL import Image

    from zoo_plugins.qwen2_vl import image_patches

    processor = transformers.Qwen2VLImageProcessorPil()
    vision = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    g = torch.Generator().manual_seed(0)
    for width, height in [(84, 56), (100, 70)]:  # the second is resized to multiples of 28
        array = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
        path = tmp_path / f"image_{width}x{height}.png"
        Image.fromarray(array.numpy()).save(path)
        pixels, grid = image_patches(str(path), vision)
        expected = processor(images=Image.open(path), return_tensors="pt")
        assert list(grid) == expected["image_grid_thw"][0].tolist()
        torch.testing.assert_close(pixels, expected["pixel_values"].float(), atol=1e-5, rtol=0)


def test_image_file_request_matches_transformers(qwen2_vl, tmp_path):
    from PIL import Image

    folder, model = qwen2_vl
    array = torch.randint(0, 256, (56, 84, 3), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    path = tmp_path / "photo.png"
    Image.fromarray(array.numpy()).save(path)
    processed = transformers.Qwen2VLImageProcessorPil()(images=Image.open(path), return_tensors="pt")
    grid = tuple(processed["image_grid_thw"][0].tolist())
    prompt = image_prompt([7, 8], grid, [9])
    out = LLM(str(folder), model="qwen2_vl").generate(
        [{"prompt_ids": prompt, "images": [str(path)]}], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.error is None
    assert out.token_ids == hf_greedy(model, prompt, processed["pixel_values"], grid, 5)[0]


def test_one_pad_per_image_is_widened_as_the_processor_does(qwen2_vl, tmp_path):
    """A prompt with one image-pad token per image (what Qwen2-VL's chat template writes) gets each widened to its
    image's merged patches, as transformers' Qwen2VLProcessor does: the same tokens as the widened prompt, and as
    transformers; the output's prompt is the one the user sent."""
    folder, model = qwen2_vl
    grids = [(1, 4, 6), (1, 2, 2)]
    images = [make_image(tmp_path, f"img{i}", grid, seed=i) for i, grid in enumerate(grids)]
    short = [5, START, IMAGE, END, 6, START, IMAGE, END, 7]
    widened = image_prompt([5], grids[0], []) + image_prompt([6], grids[1], [7])
    llm = LLM(str(folder), model="qwen2_vl")
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    outs = llm.generate([{"prompt_ids": short, "images": [i for i, _ in images]},
                         {"prompt_ids": widened, "images": [i for i, _ in images]}], params)
    assert outs[0].error is None and outs[0].token_ids == outs[1].token_ids
    assert outs[0].prompt_token_ids == short
    pixels = torch.cat([p for _, p in images])
    ids = torch.tensor([widened])
    with torch.no_grad():
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
                                   image_grid_thw=torch.tensor(grids), mm_token_type_ids=(ids == IMAGE).int(),
                                   max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert outs[0].token_ids == reference[0, len(widened):].tolist()
    # two pads for two images, but one image given: left as it is, and refused with the count
    bad = llm.generate([{"prompt_ids": short, "images": [images[0][0]]}], params)[0]
    assert bad.finish_reason == "error" and "the prompt has 2 image-pad tokens" in bad.error


def test_bad_images_fail_alone(qwen2_vl, tmp_path):
    folder, _ = qwen2_vl
    good, _ = make_image(tmp_path, "good", (1, 4, 6), seed=1)
    garbage = tmp_path / "broken.png"
    garbage.write_bytes(b"not an image at all")
    wrong_shape = tmp_path / "wrong.safetensors"
    save_file({"pixel_values": torch.zeros(10, PATCH_VALUES)}, str(wrong_shape))
    prompt = image_prompt([1, 2], (1, 4, 6), [3])
    llm = LLM(str(folder), model="qwen2_vl")
    outs = llm.generate([
        {"prompt_ids": image_prompt([1, 2], (1, 4, 4), [3]), "images": [good]},  # 4 pads for a 6-token grid
        {"prompt_ids": prompt, "images": [str(tmp_path / "missing.png")]},
        {"prompt_ids": prompt, "images": [str(garbage)]},
        {"prompt_ids": prompt, "images": [{"pixel_values": str(wrong_shape), "image_grid_thw": [1, 4, 6]}]},
        {"prompt_ids": prompt, "images": [good, good]},
        {"prompt_ids": prompt[:4] + [5] + prompt[4:], "images": [{"pixel_values": good["pixel_values"],
                                                                   "image_grid_thw": [1, 4, 6]}]},
        {"prompt_ids": prompt, "images": [good]},
    ], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert "4 image-pad tokens, but the images' grids (1x4x6, merged 2x2) need 6" in outs[0].error
    assert outs[1].error.startswith("image 0: image file not found:")
    assert outs[2].error.startswith("image 0: cannot read") and "as an image" in outs[2].error
    assert "do not match image_grid_thw [1, 4, 6]: expected [24, 1176]" in outs[3].error
    assert "need 12" in outs[4].error
    assert "6 tokens after merging, but 1 image-pad tokens stand in a row" in outs[5].error
    assert outs[6].error is None and len(outs[6].token_ids) == 3


def test_images_on_a_text_model_are_a_clear_error():
    out = LLM().generate([{"prompt_ids": [1, 2, 3], "images": ["x.png"]}])[0]
    assert out.error.startswith("unknown request field(s): images; images is read by plugin qwen2_vl, which does "
                                "not take part in this run")
    assert "the checkpoint is LlamaForCausalLM" in out.error


def test_image_paths_in_an_input_file_are_relative_to_its_folder(qwen2_vl, tmp_path):
    """`python -m zoo.run input.file=data/requests.jsonl` with `"images": ["photo.png"]` reads data/photo.png."""
    import json
    import os
    import subprocess
    import sys

    from PIL import Image

    folder, model = qwen2_vl
    data = tmp_path / "data"
    data.mkdir()
    array = torch.randint(0, 256, (56, 56, 3), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    Image.fromarray(array.numpy()).save(data / "photo.png")
    processed = transformers.Qwen2VLImageProcessorPil()(images=Image.open(data / "photo.png"), return_tensors="pt")
    grid = tuple(processed["image_grid_thw"][0].tolist())
    prompt = image_prompt([7, 8], grid, [9])
    (data / "requests.jsonl").write_text(json.dumps({"prompt_ids": prompt, "images": ["photo.png"]}) + "\n")
    proc = subprocess.run([sys.executable, "-m", "zoo.run", "model=qwen2_vl", f"model.path={folder}",
                           "input.file=data/requests.jsonl", "output.format=jsonl", "sampling.max_new_tokens=4",
                           "sampling.ignore_eos=true"], capture_output=True, text=True, cwd=tmp_path, timeout=180,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["token_ids"] == hf_greedy(model, prompt, processed["pixel_values"], grid, 4)[0]
