"""Overlapped steps (``runtime.overlap_steps``): a plain decode step launched before the previous is committed.

On CPU nothing runs beside anything else, but every rule of the overlapped loop is exercised: the next step's
inputs come from the previous step's tokens on the device, a request ending with the previous step is left out,
one that a stop token ends has its extra token dropped, and whatever the scheduler must decide (new requests,
no free block, sampled or drafted requests) goes back to ordinary steps. Tokens must equal transformers'.
"""

from __future__ import annotations

import pytest

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def llama(checkpoints):
    folder, model = checkpoints["llama"]
    return folder, {tuple(p): hf_greedy(model, p, MAX_NEW)[0] for p in prompt_set()}


def run(folder, prompts, params, **runtime):
    llm = LLM(str(folder), overlap_steps=True, **runtime)
    return llm, llm.generate(prompts, params)


def test_overlapped_steps_give_transformers_tokens_with_uneven_lengths(llama):
    folder, reference = llama
    prompts = prompt_set()
    lengths = [MAX_NEW, 3, MAX_NEW, 1, 6, MAX_NEW]  # requests end at different steps: the rest go on
    llm, outputs = run(folder, prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths],
                       max_num_batched_tokens=512)
    for prompt, n, out in zip(prompts, lengths, outputs):
        assert out.token_ids == reference[tuple(prompt)][:n]
        assert out.finish_reason == "length"
    assert llm.engine.overlapped_steps >= MAX_NEW - 3
    assert llm.engine.advanced_in_place > 0  # steps with the same rows as the one before: advanced on the device
    assert not llm.engine.has_work() and llm.engine.blocks.num_used_blocks == 0


def test_a_stop_token_drops_the_step_already_launched(llama):
    folder, reference = llama
    prompts = prompt_set()[:3]
    # the stop id is request 0's fourth token: the step after it is already running when it is committed
    stop = reference[tuple(prompts[0])][3]
    params = [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, stop_token_ids=[stop])] + \
        [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)] * 2
    llm, outputs = run(folder, prompts, params)
    first = reference[tuple(prompts[0])]
    assert outputs[0].token_ids == first[:first.index(stop) + 1] and outputs[0].finish_reason == "stop"
    for prompt, out in zip(prompts[1:], outputs[1:]):
        assert out.token_ids == reference[tuple(prompt)]
    assert llm.engine.overlapped_steps > 0 and llm.engine.blocks.num_used_blocks == 0


def test_new_requests_and_full_caches_go_back_to_ordinary_steps(llama):
    folder, reference = llama
    prompts = prompt_set()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(str(folder), overlap_steps=True, block_size=4, num_kv_blocks=24, max_num_batched_tokens=64)
    engine = llm.engine
    first = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts[:2]]
    for _ in range(4):
        engine.step()
    later = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts[2:]]
    engine.run_until_done()
    for prompt, request in zip(prompts, first + later):
        assert request.output_token_ids == reference[tuple(prompt)], request.error
    assert engine.overlapped_steps > 0 and engine.advanced_in_place > 0  # 4-token blocks: new blocks mid-run
    assert engine.scheduler.num_preemptions > 0  # the small cache made the scheduler step in


def test_sampled_requests_keep_ordinary_steps(llama):
    folder, reference = llama
    prompts = prompt_set()[:2]
    params = [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)]
    llm, outputs = run(folder, prompts, params)
    plain = LLM(str(folder)).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert outputs[1].token_ids == reference[tuple(prompts[1])]
    assert llm.engine.overlapped_steps == 0


def test_arrivals_wait_out_the_admission_interval_beside_overlapped_steps(llama):
    """An admission interval of 4: requests arriving one at a time while others decode join every fourth step
    (or at once when four wait), so the steps between stay plain decodes (overlapped); the tokens stay
    transformers'. runtime.admission_interval applies with CUDA graphs only, so on CPU the test sets the
    scheduler's interval itself."""
    folder, reference = llama
    prompts = prompt_set()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(str(folder), overlap_steps=True, admission_interval=4, max_num_batched_tokens=512)
    engine = llm.engine
    assert engine.scheduler.admission_interval == (4 if engine.uses_cuda_graphs else 1)
    engine.scheduler.admission_interval = 4
    requests = [engine.add_request(prompt_token_ids=prompts[0], params=params)]
    engine.step()
    deferred = []
    for prompt in prompts[1:4]:  # one arrival per step
        requests.append(engine.add_request(prompt_token_ids=prompt, params=params))
        engine.step()
        deferred.append(engine.scheduler.steps_deferred)
    requests += [engine.add_request(prompt_token_ids=p, params=params) for p in prompts[4:]]
    engine.run_until_done()
    for prompt, request in zip(prompts, requests):
        assert request.output_token_ids == reference[tuple(prompt)], request.error
    assert max(deferred) >= 1  # arrivals sat out steps while the others decoded
    assert engine.overlapped_steps > 0 and not engine.has_work() and engine.blocks.num_used_blocks == 0
