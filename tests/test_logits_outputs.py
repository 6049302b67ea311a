"""Logits outputs: prompt log-probs (vLLM's ``prompt_logprobs``) and raw context and generation logits
(``return_logits``), against transformers' own logits in float32, under every scheduling regime; nothing extra
is computed when they are off."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, prompt_set
from test_parity import REGIMES  # batched, chunked prefill, preemption
from zoo import LLM, SamplingParams

MAX_NEW = 6
ATOL = 1e-4  # float32 on CPU, as tests/test_parity.py



@pytest.fixture(scope="module")
def reference(checkpoints):
    _, model = checkpoints["llama"]
    out = {}
    for prompt in prompt_set():
        with torch.no_grad():
            context = model(torch.tensor([prompt])).logits[0].double()
        tokens, generation = hf_greedy(model, prompt, MAX_NEW)
        out[tuple(prompt)] = (context, tokens, generation.double())
    return out


def check_prompt_logprobs(entries, prompt, context, top_n):
    assert len(entries) == len(prompt) and entries[0] is None
    logprobs = torch.log_softmax(context, -1)
    for position in range(1, len(prompt)):
        entry = entries[position]
        assert entry["token_id"] == prompt[position]
        assert entry["logprob"] == pytest.approx(float(logprobs[position - 1, prompt[position]]), abs=ATOL)
        if top_n:
            want = torch.topk(logprobs[position - 1], top_n)
            assert [t for t, _ in entry["top"]] == want.indices.tolist()
            assert [v for _, v in entry["top"]] == pytest.approx(want.values.tolist(), abs=ATOL)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_prompt_logprobs_and_logits_equal_transformers(checkpoints, reference, regime):
    folder, _ = checkpoints["llama"]
    prompts = prompt_set()
    llm = LLM(str(folder), **REGIMES[regime])
    params = [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=k % 3, return_logits=k % 2 == 0)
              for k in range(len(prompts))]
    outputs = llm.generate(prompts, params)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    for k, (prompt, out) in enumerate(zip(prompts, outputs)):
        context, tokens, generation = reference[tuple(prompt)]
        assert out.token_ids == tokens
        check_prompt_logprobs(out.prompt_logprobs, prompt, context, k % 3)
        if k % 2 == 0:
            assert out.context_logits.shape == context.shape
            assert torch.allclose(out.context_logits.double(), context, atol=ATOL)
            assert torch.allclose(out.generation_logits.double(), generation, atol=ATOL)
        else:
            assert out.context_logits is None and out.generation_logits is None


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(checkpoints, reference):
    folder, _ = checkpoints["llama"]
    prompts = prompt_set()[3:5]  # share a 20-token prefix
    llm = LLM(str(folder), block_size=4)
    llm.generate([prompts[0]], SamplingParams(max_new_tokens=2))  # fills the prefix cache
    engine = llm.engine
    request = engine.add_request(prompt_token_ids=prompts[1], params=SamplingParams(max_new_tokens=2,
                                                                                    prompt_logprobs=1))
    engine.run_until_done()
    assert request.num_cached_prompt_tokens == 0
    check_prompt_logprobs(request.prompt_logprobs, prompts[1], reference[tuple(prompts[1])][0], 1)
    plain = engine.add_request(prompt_token_ids=prompts[1], params=SamplingParams(max_new_tokens=2))
    engine.run_until_done()
    assert plain.num_cached_prompt_tokens > 0  # without them the cache serves the prefix as usual


def test_off_costs_no_logits_rows(checkpoints):
    folder, _ = checkpoints["llama"]
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16)
    sizes = []
    original = llm.engine.runner.prepare

    def prepare(scheduled):
        batch = original(scheduled)
        sizes.append((len(batch.logits_indices), sum(len(r) for r in batch.logits_rows)))
        return batch

    llm.engine.runner.prepare = prepare
    llm.generate(prompt_set(), SamplingParams(max_new_tokens=3, logprobs=2))
    assert sizes and all(rows == sampled for rows, sampled in sizes)


def test_records_carry_them(checkpoints):
    folder, _ = checkpoints["llama"]
    out = LLM(str(folder)).generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=2, prompt_logprobs=0,
                                                                  return_logits=True))[0]
    record = json.loads(json.dumps(out.to_json()))
    assert record["prompt_logprobs"][0] is None and len(record["prompt_logprobs"]) == 4
    assert len(record["context_logits"]) == 4 and len(record["generation_logits"]) == 2


@pytest.mark.parametrize("field, value, message", [
    ("prompt_logprobs", -1, "prompt_logprobs=-1 must be an integer in [0, 20]"),
    ("prompt_logprobs", 21, "prompt_logprobs=21 must be an integer in [0, 20]"),
    ("return_logits", "yes", "return_logits='yes' must be true or false"),
])
def test_a_bad_value_fails_alone(checkpoints, field, value, message):
    folder, _ = checkpoints["llama"]
    outs = LLM(str(folder)).generate([{"prompt_ids": [1, 2, 3], field: value}, [4, 5, 6]],
                                     SamplingParams(max_new_tokens=3))
    assert outs[0].finish_reason == "error" and message in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3
