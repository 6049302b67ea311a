"""Beam search against transformers' ``num_beams`` (float32, tiny random-init Llama): every returned beam's tokens
and score, for several widths, lengths, length penalties and early-stopping rules, with and without a stop token,
in one continuous batch with greedy and sampled requests, under chunked prefill and under preemption."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams

SCORE_ATOL = 1e-4


def hf_beams(model, prompt, width, max_new, length_penalty, early_stopping, eos):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_new, length_penalty=length_penalty,
                             early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
                             return_dict_in_generate=True, output_scores=True)
    beams = []
    for row, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        beams.append((row, score))
    return beams


def cases(prompts, model):
    out = []
    for p, (width, max_new, lp, es, with_eos) in enumerate(itertools.product(
            (2, 3), (4, 9), (1.0, 0.0, 2.0, -0.5), (False, True, "never"), (False, True))):
        prompt = prompts[p % len(prompts)]
        eos = None
        if with_eos:  # a token on the unstopped best beam's path: some hypotheses end early
            eos = hf_beams(model, prompt, width, max_new, lp, es, None)[0][0][1]
        out.append((prompt, SamplingParams(max_new_tokens=max_new, beam_width=width, length_penalty=lp,
                                           early_stopping=es, stop_token_ids=[eos] if eos is not None else []),
                    (width, max_new, lp, es, eos)))
    return out


def check(outputs, model, requests):
    ended_early = 0
    for out, (prompt, _, (width, max_new, lp, es, eos)) in zip(outputs, requests):
        want = hf_beams(model, prompt, width, max_new, lp, es, eos)
        got = [(b["token_ids"], b["score"]) for b in out.beams]
        assert [g[0] for g in got] == [w[0] for w in want], (width, max_new, lp, es, eos)
        assert [g[1] for g in got] == pytest.approx([w[1] for w in want], abs=SCORE_ATOL)
        assert out.token_ids == want[0][0]
        ended_early += any(len(w[0]) < max_new for w in want)
    assert ended_early >= 5  # the stop token mattered


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints["llama"]


def test_beams_equal_transformers_beside_other_requests(llama):
    folder, model = llama
    prompts = prompt_set()
    requests = cases(prompts[:3], model)
    others = [(prompts[3], SamplingParams(max_new_tokens=7, ignore_eos=True)),
              (prompts[4], SamplingParams(max_new_tokens=7, temperature=0.9, seed=1))]
    llm = LLM(str(folder), max_num_seqs=64)
    outputs = llm.generate([p for p, _, _ in requests] + [p for p, _ in others],
                           [s for _, s, _ in requests] + [s for _, s in others])
    check(outputs[:len(requests)], model, requests)
    assert outputs[-2].token_ids == hf_greedy(model, prompts[3], 7)[0]
    assert len(outputs[-1].token_ids) == 7
    assert llm.engine.blocks.num_used_blocks == 0 and not llm.engine.has_work()


@pytest.mark.parametrize("runtime", [dict(block_size=4, max_num_batched_tokens=7),  # fewer tokens than beams
                                     dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=64)])
def test_beams_under_chunked_prefill_and_preemption(llama, runtime):
    folder, model = llama
    requests = cases(prompt_set()[:3], model)[::5]
    llm = LLM(str(folder), **runtime)
    outputs = llm.generate([p for p, _, _ in requests], [s for _, s, _ in requests])
    if "num_kv_blocks" in runtime:
        assert llm.engine.scheduler.num_preemptions > 0
    check(outputs, model, requests) if len(requests) > 8 else None
    for out, (prompt, _, (width, max_new, lp, es, eos)) in zip(outputs, requests):
        want = hf_beams(model, prompt, width, max_new, lp, es, eos)
        assert [b["token_ids"] for b in out.beams] == [w[0] for w in want]
    assert llm.engine.blocks.num_used_blocks == 0


def test_beams_share_blocks_and_copy_only_the_written_one(llama):
    """Four beams of a 33-token prompt in 16-token blocks: the two full prompt blocks stay shared by all."""
    folder, _ = llama
    llm = LLM(str(folder), block_size=16)
    engine = llm.engine
    request = engine.add_request(prompt_token_ids=prompt_set()[1],
                                 params=SamplingParams(max_new_tokens=6, beam_width=4))
    shared = []
    while engine.has_work():
        engine.step()
        group = engine.beam_search.groups.get(request.request_id)
        if group is not None and len(group.beams) == 4:
            firsts = {tuple(b.block_ids[:2]) for b in group.beams}
            shared.append(len(firsts) == 1 and engine.blocks.ref_counts[group.beams[0].block_ids[0]] >= 4)
    assert shared and all(shared)
    assert len(request.beam_hypotheses) == 4 and engine.blocks.num_used_blocks == 0
    # the run's summary counts the caller's one request, its four beams as sequences, and its first token's time
    first = engine.summary().splitlines()[:2]
    assert first[0].startswith("requests: 1 (4 sequences)") and "time to first token: n/a" not in first[1]
    assert len(engine.stats.time_to_first_token) == 1


@pytest.mark.parametrize("extra, message", [({"temperature": 0.5}, "temperature > 0"), ({"n": 2}, "n > 1"),
                                            ({"stop": ["x"]}, "stop strings"), ({"beam_width": 0}, "beam_width=0"),
                                            ({"early_stopping": "sometimes"}, "early_stopping='sometimes'")])
def test_bad_beam_settings_fail_alone(llama, extra, message):
    folder, _ = llama
    outs = LLM(str(folder)).generate([{"prompt_ids": [1, 2, 3], "beam_width": 2, **extra}, [4, 5, 6]],
                                     SamplingParams(max_new_tokens=3))
    assert outs[0].finish_reason == "error" and message in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3
