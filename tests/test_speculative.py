"""Several query tokens per request in one step, tree masks and KV rollback.

An oracle drafter (a test plugin registering the decoding method ``oracle``)
proposes draft blocks, right or wrong, from plain decoding's output; whatever
it proposes, greedy output must equal plain decoding, and verifying k tokens
in one step must give the logits of k single steps.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import StepRecorder, hf_greedy, prompt_set
from test_parity import LogitsRecorder
from zoo import LLM, DecodingMethod, DraftBlock, SamplingParams, hookimpl

MAX_NEW = 16
WRONG = 7  # token used for wrong guesses (replaced when it happens to be right)


def with_method(name: str, method: DecodingMethod):
    """A plugin registering ``method`` under ``name`` (pass ``decoding.name=NAME`` to choose it)."""

    class Registers:
        @hookimpl
        def zoo_decoding_methods(self):
            return {name: lambda engine: method}

    plugin = Registers()
    plugin.name = f"registers_{name}"
    return plugin


def llm_with(method: DecodingMethod, *args, plugins=(), **kwargs) -> LLM:
    return LLM(*args, plugins=[with_method(method.name, method), *plugins],
               overrides=[f"decoding.name={method.name}"], **kwargs)


class OracleDrafter(DecodingMethod):
    name = "oracle"

    def __init__(self, references: dict[tuple, list[int]], mode: str, k: int = 4, max_draft_tokens: int = 8):
        self.references, self.mode, self.k = references, mode, k
        self.max_draft_tokens = max_draft_tokens
        self.proposed = self.steps = 0

    def _wrong(self, right: int) -> int:
        return WRONG if right != WRONG else WRONG + 1

    def propose(self, requests):
        drafts = {}
        for request in requests:
            ref = self.references[tuple(request.prompt_token_ids)]
            draft = self.block(ref[len(request.output_token_ids):][:self.k])
            if draft is not None:
                drafts[request.request_id] = draft
                self.proposed += len(draft.tokens)
        self.steps += 1
        return drafts

    def block(self, future: list[int]) -> DraftBlock | None:
        """The draft block for a request whose next greedy tokens are ``future``."""
        if not future:
            return None
        if self.mode == "chain":  # all right
            return DraftBlock.chain(future)
        if self.mode == "wrong_tail":  # right, right, then wrong
            return DraftBlock.chain(future[:2] + [self._wrong(t) for t in future[2:]])
        if self.mode == "all_wrong":
            return DraftBlock.chain([self._wrong(t) for t in future])
        tokens, parents, parent = [], [], -1  # "tree": a wrong sibling before the right child at every level
        for right in future:
            tokens += [self._wrong(right), right]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return DraftBlock(tokens[:8], parents[:8])


@pytest.fixture(scope="module")
def llama(checkpoints):
    folder, model = checkpoints["llama"]
    prompts = prompt_set()
    references = {tuple(p): hf_greedy(model, p, MAX_NEW)[0] for p in prompts}
    return folder, prompts, references


@pytest.mark.parametrize("mode", ["chain", "wrong_tail", "all_wrong", "tree"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_drafts_never_change_greedy_tokens(llama, mode, block_size):
    folder, prompts, references = llama
    drafter = OracleDrafter(references, mode)
    llm = llm_with(drafter, str(folder), block_size=block_size)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == references[tuple(prompt)]
    assert drafter.proposed > 0
    plain_steps = 1 + MAX_NEW - 1  # one prefill step, then one token per step
    if mode in ("chain", "tree", "wrong_tail"):
        assert llm.engine.stats.steps < plain_steps  # drafts were accepted
    else:
        assert llm.engine.stats.steps == plain_steps


def test_verifying_k_tokens_equals_k_single_steps(llama):
    folder, prompts, references = llama
    plain_rec, spec_rec = LogitsRecorder(), LogitsRecorder()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    LLM(str(folder), plugins=[plain_rec]).generate(prompts, params)
    llm_with(OracleDrafter(references, "chain", k=5), str(folder), plugins=[spec_rec]).generate(prompts, params)
    for rid in plain_rec.rows:
        # the last verify step may also look at the row after the final token; compare the common rows
        torch.testing.assert_close(torch.stack(spec_rec.rows[rid][:MAX_NEW]), torch.stack(plain_rec.rows[rid]),
                                   atol=1e-5, rtol=0)


def test_rollback_frees_rejected_blocks(llama):
    folder, prompts, references = llama
    llm = llm_with(OracleDrafter(references, "all_wrong", k=8), str(folder), block_size=4)
    llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert llm.engine.blocks.num_used_blocks == 0  # nothing leaked by drafts
    assert all(r == 0 for r in llm.engine.blocks.ref_counts)


def test_too_many_draft_tokens_is_a_clear_error(llama):
    folder, prompts, references = llama
    llm = llm_with(OracleDrafter(references, "chain", k=8, max_draft_tokens=4), str(folder))
    with pytest.raises(Exception, match="'oracle' proposed 8 draft tokens; its max_draft_tokens is 4"):
        llm.generate(prompts[:1], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))


def exact_top_k_distribution(model, prompt: list[int], length: int, temperature: float, top_k: int) -> dict:
    """transformers' probability of every sequence of ``length`` tokens under temperature and top-k sampling."""

    def top_k_probs(ids):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1] / temperature
        values, idx = torch.topk(logits, top_k)
        return dict(zip(idx.tolist(), values.softmax(-1).tolist()))

    sequences = {(): 1.0}
    for _ in range(length):
        sequences = {seq + (t,): p * q for seq, p in sequences.items() for t, q in top_k_probs(prompt + list(seq)).items()}
    return sequences


