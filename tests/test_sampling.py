"""Sampling: processors against transformers' own, seeds, stop rules, min/max tokens."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams, hookimpl
from zoo.request import Request
from zoo.sampler import Sampler


def _hf_warped_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    from transformers.generation.logits_process import (
        MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    scores = logits[None].clone()
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("settings", [
    dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=20, top_p=0.5), dict(temperature=0.9, min_p=0.1),
])
def test_filters_match_transformers_warpers(settings):
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        logits = torch.randn(100, generator=g) * 3
        ours = Sampler.filtered_probs_batch(logits[None], [SamplingParams(**settings)])[0]
        torch.testing.assert_close(ours, _hf_warped_probs(logits, **settings), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("peaked", [False, True])
def test_batched_filters_match_transformers_row_by_row(peaked):
    """One batch of rows with mixed settings, through the top-p shortcut and its full-sort fallback."""
    g = torch.Generator().manual_seed(int(peaked))
    settings = [dict(temperature=0.7), dict(temperature=1.0, top_k=5), dict(temperature=1.3, top_p=0.8),
                dict(temperature=1.0, top_k=20, top_p=0.5), dict(temperature=0.9, min_p=0.1),
                dict(temperature=1.1, top_p=0.95, min_p=0.02), dict(temperature=2.0, top_k=400, top_p=0.9)]
    params = [SamplingParams(**s) for s in settings]
    logits = torch.randn(len(params), 1000, generator=g) * 2
    if peaked:  # a few likely tokens, as trained models give: top-p is reached within the candidates
        logits[:, :5] += 12
    batched = Sampler.filtered_probs_batch(logits, params, candidates=64)
    for row, p in enumerate(params):
        expected = _hf_warped_probs(logits[row], p.temperature, p.top_k, p.top_p, p.min_p)
        torch.testing.assert_close(batched[row], expected, atol=1e-6, rtol=1e-5)


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    history = [3, 7, 7, 21, 49]
    request = Request(0, history, SamplingParams(repetition_penalty=1.3))

    import pluggy

    from zoo import hookspecs

    no_plugins = pluggy.PluginManager("zoo")
    no_plugins.add_hookspecs(hookspecs)
    sampler = Sampler(no_plugins.hook, None, 0, torch.device("cpu"), eos_token_ids=[])
    ours = sampler.process(logits[None], [request], [history])[0]
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([history]), logits[None].clone())[0]
    torch.testing.assert_close(ours, theirs)


@pytest.fixture(scope="module")
def llama_llm(checkpoints):
    return LLM(str(checkpoints["llama"][0]), max_num_seqs=8)


def test_seeded_sampling_independent_of_batch(llama_llm):
    prompts = prompt_set()
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llama_llm.generate([prompts[1]], params)[0].token_ids
    other = SamplingParams(max_new_tokens=7, temperature=1.2, seed=5, ignore_eos=True)
    for batch in ([prompts[0], prompts[1], prompts[2]], [prompts[4], prompts[3], prompts[1]]):
        per_request = [params if p is prompts[1] else other for p in batch]
        outs = llama_llm.generate(batch, per_request)
        assert outs[batch.index(prompts[1])].token_ids == alone
    # a different seed gives a different sample (with overwhelming probability over 10 tokens)
    assert llama_llm.generate([prompts[1]], SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9,
                                                           seed=43, ignore_eos=True))[0].token_ids != alone


def test_top_k_one_and_zero_temperature_are_greedy(llama_llm, checkpoints):
    prompt = prompt_set()[2]
    ref = hf_greedy(checkpoints["llama"][1], prompt, 8)[0]
    assert llama_llm.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].token_ids == ref
    sampled = llama_llm.generate([prompt], SamplingParams(max_new_tokens=8, temperature=2.0, top_k=1, seed=3,
                                                          ignore_eos=True))[0]
    assert sampled.token_ids == ref


def test_max_tokens_and_finish_reason(llama_llm):
    out = llama_llm.generate([prompt_set()[0]], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_checkpoint(checkpoints, tmp_path_factory):
    """The llama checkpoint with generation_config.json naming its first greedy token as EOS."""
    folder, model = checkpoints["llama"]
    prompt = prompt_set()[0]
    first = hf_greedy(model, prompt, 1)[0][0]
    copy = tmp_path_factory.mktemp("llama_eos")
    shutil.copytree(folder, copy, dirs_exist_ok=True)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    return copy, model, prompt, first


def test_eos_from_generation_config_stops(eos_checkpoint):
    folder, _, prompt, eos = eos_checkpoint
    out = LLM(str(folder)).generate([prompt], SamplingParams(max_new_tokens=10))[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop"


def test_min_new_tokens_matches_transformers(eos_checkpoint):
    folder, model, prompt, eos = eos_checkpoint
    out = LLM(str(folder)).generate([prompt], SamplingParams(max_new_tokens=10, min_new_tokens=4))[0]
    with torch.no_grad():
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, min_new_tokens=4,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == ref
    assert len(out.token_ids) >= 4 and eos not in out.token_ids[:4]


def test_stop_token_ids(llama_llm, checkpoints):
    prompt = prompt_set()[3]
    ref = hf_greedy(checkpoints["llama"][1], prompt, 10)[0]
    out = llama_llm.generate([prompt], SamplingParams(max_new_tokens=10, stop_token_ids=[ref[3]], ignore_eos=True))[0]
    assert out.token_ids == ref[:ref.index(ref[3]) + 1] and out.finish_reason == "stop"


def test_stop_strings_cut_the_text():
    llm = LLM()
    free = llm.generate(["def main():"], SamplingParams(max_new_tokens=24))[0]
    # Two characters past the start that do not occur earlier: the text must stop right before them.
    cut = next(i for i in range(4, len(free.text) - 1) if free.text.find(free.text[i:i + 2]) == i)
    stop = free.text[cut:cut + 2]
    out = llm.generate(["def main():"], SamplingParams(max_new_tokens=24, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    # Generation ended on the token that completed the stop string.
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert stop in llm.tokenizer.decode(out.token_ids) and stop not in llm.tokenizer.decode(out.token_ids[:-1])


def test_stream_yields_tokens_in_order():
    llm = LLM(model="gpt2")
    prompts = ["a", "bb", "ccc"]
    params = SamplingParams(max_new_tokens=6)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    seen = [[] for _ in prompts]
    texts = ["" for _ in prompts]
    finished = []
    for event in llm.stream(prompts, params):
        seen[event.index] += event.token_ids
        texts[event.index] += event.text
        if event.finished:
            finished.append(event.index)
            assert event.output.token_ids == seen[event.index]
            assert event.output.text == texts[event.index]
    assert seen == expected and sorted(finished) == [0, 1, 2]


def test_stream_events_carry_their_tokens_logprobs():
    """With logprobs asked for, each event carries its own tokens' entries, and they join to the output's (under
    EAGLE too, which commits several tokens a step); without, none."""
    for llm in (LLM(), LLM(overrides=["decoding=eagle"])):
        params = [SamplingParams(max_new_tokens=9, logprobs=2), SamplingParams(max_new_tokens=5)]
        joined, outputs = {0: [], 1: []}, {}
        for event in llm.stream(["def main():", "import os"], params):
            if event.index == 1:
                assert event.logprobs is None
                continue
            assert [e["token_id"] for e in event.logprobs or []] == event.token_ids
            joined[0] += event.logprobs or []
            if event.finished:
                outputs[0] = event.output
        assert len(joined[0]) == 9 and joined[0] == outputs[0].logprobs


class Force:
    """Forces the tokens of ``forced`` one after the other (a test plugin)."""

    name = "force"

    def __init__(self, forced):
        self.forced = forced

    @hookimpl
    def zoo_logits_process(self, logits, requests, histories):
        for row, request, history in zip(logits, requests, histories):
            token = self.forced[len(history) - len(request.prompt_token_ids)]
            keep = row[token].clone()
            row.fill_(float("-inf"))
            row[token] = keep


def test_stream_text_deltas_hold_back_incomplete_characters():
    """Byte tokenizer: "é" and "€" span several tokens; no delta shows half a character."""
    forced = list("éa€b".encode())
    llm = LLM(model="gpt2", plugins=[Force(forced)])
    params = SamplingParams(max_new_tokens=len(forced))
    pieces = [e.text for e in llm.stream(["x"], params)]
    assert pieces == ["", "é", "a", "", "", "€", "b"]


CORPUS = ["Ça va? Don't stop — naïve café, 3.14 ... l'été", "日本語のテスト 😀 emoji 🚀 and “quotes”",
          "def f(x):\n    return x ** 2  # squares", "The quick brown fox doesn't jump ; it's lazy ."] * 20


def tokenizer_of_kind(kind: str):
    """``(an object with decode(ids), vocabulary size)``: zoo's byte tokenizer, or a trained one of that family."""
    from types import SimpleNamespace

    from zoo.tokenizer import ByteTokenizer

    if kind == "bytes":
        return ByteTokenizer(), 256
    trained = trained_tokenizer(kind)
    return SimpleNamespace(decode=trained.decode), trained.get_vocab_size()


