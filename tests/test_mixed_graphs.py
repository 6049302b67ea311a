"""Steps that mix decodes with prompts or chunks replay graphs (zoo.cuda_graphs, runtime.mixed_graph_tokens).

CUDA graphs need a GPU (tests/test_gpu.py replays real ones). Here each capture is stood in for by a graph whose
replay runs the captured pass again over the same buffers and copies what it computes into the tensors the
capture returned, which is what a replay does to them; the decode kernel runs in Triton's interpreter. So the
choice of step, the padding and the graphs' fixed shapes (every row through the decode kernel, full-width block
tables, min(bucket, max_num_seqs) sequences, logits of those rows) are checked against transformers on CPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import ZOO_MODEL_OPTION, arrivals_beside_decodes, hf_greedy, prompt_set
from zoo import LLM, SamplingParams
from zoo.cuda_graphs import MIXED_FAMILY, PROMPT_FAMILY, token_buckets

pytest.importorskip("triton")  # conftest chose the interpreter on CPU

MAX_NEW = 8


class ReplayedOnCPU:
    """A stand-in for a captured graph: replay reruns the pass and writes into the captured outputs."""

    def __init__(self, body, context):
        self.body, self.context = body, context
        with torch.inference_mode():
            self.outputs = body(context)

    def replay(self):
        with torch.inference_mode():
            fresh = self.body(self.context)
        for old, new in zip(self.outputs, fresh):
            if isinstance(old, dict):
                for layer in old:
                    old[layer].copy_(new[layer])
            else:
                old.copy_(new)


def capture_on_cpu(body, context):
    graph = ReplayedOnCPU(body, context)
    return graph, graph.outputs


def engine_with_graphs(folder, option, monkeypatch, mixed_tokens=64, replays=True, **runtime):
    """An engine whose graphs are captured as on CUDA; ``replays`` False: for steps that are prepared, never
    run. max_model_len 64: the graphs' full-width block tables are then one split of the kernel (the
    interpreter runs every program)."""
    return llm_with_graphs(folder, option, monkeypatch, mixed_tokens, replays, **runtime).engine


def llm_with_graphs(folder, option, monkeypatch, mixed_tokens=64, replays=True, **runtime):
    llm = LLM(str(folder), model=option, block_size=16, **{"max_model_len": 64, **runtime})
    engine = llm.engine
    runner = engine.runner
    runner.decode_kernel = True  # as on CUDA (the interpreter runs it)
    monkeypatch.setattr(runner.graphs, "_capture", capture_on_cpu if replays else lambda body, context: (None, None))
    runner.graphs.capture(mixed_tokens=mixed_tokens)
    # An overlapped step's tokens stay in the graph's outputs until the next replay overwrites them; on CUDA they
    # are copied out first, in stream order, which nothing stands in for here.
    engine.overlap_steps = False
    return llm


# 24: prompts split into chunks after cached tokens
@pytest.mark.parametrize("name, token_budget", [("llama", 64), ("qwen2", 24)])
def test_mixed_steps_replayed_as_graphs_give_transformers_tokens(checkpoints, name, token_budget, monkeypatch):
    """Requests arrive while others decode, so steps carry decodes beside whole prompts (and, with the small
    budget, chunks after cached tokens); those replay mixed graphs, the decodes alone decode graphs."""
    folder, model = checkpoints[name]
    engine = engine_with_graphs(folder, ZOO_MODEL_OPTION[name], monkeypatch, mixed_tokens=token_budget,
                                max_num_batched_tokens=token_budget, max_num_seqs=8)
    graphs = engine.runner.graphs
    assert graphs.mixed_sizes == ([16, 24] if token_budget == 24 else [16, 32, 64])
    kinds = []
    original = engine.runner.prepare
    monkeypatch.setattr(engine.runner, "prepare",
                        lambda scheduled: kinds.append(sorted({e.num_tokens > 1 for e in scheduled}))
                        or original(scheduled))
    prompts = prompt_set()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    requests = arrivals_beside_decodes(engine, prompts, params)
    assert [False, True] in kinds  # steps with decodes and prompt tokens together
    assert graphs.replays.get(MIXED_FAMILY, 0) >= 3 and graphs.replays.get("decode", 0) >= 3
    for i, (request, prompt) in enumerate(zip(requests, prompts)):
        assert request.output_token_ids == hf_greedy(model, prompt, MAX_NEW)[0], f"prompt {i}"
    assert engine.blocks.num_used_blocks == 0


def prepare(engine, prompts, params=None):
    for prompt in prompts:
        engine.add_request(prompt_token_ids=prompt, params=params or SamplingParams(max_new_tokens=4))
    return engine.runner.prepare(engine.scheduler.schedule({}))


def test_a_mixed_step_pads_its_rows_to_the_bucket_and_its_logits_to_its_sequences(checkpoints, monkeypatch):
    engine = engine_with_graphs(checkpoints["llama"][0], "llama", monkeypatch, mixed_tokens=32,
                                max_num_batched_tokens=32, max_num_seqs=4)
    runner, buf = engine.runner, engine.runner.buffers
    keys = []
    original = runner.prepare
    monkeypatch.setattr(runner, "prepare", lambda scheduled: keys.append(original(scheduled).graph) or
                        original(scheduled))
    engine.add_request(prompt_token_ids=list(range(1, 6)), params=SamplingParams(max_new_tokens=4))
    engine.step()
    monkeypatch.setattr(runner, "prepare", original)
    assert keys == [(MIXED_FAMILY, 16)]  # one prompt alone: without prompt graphs (CPU) a mixed graph takes it
    batch = prepare(engine, [list(range(10, 30))])  # the first request's decode beside a 20-token prompt
    assert batch.graph == (MIXED_FAMILY, 32) and batch.num_tokens == 21
    scratch_slot = runner.kv.scratch_block * runner.block_size
    assert buf["input_ids"][21:32].tolist() == [0] * 11
    assert buf["slot_mapping"][21:32].tolist() == [scratch_slot] * 11
    assert buf["token_seq"][21:32].tolist() == [0] * 11 and buf["token_cache_index"][21:32].tolist() == [0] * 11
    # a graph of 32 rows holds min(32, max_num_seqs) = 4 sequences: the step's two logits rows, then row 0
    assert buf["logits_indices"][:4].tolist() == [0, 20, 0, 0]
    assert batch.logits_rows == [[0], [1]]
    tokens = runner.run(batch).logits.argmax(-1)
    assert tokens.shape == (2,)


@pytest.mark.parametrize("case", ["past the largest bucket", "more logits rows than sequences",
                                  "a plugin keeps it eager", "a variant holds", "no mixed graphs captured"])
def test_other_steps_run_eagerly(checkpoints, monkeypatch, case):
    engine = engine_with_graphs(checkpoints["llama"][0], "llama", monkeypatch, mixed_tokens=32, replays=False,
                                max_num_batched_tokens=64, max_num_seqs=4)
    graphs = engine.runner.graphs
    prompts, params = [list(range(1, 12)), list(range(20, 30))], None
    if case == "past the largest bucket":
        prompts = [list(range(1, 40))]
    elif case == "more logits rows than sequences":  # prompt log-probs: a logits row per prompt token
        params = SamplingParams(max_new_tokens=2, prompt_logprobs=0)
    elif case == "a plugin keeps it eager":
        graphs.eager_when.append(lambda scheduled: True)
    elif case == "a variant holds":
        graphs.variants["adapter"] = lambda scheduled: True
    else:
        graphs.mixed_sizes = []
    batch = prepare(engine, prompts, params)
    assert batch.graph is None and batch.attention is not None


def test_glm_bidirectional_prefixes_and_drafts_stay_eager(checkpoints, monkeypatch):
    """The decode kernel attends causally by cache index: a step whose layout is not splittable (a draft block,
    a bidirectional prefix) never takes a mixed graph."""
    engine = engine_with_graphs(checkpoints["llama"][0], "llama", monkeypatch, replays=False,
                                max_num_batched_tokens=64, max_num_seqs=4)
    request = engine.add_request(prompt_token_ids=list(range(1, 10)), params=SamplingParams(max_new_tokens=3))
    request.bidirectional_prefix = 4
    batch = engine.runner.prepare(engine.scheduler.schedule({}))
    assert batch.graph is None


def test_mixed_buckets_follow_the_setting_the_token_budget_and_the_decode_kernel(checkpoints):
    llm = LLM(str(checkpoints["llama"][0]), max_num_batched_tokens=300, device="cpu")
    graphs = llm.engine.runner.graphs
    assert graphs.mixed_buckets(512) == []  # no decode kernel on CPU
    llm.engine.runner.decode_kernel = True
    assert graphs.mixed_buckets(512) == [16, 32, 64, 128, 256, 300] == token_buckets(300)
    assert graphs.mixed_buckets(100) == [16, 32, 64, 100]
    assert graphs.mixed_buckets(0) == []
    assert token_buckets(1300) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1300]
    assert PROMPT_FAMILY != MIXED_FAMILY


def test_mrope_positions_replay_mixed_graphs_and_image_prompts_stay_eager(qwen2_vl, tmp_path, monkeypatch):  # noqa: F811
    """Qwen2-VL: three rows of positions (mRoPE) in the graphs' buffers; a step computing an image prompt's
    tokens runs eagerly (its features are spliced into the embeddings from the step's requests). Requests arrive
    while others decode, their prompts cut into chunks; transformers' tokens for text and image requests."""
    from test_qwen2_vl import requests_and_references

    folder, _ = qwen2_vl
    requests, references = requests_and_references(qwen2_vl, tmp_path, n=6)
    llm = llm_with_graphs(folder, "qwen2_vl", monkeypatch, max_num_batched_tokens=16, max_num_seqs=8,
                          max_model_len=128)
    runner = llm.engine.runner
    keys = []
    original = runner.prepare

    def recorded(scheduled):
        batch = original(scheduled)
        images = any("images" in e.request.extras and e.start < len(e.request.prompt_token_ids) for e in scheduled)
        keys.append((images, batch.graph))
        return batch

    monkeypatch.setattr(runner, "prepare", recorded)
    params, added = SamplingParams(max_new_tokens=6, ignore_eos=True), []
    for group in ([0], [1, 2], [3, 4]):  # each arrives while the ones before decode
        added += [llm._add(requests[i], params, i) for i in group]
        llm.engine.step()
        llm.engine.step()
    llm.engine.run_until_done()
    for i, (request, (ref_tokens, _)) in enumerate(zip(added, references)):
        assert request.output_token_ids == ref_tokens, f"request {i}"
    assert all(graph is None for images, graph in keys if images)
    assert sum(graph is not None and graph[0] == MIXED_FAMILY for images, graph in keys if not images) >= 2
