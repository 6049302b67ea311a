"""Sliding-window attention with blocks outside the window given back, and attention sinks (StreamingLLM: the
first tokens stay visible), so that a generation longer than the KV cache holds runs in it. Mistral's window
against transformers' Mistral; sinks against transformers' Llama run with the same rule as a 4-D mask."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams


def hf_greedy_masked(model, prompt, new_tokens, window, sinks):
    """Greedy tokens of transformers' model, each step over the whole sequence with a mask of the rule: key j is
    seen by query i when j <= i and (j > i - window or j < sinks)."""
    tokens = list(prompt)
    for _ in range(new_tokens):
        n = len(tokens)
        i = torch.arange(n)
        allowed = (i[None, :] <= i[:, None]) & ((i[None, :] > i[:, None] - window) | (i[None, :] < sinks))
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        with torch.no_grad():
            logits = model(torch.tensor([tokens]), attention_mask=mask).logits[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_mistral_window_frees_blocks_and_equals_transformers(checkpoints):
    """Mistral's 24-token window, 4-token blocks, a cache of 14 blocks (56 slots) and 100 new tokens."""
    folder, model = checkpoints["mistral"]
    prompts = prompt_set()[:2]
    llm = LLM(str(folder), model="llama", block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=100, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert len(prompt) + 100 > 14 * 4  # longer than the whole cache
        assert out.token_ids == hf_greedy(model, prompt, 100)[0]
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("window, sinks", [(16, 4), (12, 0), (10, 6)])
def test_sinks_and_window_equal_the_rule_run_by_transformers(checkpoints, window, sinks):
    folder, model = checkpoints["llama"]
    prompts = [prompt_set()[1], prompt_set()[2]]
    new = 60
    llm = LLM(str(folder), block_size=4, num_kv_blocks=16, max_num_batched_tokens=16, sliding_window=window,
              attention_sinks=sinks)
    engine = llm.engine
    requests = [engine.add_request(prompt_token_ids=p, params=SamplingParams(max_new_tokens=new, ignore_eos=True))
                for p in prompts]
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, max(sum(b >= 0 for b in r.block_ids) for r in requests))
    for prompt, request in zip(prompts, requests):
        assert request.output_token_ids == hf_greedy_masked(model, prompt, new, window, sinks)
    assert peak <= -(-sinks // 4) + -(-(window + 16) // 4) + 1  # live blocks stay within the window's share
    assert engine.blocks.num_used_blocks == 0


def test_sinks_without_a_window_is_one_line(checkpoints):
    from zoo.errors import ZooError

    folder, _ = checkpoints["llama"]
    with pytest.raises(ZooError, match="runtime.attention_sinks needs a sliding window"):
        LLM(str(folder), attention_sinks=4)


def qwen2_checkpoint(folder, max_window_layers):
    import transformers

    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      use_sliding_window=True, sliding_window=16, max_window_layers=max_window_layers,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None, initializer_range=0.1)
    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.mark.parametrize("max_window_layers", [0, 2])  # every layer windowed; none (the window starts past them)
def test_qwen2_windows_follow_transformers_layer_rule(tmp_path, max_window_layers):
    model = qwen2_checkpoint(tmp_path, max_window_layers)
    prompt = prompt_set()[5]  # 34 tokens: longer than the window
    llm = LLM(str(tmp_path), block_size=4)
    assert llm.engine.description.sliding_window == (16 if max_window_layers == 0 else None)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(model, prompt, 30)[0]


def test_qwen2_windows_on_some_layers_only_are_one_line(tmp_path):
    from zoo.errors import ZooError

    qwen2_checkpoint(tmp_path, 1)
    with pytest.raises(ZooError, match="sliding window on 1 of its 2 layers"):
        LLM(str(tmp_path))