def trained_tokenizer(kind: str):
    """A small tokenizer of a common family, trained here (no download): byte-level BPE (GPT-2, Llama 3),
    Metaspace BPE (SentencePiece-style: a dropped leading space at a window's start), WordPiece (its decoder
    cleans up spaces before punctuation and joins ## pieces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "byte_level_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "metaspace_bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"])
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.BertPreTokenizer(), decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=400, special_tokens=["[UNK]"])
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.mark.parametrize("kind", ["bytes", "byte_level_bpe", "metaspace_bpe", "wordpiece"])
def test_text_deltas_decode_a_window_yet_equal_the_whole_decode(kind):
    """Random token streams (broken multi-byte characters included): after every token the text given so far
    is a prefix of the whole output's decode, and everything given equals it at the end."""
    import random
    from types import SimpleNamespace

    from zoo.llm import TextDeltas

    tokenizer, vocab = tokenizer_of_kind(kind)
    rng = random.Random(0)
    for trial in range(40):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        request = SimpleNamespace(request_id=trial, output_token_ids=[], params=SimpleNamespace(stop=[]))
        deltas, shown = TextDeltas(tokenizer), ""
        for token in ids:
            request.output_token_ids.append(token)
            shown += deltas.delta(request)
            assert tokenizer.decode(request.output_token_ids).startswith(shown)
        shown += deltas.delta(request, tokenizer.decode(ids))
        assert shown == tokenizer.decode(ids) and not deltas.state


