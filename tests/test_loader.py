"""Checkpoint loading: sharded safetensors, tokenizer.json, hub ids from the cache, dtypes, the CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import torch

from conftest import VOCAB, hf_greedy, make_checkpoint, prompt_set
from zoo import LLM, SamplingParams


def test_sharded_checkpoint(tmp_path, checkpoints):
    _, model = checkpoints["qwen2"]
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompt = prompt_set()[1]
    out = LLM(str(tmp_path)).generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 6)[0]


def _word_tokenizer(folder):
    """A word-level tokenizer.json over the checkpoint's vocabulary, made with `tokenizers`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<unk>": VOCAB - 2, "</s>": VOCAB - 1})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return tokenizer


def test_tokenizer_json_and_text_prompts(tmp_path, checkpoints):
    folder, model = checkpoints["llama"]
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    tokenizer = _word_tokenizer(tmp_path)
    text = "w5 w17 w200 w3"
    ids = tokenizer.encode(text).ids
    out = LLM(str(tmp_path)).generate([text], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert out.prompt_token_ids == ids
    ref = hf_greedy(model, ids, 5)[0]
    assert out.token_ids == ref
    assert out.text == tokenizer.decode(ref)


def test_hub_id_resolves_from_offline_cache(tmp_path, checkpoints, monkeypatch):
    folder, model = checkpoints["gpt2"]
    snapshot = tmp_path / "hub" / "models--acme--tiny-gpt2" / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny-gpt2" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    prompt = prompt_set()[0]
    out = LLM("acme/tiny-gpt2", model="gpt2").generate([prompt], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 4)[0]


def test_bfloat16_weights_stay_close(checkpoints):
    folder, model = checkpoints["llama"]
    llm = LLM(str(folder), dtype="bfloat16")
    assert llm.engine.model.lm_head.weight.dtype == torch.bfloat16
    prompt = prompt_set()[1]
    out = llm.generate([prompt], SamplingParams(max_new_tokens=1, logprobs=5, ignore_eos=True))[0]
    _, logits = hf_greedy(model, prompt, 1)
    reference = torch.log_softmax(logits[0], -1)
    for token, value in out.logprobs[0]["top"]:
        assert abs(value - float(reference[token])) < 0.05  # bf16 weights and activations


def test_cli_random_init_embedded_model_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zoo.run", "model=gpt2", "prompt=Hello", "sampling.max_new_tokens=8"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM-INIT" in proc.stderr
    assert proc.stdout.startswith("[1] ")  # a single prompt is request 1
    for fragment in ("requests: 1", "prompt tokens: 6", "generated tokens: 8", "time to first token",
                     "prefill:", "decode:", "KV blocks:"):
        assert fragment in proc.stderr, fragment
    assert not (tmp_path / "outputs").exists()  # Hydra writes no run folders


def test_cli_jsonl_with_logprobs_and_overrides(tmp_path, checkpoints):
    folder, model = checkpoints["gpt2"]
    prompts = prompt_set()[:2]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([json.dumps({"id": "a", "prompt_ids": prompts[0], "max_new_tokens": 3}),
                               json.dumps({"id": "b", "prompt_ids": prompts[1], "sampling": {"logprobs": 2}})]))
    proc = subprocess.run([sys.executable, "-m", "zoo.run", "model=gpt2", f"model.path={folder}",
                           f"input.file={path}", "output.format=jsonl", "sampling.max_new_tokens=5",
                           "sampling.ignore_eos=true"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    a, b = [json.loads(line) for line in proc.stdout.splitlines()]
    assert a["id"] == "a" and a["token_ids"] == hf_greedy(model, prompts[0], 3)[0] and "logprobs" not in a
    assert b["id"] == "b" and b["token_ids"] == hf_greedy(model, prompts[1], 5)[0]
    assert len(b["logprobs"]) == 5 and len(b["logprobs"][0]["top"]) == 2
    assert b["prompt_token_ids"] == prompts[1] and b["finish_reason"] == "length"


def test_logit_bias_forces_a_token():
    out = LLM(model="gpt2").generate(["x"], SamplingParams(max_new_tokens=4, logit_bias={65: 100.0}))[0]
    assert out.token_ids == [65] * 4 and out.text == "AAAA"


def test_checkpoint_with_eos_in_config(tmp_path):
    model = make_checkpoint("llama", tmp_path, eos_token_id=5)
    llm = LLM(str(tmp_path))
    assert llm.engine.description.eos_token_ids == [5]
    assert model.config.eos_token_id == 5
