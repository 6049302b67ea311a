"""decoding=lookahead: exact greedy tokens in every scheduling regime, with position plugins, bad settings."""

from __future__ import annotations


import pytest

from conftest import prompt_set
from test_glm import glm_prompts
from test_medusa import REGIMES, assert_one_line_error, mixed_prompts
from test_speculative import assert_three_sampled_tokens_follow_the_target
from test_qwen2_vl import requests_and_references
from zoo import LLM, SamplingParams

MAX_NEW = 24


def repetitive_prompts() -> list[list[int]]:
    """Prompts whose tokens repeat, so the prompt-seeded pool and the window find accepted n-grams."""
    return [p[:6] * 4 for p in prompt_set()[1:]] + mixed_prompts()[:3]


@pytest.mark.parametrize("regime", list(REGIMES))
def test_lookahead_gives_the_tokens_of_plain_decoding(checkpoints, regime):
    folder, _ = checkpoints["llama"]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = repetitive_prompts()
    plain = LLM(str(folder), **REGIMES[regime]).generate(prompts, params)
    llm = LLM(str(folder), decoding="lookahead", **REGIMES[regime])
    assert llm.engine.decoding.max_draft_tokens == (7 + 7) * 4
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert llm.engine.draft_failures == 0
    assert llm.engine.stats.drafted_depth  # drafts were verified
    if regime != "chunked_prefill":  # a 12-token budget keeps 8 tokens for 8 decoding requests: 4 draft tokens
        assert sum(o.num_steps for o in outputs) < sum(len(o.token_ids) for o in outputs)  # drafts were accepted
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("window, ngram, candidates", [(1, 2, 0), (3, 3, 2), (4, 6, 10)])
def test_window_shapes_stay_exact(checkpoints, window, ngram, candidates):
    folder, _ = checkpoints["llama"]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = repetitive_prompts()
    plain = LLM(str(folder)).generate(prompts, params)
    llm = LLM(str(folder), decoding="lookahead", overrides=[f"decoding.window={window}", f"decoding.ngram={ngram}",
                                                             f"decoding.candidates={candidates}"])
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]


def test_lookahead_with_glm_positions(glm_checkpoint):
    kind, folder, _ = glm_checkpoint
    prompts = glm_prompts()
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    plain = LLM(str(folder), model=kind).generate(prompts, params)
    outputs = LLM(str(folder), model=kind, decoding="lookahead").generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]


def test_lookahead_with_mrope_positions(qwen2_vl, tmp_path):
    requests, references = requests_and_references(qwen2_vl, tmp_path)
    outputs = LLM(str(qwen2_vl[0]), model="qwen2_vl", decoding="lookahead").generate(
        requests, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in references]


@pytest.mark.parametrize("overrides, message", [
    (["decoding.window=0"], "decoding.window=0 must be an integer in [1, 64]"),
    (["decoding.ngram=1"], "decoding.ngram=1 must be an integer in [2, 16]"),
    (["decoding.candidates=-1"], "decoding.candidates=-1 must be an integer in [0, 64]"),
    (["decoding.window=64", "decoding.ngram=16", "decoding.candidates=10"],
     "(window + candidates) * (ngram - 1) = 1110 draft tokens per step; at most 1024"),
])
def test_bad_lookahead_settings_are_one_line(tmp_path, overrides, message, forked):
    assert_one_line_error(forked, "lookahead", overrides, message, tmp_path)


def test_lookahead_under_sampling_keeps_the_target_distribution(checkpoints):
    folder, model = checkpoints["llama"]
    llm = LLM(str(folder), decoding="lookahead", overrides=["decoding.window=3", "decoding.ngram=3",
                                                             "decoding.disable_by_batch_size=null"],
              max_num_seqs=64, max_num_batched_tokens=1024)
    assert_three_sampled_tokens_follow_the_target(llm, model, prompt_set()[0])
    assert llm.engine.stats.accepted_depth and llm.engine.stats.accepted_depth[0] > 0