@pytest.mark.parametrize("kind", ["bytes", "byte_level_bpe", "metaspace_bpe", "wordpiece"])
def test_stop_strings_found_in_a_window_as_in_the_whole_decode(kind):
    """The committer looks for stop strings in a window of the last tokens before it decodes the whole output:
    token by token, it finds the first stop string and cuts the text exactly where the whole decode does.
    The stops are pieces of each stream's own text (of 1 to 12 characters), so most streams hit one."""
    import random

    from zoo.commit import stop_string_cut

    tokenizer, vocab = tokenizer_of_kind(kind)
    rng = random.Random(1)
    hits = 0
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 120))]
        text = tokenizer.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 3)):
            start, size = rng.randrange(max(1, len(text))), rng.randint(1, 12)
            stops.append(text[start:start + size] or "zz")
        for n in range(1, len(ids) + 1):
            prefix = tokenizer.decode(ids[:n])
            found = [prefix.find(stop) for stop in stops if stop in prefix]
            expected = prefix[:min(found)] if found else None
            assert stop_string_cut(tokenizer, ids[:n], stops) == expected, (n, stops)
            if expected is not None:
                hits += 1
                break
    assert hits >= 40


def test_stream_never_shows_text_a_stop_string_cuts():
    llm = LLM(model="gpt2", plugins=[Force(list(b"xaby"))])
    params = SamplingParams(max_new_tokens=4, stop=["ab"])
    events = list(llm.stream(["q"], params))
    assert [e.text for e in events] == ["x", "", ""]
    assert events[-1].output.text == "x" and events[-1].finish_reason == "stop"


