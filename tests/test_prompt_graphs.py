"""Which steps a prompt graph takes, and how the runner pads them (zoo.cuda_graphs, runtime.prompt_graph_tokens).

Graphs need CUDA (tests/test_gpu.py replays them against eager prompts); the choice of step and the padding are
host work, checked here on CPU with the captured buckets set by hand and the step prepared but not run.
"""

from __future__ import annotations

import pytest

from zoo import LLM, SamplingParams
from zoo.cuda_graphs import PROMPT_FAMILY, PROMPT_GRAPH_SEQS


@pytest.fixture
def llm():
    llm = LLM()
    llm.engine.runner.graphs.prompt_sizes = [16, 32, 64]  # as if captured
    llm.engine.runner.fresh_causal_path = True  # as on CUDA
    return llm


def prepare(llm, prompts):
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt_token_ids=prompt, params=SamplingParams(max_new_tokens=2))
    return engine.runner.prepare(engine.scheduler.schedule({}))


def prompts_of(*lengths, start=1):
    return [[start + i + j for j in range(n)] for i, n in enumerate(lengths)]


def test_whole_prompts_take_the_next_bucket_padded_with_a_dummy_prompt(llm):
    runner = llm.engine.runner
    batch = prepare(llm, prompts_of(5, 20))
    assert batch.graph == (PROMPT_FAMILY, 32) and batch.num_tokens == 25
    buf, scratch_slot = runner.buffers, runner.kv.scratch_block * runner.block_size
    # the two prompts, then the padding as a sequence of its own, then empty ones
    assert runner.graphs.prompt_bounds.tolist() == [0, 5, 25] + [32] * (PROMPT_GRAPH_SEQS - 1)
    assert buf["input_ids"][25:32].tolist() == [0] * 7
    assert buf["slot_mapping"][25:32].tolist() == [scratch_slot] * 7
    assert buf["positions"][:, 25:32].eq(0).all()
    # the graph's logits rows: each prompt's last token, then row 0 for the rest
    assert buf["logits_indices"][:PROMPT_GRAPH_SEQS].tolist() == [4, 24] + [0] * (PROMPT_GRAPH_SEQS - 2)
    assert batch.logits_rows == [[0], [1]]


def test_a_step_that_fills_its_bucket_exactly_has_an_empty_padding_sequence(llm):
    batch = prepare(llm, prompts_of(16))
    assert batch.graph == (PROMPT_FAMILY, 16)
    assert llm.engine.runner.graphs.prompt_bounds.tolist() == [0] + [16] * (PROMPT_GRAPH_SEQS + 1)


@pytest.mark.parametrize("case", ["nine prompts", "past the largest bucket", "a plugin keeps it eager",
                                  "a variant holds", "decodes beside a prompt", "a cached prefix",
                                  "the whole-prompt path is off"])
def test_other_steps_run_eagerly(llm, case):
    graphs = llm.engine.runner.graphs
    prompts = prompts_of(3, 4)
    if case == "nine prompts":
        prompts = prompts_of(*[3] * (PROMPT_GRAPH_SEQS + 1))
    elif case == "past the largest bucket":
        prompts = prompts_of(65)
    elif case == "a plugin keeps it eager":
        graphs.eager_when.append(lambda scheduled: len(scheduled) == 2)
    elif case == "the whole-prompt path is off":
        llm.engine.runner.fresh_causal_path = False
    elif case == "a variant holds":
        graphs.variants["some_adapter"] = lambda scheduled: True
    elif case in ("decodes beside a prompt", "a cached prefix"):
        graphs.prompt_sizes = []  # the steps before run eagerly: nothing is captured on CPU
        shared = prompts_of(40)[0]
        llm.generate([shared], SamplingParams(max_new_tokens=1))  # its blocks stay cached
        engine = llm.engine
        if case == "decodes beside a prompt":
            engine.add_request(prompt_token_ids=prompts_of(6)[0], params=SamplingParams(max_new_tokens=8))
            engine.step()  # its prompt ...
            prompts = prompts_of(5, start=100)  # ... then this one joins its decode
        else:
            prompts = [shared[:32] + [7, 8, 9]]  # two cached blocks of 16, then three new tokens
        graphs.prompt_sizes = [16, 32, 64]
    batch = prepare(llm, prompts)
    assert batch.graph is None
    assert batch.attention is not None  # laid out for the eager pass
    if case == "a cached prefix":
        assert [e.start for e in batch.scheduled] == [32]
    if case == "decodes beside a prompt":
        assert [e.num_tokens for e in batch.scheduled] == [1, 5]


def test_no_buckets_without_the_varlen_call():
    """On CPU (no flash varlen call) nothing is captured, whatever the setting says."""
    llm = LLM(prompt_graph_tokens=2048)
    if llm.engine.device.type == "cuda":
        pytest.skip("a CPU engine's case")
    assert llm.engine.runner.graphs.prompt_buckets(2048) == []
    assert not llm.engine.uses_cuda_graphs


def test_buckets_follow_the_setting_and_the_token_budget(llm, monkeypatch):
    graphs = llm.engine.runner.graphs
    monkeypatch.setattr(llm.engine.runner, "ragged_path", True)
    monkeypatch.setattr(llm.engine.runner, "fresh_causal_path", True)
    budget = llm.engine.runner.limits.max_num_tokens
    expected = sorted({n for n in (16, 32, 64, 128, 256) if n < budget} | set(range(512, budget, 256)) | {budget})
    assert graphs.prompt_buckets(2048) == [n for n in expected if n <= min(2048, budget)]
    assert graphs.prompt_buckets(100) == [16, 32, 64, 100]
    assert graphs.prompt_buckets(0) == []
