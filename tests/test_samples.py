"""Parallel samples (``sampling.n``): a prompt's n completions share its cached blocks, each with its own seed
stream, in one continuous batch with other requests."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams

MAX_NEW = 8


@pytest.fixture(scope="module")
def llama(checkpoints):
    folder, model = checkpoints["llama"]
    return folder, model


def test_greedy_samples_equal_transformers_and_share_the_prompt_blocks(llama):
    folder, model = llama
    prompt = prompt_set()[1]  # 33 tokens: two full 16-token blocks
    llm = LLM(str(folder), block_size=16)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, n=3))[0]
    reference = hf_greedy(model, prompt, MAX_NEW)[0]
    assert out.token_ids == reference
    assert [s.index for s in out.samples] == [0, 1, 2]
    assert all(s.token_ids == reference and s.finish_reason == "length" for s in out.samples)
    # samples 1 and 2 took the two full prompt blocks from the first sample's cache entries
    assert llm.engine.blocks.prefix_hit_tokens >= 2 * 32
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_work()
    record = out.to_json()
    assert [s["token_ids"] for s in record["samples"]] == [reference] * 3
    json.dumps(record)


def sampled(n, seed=5):
    return SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.0, n=n, seed=seed)


def test_seeded_samples_do_not_depend_on_the_batch(llama):
    folder, _ = llama
    prompts = prompt_set()
    alone = LLM(str(folder)).generate([prompts[2]], sampled(4))[0]
    samples = [s.token_ids for s in alone.samples]
    assert len({tuple(s) for s in samples}) > 1  # each sample its own stream
    # the same request among others (greedy, sampled, with n of their own), another batch composition
    llm = LLM(str(folder), max_num_seqs=5)
    others = [SamplingParams(max_new_tokens=MAX_NEW + 3, ignore_eos=True, n=2),
              sampled(3, seed=9), sampled(4), SamplingParams(max_new_tokens=2, ignore_eos=True)]
    outs = llm.generate([prompts[0], prompts[1], prompts[2], prompts[3]], others)
    assert [s.token_ids for s in outs[2].samples] == samples
    assert len(outs[0].samples) == 2 and outs[0].samples[0].token_ids == outs[0].samples[1].token_ids


def test_samples_survive_preemption(llama):
    folder, model = llama
    prompts = prompt_set()[:3]
    llm = LLM(str(folder), block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, n=3))
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        reference = hf_greedy(model, prompt, MAX_NEW)[0]
        assert [s.token_ids for s in out.samples] == [reference] * 3
    assert llm.engine.blocks.num_used_blocks == 0


def test_sampled_first_tokens_follow_transformers_distribution(llama):
    """400 samples of one token under top_k=4: their frequencies against transformers' softmax of the top 4."""
    folder, model = llama
    prompt = prompt_set()[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1].double()
    top = torch.topk(logits, 4)
    probs = torch.softmax(top.values, 0)
    llm = LLM(str(folder))
    out = llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True, temperature=1.0, top_k=4,
                                                n=256, seed=11))[0]
    counts = torch.zeros(4, dtype=torch.float64)
    ids = top.indices.tolist()
    for sample in out.samples:
        counts[ids.index(sample.token_ids[0])] += 1
    # Pearson's chi-square with 3 degrees of freedom: 16.27 is its 0.999 quantile
    expected = probs * counts.sum()
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27, (counts.tolist(), expected.tolist())


def test_streamed_samples_concatenate_to_each_completion(llama):
    folder, _ = llama
    llm = LLM(str(folder))
    events = list(llm.stream([prompt_set()[0], prompt_set()[4]], [sampled(3), sampled(2, seed=1)]))
    finals = {e.index: e.output for e in events if e.output is not None}
    assert sorted(finals) == [0, 1]
    for index, output in finals.items():
        for sample in output.samples:
            pieces = [e for e in events if e.index == index and e.sample == sample.index]
            assert [t for e in pieces for t in e.token_ids] == sample.token_ids
            assert "".join(e.text for e in pieces) == sample.text


@pytest.mark.parametrize("n", [0, -1, 1.5, 300])
def test_a_bad_n_fails_alone(llama, n):
    folder, _ = llama
    llm = LLM(str(folder))
    outs = llm.generate([{"prompt_ids": [1, 2, 3], "n": n}, [4, 5, 6]], SamplingParams(max_new_tokens=3))
    assert outs[0].finish_reason == "error" and "n=" in outs[0].error and "[1, 256]" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3