def assert_three_sampled_tokens_follow_the_target(llm: LLM, model, prompt: list[int], n: int = 1200) -> None:
    """Chi-square of (token1, token2, token3) over ``n`` seeded requests (temperature 1.5, top-k 3) against
    transformers' exact probabilities: 26 degrees of freedom, P(chi2 > 54.05) = 0.001."""
    exact = exact_top_k_distribution(model, prompt, 3, 1.5, 3)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=1.5, top_k=3, seed=s) for s in range(n)]
    counts = {}
    for out in llm.generate([prompt] * n, params):
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    assert chi2 < 54.05, (chi2, counts, exact)


def test_sampling_with_drafts_keeps_target_distribution(checkpoints):
    """Chi-square of (token1, token2) under drafting against transformers' exact probabilities."""
    folder, model = checkpoints["llama"]
    prompt = prompt_set()[0]
    temperature, top_k, n = 1.5, 3, 900
    exact = exact_top_k_distribution(model, prompt, 2, temperature, top_k)
    greedy = hf_greedy(model, prompt, 3)[0]
    drafter = OracleDrafter({tuple(prompt): greedy}, "chain", k=2)
    llm = llm_with(drafter, str(folder), max_num_seqs=64, max_num_batched_tokens=1024)
    params = [SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=temperature, top_k=top_k, seed=s)
              for s in range(n)]
    outputs = llm.generate([prompt] * n, params)
    counts = {}
    for out in outputs:
        key = tuple(out.token_ids[:2])
        counts[key] = counts.get(key, 0) + 1
    assert set(counts) <= set(exact)
    chi2 = sum((counts.get(k, 0) - n * p) ** 2 / (n * p) for k, p in exact.items())
    # 8 degrees of freedom: P(chi2 > 26.1) = 0.001
    assert chi2 < 26.1, (chi2, counts, exact)
    assert drafter.proposed > 0 and math.isfinite(chi2)


def test_history_processors_see_accepted_drafts(llama):
    """Repetition penalty after accepted drafts must count them, exactly as plain decoding does."""
    folder, prompts, _ = llama
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=3.0)
    plain = LLM(str(folder)).generate(prompts, params)
    references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    drafter = OracleDrafter(references, "chain", k=6)
    drafted = llm_with(drafter, str(folder)).generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert drafter.proposed > 0


def test_draft_tree_depth_cut_keeps_structure():
    tree = DraftBlock([10, 11, 12, 13, 14], [-1, 0, -1, 1, 2])  # depths 1, 2, 1, 3, 2
    cut = tree.within(2)
    assert cut.tokens == [10, 11, 12, 14] and cut.parents == [-1, 0, -1, 2]
    assert tree.within(0) is None


class WideTree(OracleDrafter):
    """63 draft tokens: 59 wrong siblings at depth 1, then the right chain of 4 (as wide as a Medusa tree)."""

    name = "wide_tree"

    def block(self, future):
        if len(future) < 4:
            return None
        wrong = [t for t in range(VOCAB_WIDE) if t != future[0]][:59]
        return DraftBlock(wrong + future, [-1] * 59 + [-1, 59, 60, 61])

VOCAB_WIDE = 100


def test_a_draft_block_of_63_tokens(llama):
    folder, prompts, references = llama
    drafter = WideTree(references, "tree", k=4, max_draft_tokens=63)
    llm = llm_with(drafter, str(folder), block_size=16)
    assert llm.engine.runner.buffers["draft_visible"].shape[1] == 63  # sized from the method
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == references[tuple(prompt)]
    assert drafter.proposed > 0 and llm.engine.stats.steps < 1 + MAX_NEW - 1 + len(prompts)


def test_plain_decoding_allocates_no_draft_buffers():
    llm = LLM()
    assert llm.engine.decoding is None and llm.engine.runner.limits.max_draft_tokens == 0
    assert "draft_visible" not in llm.engine.runner.buffers


def test_decoding_names_are_checked():
    import zoo

    with pytest.raises(zoo.ZooError, match=r"decoding=nosuch: no plugin that takes part registers it \(methods: a, eagle, "
                                            r"lookahead, medusa;"):
        LLM(plugins=[with_method("a", OracleDrafter({}, "chain"))], overrides=["decoding.name=nosuch"])
    with pytest.raises(zoo.ZooError, match="both register decoding method 'a'"):
        second = with_method("a", OracleDrafter({}, "chain"))
        second.name = "also_registers_a"
        LLM(plugins=[with_method("a", OracleDrafter({}, "chain")), second])


