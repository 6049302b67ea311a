"""Token-level rules: bad words (transformers' ``bad_words_ids``) and stop token sequences."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams

MAX_NEW = 10


def hf_greedy_banned(model, prompt, bad_words_ids):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             bad_words_ids=bad_words_ids, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_bad_words_give_transformers_tokens(checkpoints):
    folder, model = checkpoints["llama"]
    prompts = prompt_set()[:4]
    plain = [hf_greedy(model, p, MAX_NEW)[0] for p in prompts]
    # ban: each prompt's third greedy token outright, and a two-token sequence taken from another's path
    bans = [[[plain[0][2]]], [[plain[1][1], plain[1][2]]], [[plain[2][0]], [plain[2][3], plain[2][4]]],
            [[prompts[3][-1], plain[3][0]]]]  # the rest of it is the prompt's last token
    llm = LLM(str(folder), block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(prompts, [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, bad_words_ids=b)
                                  for b in bans])
    for prompt, ban, out, base in zip(prompts, bans, outs, plain):
        expected = hf_greedy_banned(model, prompt, ban)
        assert out.token_ids == expected
        assert expected != base  # the ban changed the path
    for seq in bans[0]:
        assert seq[0] not in outs[0].token_ids


def test_stop_token_sequences_end_the_request_with_the_sequence(checkpoints):
    folder, model = checkpoints["llama"]
    prompt = prompt_set()[1]
    path = hf_greedy(model, prompt, MAX_NEW)[0]
    llm = LLM(str(folder))
    stops = [[path[4], path[5]], [path[7]]]
    never = [[path[4], path[6]]]  # not consecutive on the path: no stop
    outs = llm.generate([prompt, prompt], [SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                          stop_token_sequences=stops),
                                           SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                          stop_token_sequences=never)])
    first = min(i for i in range(MAX_NEW) if any(path[max(0, i + 1 - len(s)):i + 1] == s for s in stops))
    assert outs[0].token_ids == path[:first + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == path and outs[1].finish_reason == "length"


@pytest.mark.parametrize("field, value", [("bad_words_ids", [[]]), ("bad_words_ids", [1, 2]),
                                          ("stop_token_sequences", [["a"]]), ("bad_words_ids", [[99999]])])
def test_bad_rules_fail_alone(checkpoints, field, value):
    folder, _ = checkpoints["llama"]
    outs = LLM(str(folder)).generate([{"prompt_ids": [1, 2, 3], field: value}, [4, 5, 6]],
                                     SamplingParams(max_new_tokens=3))
    assert outs[0].finish_reason == "error" and field in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3


def test_presence_and_frequency_penalties_follow_openai_definition(checkpoints):
    """Greedy under the penalties against transformers' logits with the definition applied by hand: each token
    already generated loses presence_penalty once and frequency_penalty per occurrence."""
    folder, model = checkpoints["llama"]
    prompt = prompt_set()[1]
    presence, frequency = 0.7, 0.9
    tokens = list(prompt)
    for _ in range(MAX_NEW):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].double()
        generated = tokens[len(prompt):]
        for token in set(generated):
            logits[token] -= presence + frequency * generated.count(token)
        tokens.append(int(logits.argmax()))
    out = LLM(str(folder)).generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                             presence_penalty=presence,
                                                             frequency_penalty=frequency))[0]
    assert out.token_ids == tokens[len(prompt):]
    assert out.token_ids != hf_greedy(model, prompt, MAX_NEW)[0]  # the penalties changed the path


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_a_penalty_outside_openai_range_fails_alone(checkpoints, field):
    folder, _ = checkpoints["llama"]
    outs = LLM(str(folder)).generate([{"prompt_ids": [1, 2, 3], field: 2.5}, [4, 5, 6]],
                                     SamplingParams(max_new_tokens=3))
    assert outs[0].finish_reason == "error" and f"{field}=2.5 must be a number in [-2, 2]" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 3