class ProbabilisticDrafter(DecodingMethod):
    """Draws a chain of two tokens from its own distributions q (six candidates each) and hands q to the core."""

    name = "probabilistic"
    max_draft_tokens = 2

    def __init__(self, model):
        self.model, self.generator = model, torch.Generator().manual_seed(5)
        self.q_cache, self.proposed = {}, 0

    def q(self, history: tuple) -> torch.Tensor:
        if history not in self.q_cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([list(history)])).logits[0, -1]
            candidates = torch.topk(logits, 6).indices
            q = torch.zeros(logits.shape[0])
            q[candidates] = torch.rand(6, generator=torch.Generator().manual_seed(len(self.q_cache))) + 0.2
            self.q_cache[history] = q / q.sum()
        return self.q_cache[history]

    def propose(self, requests):
        drafts = {}
        for request in requests:
            history, tokens, probs = tuple(request.token_ids), [], []
            for _ in range(2):
                q = self.q(history)
                token = int(torch.multinomial(q, 1, generator=self.generator))
                tokens.append(token)
                probs.append(q)
                history += (token,)
            drafts[request.request_id] = DraftBlock.chain(tokens, probs=torch.stack(probs))
            self.proposed += 1
        return drafts


def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution(checkpoints):
    """Tokens 2 and 3 come from verifying a drafted chain with its draft distributions q."""
    folder, model = checkpoints["llama"]
    drafter = ProbabilisticDrafter(model)
    llm = llm_with(drafter, str(folder), max_num_seqs=64, max_num_batched_tokens=1024)
    assert_three_sampled_tokens_follow_the_target(llm, model, prompt_set()[0])
    assert drafter.proposed >= 1200 and llm.engine.stats.steps < 2 * 1200  # drafts were verified, not dropped


class LookaheadShaped(OracleDrafter):
    """Each block: a wrong guess, the right token seeing that wrong guess (not a tree), then the right chain."""

    name = "lookahead_shaped"

    def block(self, future):
        if len(future) < 2:
            return None
        block = DraftBlock([self._wrong(future[0]), future[0], future[0], future[1]], [-1, -1, -1, 2],
                           sees=[[0], [0, 1], [2], [2, 3]])
        assert block.children(-1) == [0, 2]  # token 1 sees a non-ancestor: never accepted
        return block

def test_tokens_that_see_beyond_their_ancestors_are_computed_but_never_accepted(llama):
    folder, prompts, references = llama
    drafter = LookaheadShaped(references, "chain", k=2, max_draft_tokens=4)
    llm = llm_with(drafter, str(folder))
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == references[tuple(prompt)]
    assert drafter.proposed > 0 and llm.engine.stats.steps < 1 + MAX_NEW - 1 + len(prompts)


class FailsOnThirdCall(OracleDrafter):
    name = "fails_on_third_call"

    calls = 0

    def propose(self, requests):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("draft head out of memory")
        return super().propose(requests)


def test_a_failing_draft_method_never_changes_a_token(llama, capfd):
    folder, prompts, references = llama
    drafter = FailsOnThirdCall(references, "chain")
    llm = llm_with(drafter, str(folder))
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [references[tuple(p)] for p in prompts]
    assert llm.engine.draft_failures == 1 and drafter.proposed > 0
    assert "decoding method 'fails_on_third_call' failed to propose drafts (RuntimeError: draft head out of " \
           "memory)" in capfd.readouterr().err


@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_drafting_stops_above_disable_by_batch_size(method):
    """vLLM's policy: with more decoding requests than the limit a step drafts nothing, and tokens stay exact."""
    prompts = ["def main():", "import os", "class A:", "x = ["]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = LLM().generate(prompts, params)
    for limit, drafts in ((3, False), (4, True)):
        llm = LLM(decoding=method, overrides=[f"decoding.disable_by_batch_size={limit}"])
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
        assert bool(llm.engine.stats.drafted_depth) == drafts


@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_draft_tokens_per_step_are_shared_by_the_decoding_requests(method):
    """With four requests decoding, a 12-token step budget leaves each at most 3 drafts; tokens stay exact."""
    prompts = ["def main():", "import os", "class A:", "x = ["]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = LLM().generate(prompts, params)
    sizes = StepRecorder(lambda batch: [len(e.draft.tokens) for e in batch.scheduled if e.draft is not None])
    llm = LLM(decoding=method, plugins=[sizes], overrides=["decoding.draft_tokens_per_step=12"])
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
    full = [step for step in sizes.steps if len(step) == 4]
    assert full and all(max(step) <= 3 for step in full), sizes.steps
    assert max(max(step) for step in sizes.steps if step) > 3  # fewer requests decoding: longer drafts
    assert sum(llm.engine.stats.accepted_depth) > 0


@pytest.mark.parametrize("key", ["disable_by_batch_size", "draft_tokens_per_step"])
def test_a_bad_draft_limit_is_one_line(tmp_path, key, forked):
    from test_medusa import assert_one_line_error

    assert_one_line_error(forked, "eagle", [f"decoding.{key}=-1"], f"decoding.{key}=-1 must be an integer >= 0 or null",
                          tmp_path)
