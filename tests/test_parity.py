"""Greedy tokens and logits against transformers, under every scheduling regime."""

from __future__ import annotations

import os
import platform

import pytest
import torch

from conftest import TINY_CONFIGS, ZOO_MODEL_OPTION, arrivals_beside_decodes, hf_greedy, prompt_set
from zoo import LLM, SamplingParams, hookimpl

MAX_NEW = 12
LOGIT_ATOL = 1e-4  # float32 on CPU: zoo's paged attention vs transformers' SDPA/eager
ON_CPU = os.environ["ZOO_DEVICE"] == "cpu"

# runtime settings per regime: (kwargs, what must have happened)
REGIMES = {
    "batched": dict(block_size=16, max_num_batched_tokens=512),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=7),
    "preemption": dict(block_size=4, num_kv_blocks=18, max_num_batched_tokens=64),
}


@pytest.fixture(scope="module")
def references(checkpoints):
    refs = {}
    for name, (_, model) in checkpoints.items():
        refs[name] = [hf_greedy(model, p, MAX_NEW) for p in prompt_set()]
    return refs


class LogitsRecorder:
    """Records the raw logits rows zoo samples from (no processors are active with greedy defaults)."""

    name = "logits_recorder"

    def __init__(self):
        self.rows = {}

    @hookimpl
    def zoo_logits_process(self, logits, requests):
        for row, request in zip(logits, requests):
            self.rows.setdefault(request.request_id, []).append(row.detach().cpu())


def run_zoo(folder, name, prompts, plugins=(), **runtime):
    llm = LLM(str(folder), model=ZOO_MODEL_OPTION[name], plugins=list(plugins), **runtime)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    return llm, llm.generate(prompts, params)


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_tokens_match_transformers(checkpoints, references, name, regime):
    prompts = prompt_set()
    recorder = LogitsRecorder()
    llm, outputs = run_zoo(checkpoints[name][0], name, prompts, plugins=[recorder], **REGIMES[regime])
    for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outputs, references[name])):
        assert out.error is None
        assert out.token_ids == ref_tokens, f"prompt {i}"
        zoo_logits = torch.stack(recorder.rows[i])
        torch.testing.assert_close(zoo_logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if regime == "chunked_prefill":
        assert llm.engine.stats.steps > sum(len(p) for p in prompts) // 7


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_prefix_cache_reuse_keeps_tokens(checkpoints, references, name):
    prompts = prompt_set()
    llm, first = run_zoo(checkpoints[name][0], name, prompts, block_size=4)
    hits_before = llm.engine.blocks.prefix_hit_tokens  # requests admitted in one step cannot share yet
    second = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    # every full block of every prompt (but the block holding the last token) comes from the cache
    assert llm.engine.blocks.prefix_hit_tokens - hits_before == sum((len(p) - 1) // 4 * 4 for p in prompts)
    for out_a, out_b, (ref_tokens, _) in zip(first, second, references[name]):
        assert out_a.token_ids == ref_tokens
        assert out_b.token_ids == ref_tokens


def test_logprobs_equal_log_softmax_of_transformers(checkpoints, references):
    folder, _ = checkpoints["llama"]
    llm = LLM(str(folder))
    prompts = prompt_set()[:3]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=3))
    for out, (ref_tokens, ref_logits) in zip(outputs, references["llama"]):
        ref = torch.log_softmax(ref_logits.float(), -1)
        assert len(out.logprobs) == MAX_NEW
        for step, entry in enumerate(out.logprobs):
            assert entry["token_id"] == ref_tokens[step]
            assert entry["logprob"] == pytest.approx(float(ref[step, ref_tokens[step]]), abs=1e-4)
            top_ids = [t for t, _ in entry["top"]]
            assert top_ids == torch.topk(ref[step], 3).indices.tolist()
            for token, value in entry["top"]:
                assert value == pytest.approx(float(ref[step, token]), abs=1e-4)


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
@pytest.mark.parametrize("without_mask", [True, False], ids=["own keys", "dense mask"])
def test_whole_prompt_steps_match_transformers_with_and_without_the_mask(checkpoints, references, name,
                                                                         without_mask):
    """Whole prompts in one step, ragged, and prompts split into chunks (only their first chunk can take the
    unmasked path): by causal SDPA over the step's own keys (the default), and with that path turned off, by
    SDPA over the gathered cache blocks with a dense mask (what drafts and windows keep)."""
    prompts = prompt_set()
    for runtime in (dict(max_num_batched_tokens=512), dict(block_size=4, max_num_batched_tokens=7)):
        llm = LLM(str(checkpoints[name][0]), model=ZOO_MODEL_OPTION[name], **runtime)
        assert llm.engine.runner.fresh_causal_path
        llm.engine.runner.fresh_causal_path = without_mask
        taken = []
        original = llm.engine.runner.attention_metadata
        llm.engine.runner.attention_metadata = lambda *a, **k: taken.append(k.get("fresh_causal")) or original(*a, **k)
        outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        # a window keeps the mask
        assert any(taken) == (without_mask and not llm.engine.description.sliding_window)
        for i, (out, (ref_tokens, _)) in enumerate(zip(outputs, references[name])):
            assert out.token_ids == ref_tokens, f"prompt {i}, {runtime}"


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("token_budget", [512, 24])  # 24: prompts split into chunks after cached tokens
@pytest.mark.parametrize("decode_kernel", [True, False], ids=["kernel", "sdpa"])
def test_steps_mixing_decodes_prompts_and_chunks_match_transformers(checkpoints, references, name, token_budget,
                                                                    decode_kernel):
    """A step that admits prompts while others decode, attended kind by kind (no mask over the whole step): the
    decode tokens by the decode kernel (the GPU's path, forced on here: it runs in Triton's interpreter) or by
    SDPA over each one's own blocks (CPU's), causal SDPA over each whole prompt's own keys, masked SDPA over
    each later chunk's own blocks. Requests arrive while others decode, so such steps occur."""
    if decode_kernel:
        pytest.importorskip("triton")
    prompts = prompt_set()
    llm = LLM(str(checkpoints[name][0]), model=ZOO_MODEL_OPTION[name], block_size=16,
              max_num_batched_tokens=token_budget)
    engine = llm.engine
    engine.runner.decode_kernel = decode_kernel
    metas = []
    original = engine.runner.attention_metadata
    engine.runner.attention_metadata = lambda *a, **k: metas.append(original(*a, **k)) or metas[-1]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    requests = arrivals_beside_decodes(engine, prompts, params)
    mixed = [m.split for m in metas if m.split is not None]
    assert sum(s.decode_rows is not None and s.prompt_rows is not None for s in mixed) >= 1
    assert all((s.decode_mask is None) == decode_kernel for s in mixed if s.decode_rows is not None)
    if token_budget < 33:
        assert sum(s.chunk_rows is not None for s in mixed) >= 2
    for i, (request, (ref_tokens, _)) in enumerate(zip(requests, references[name])):
        assert request.output_token_ids == ref_tokens, f"prompt {i}"


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size):
    """torch's varlen flash call, written out with SDPA per sequence: causal aligned to the last key."""
    assert window_size == (-1, 0)
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for i in range(len(cu_q) - 1):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        length, keys = qs.stop - qs.start, ks.stop - ks.start
        assert length <= max_q and keys <= max_k
        mask = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
        out[qs] = torch.nn.functional.scaled_dot_product_attention(
            q[qs].transpose(0, 1), k[ks].repeat_interleave(group, 1).transpose(0, 1),
            v[ks].repeat_interleave(group, 1).transpose(0, 1), attn_mask=mask, scale=scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_ragged_prompts_and_chunks_match_transformers(checkpoints, references, name, monkeypatch):
    """Mixed steps on CUDA attend whole prompts and chunks in one varlen flash call (zoo.model.RaggedCausal).
    Here the runner's layout of it (rows, key slots, cumulative lengths) is checked on CPU with the flash call
    written out per sequence; tests/test_gpu.py checks the real kernel against the same rule."""
    import zoo.model

    pytest.importorskip("triton")
    monkeypatch.setattr(zoo.model, "flash_varlen", lambda: (reference_varlen, dict(window_size=(-1, 0))))
    prompts = prompt_set()
    llm = LLM(str(checkpoints[name][0]), model=ZOO_MODEL_OPTION[name], block_size=16, max_num_batched_tokens=24)
    engine = llm.engine
    engine.runner.decode_kernel = engine.runner.fresh_causal_path = engine.runner.ragged_path = True
    splits = []
    original = engine.runner.attention_metadata

    def recorded(*args, **kwargs):
        meta = original(*args, **kwargs)
        splits.append(meta.split)
        return meta

    engine.runner.attention_metadata = recorded
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    requests = arrivals_beside_decodes(engine, prompts, params)
    ragged = [s.ragged for s in splits if s is not None and s.ragged is not None]
    assert any(len(r.cu_queries) > 2 for r in ragged)  # several sequences in one call
    assert any(int(r.cu_keys[-1]) > int(r.cu_queries[-1]) for r in ragged)  # chunks after cached tokens
    # steps of prompts alone take the step's rows as they are; steps with decodes among them gather theirs
    assert any(r.rows is None for r in ragged) and any(r.rows is not None for r in ragged)
    for i, (request, (ref_tokens, _)) in enumerate(zip(requests, references[name])):
        assert request.output_token_ids == ref_tokens, f"prompt {i}"


FAULTS_SCRIPT = """
import resource
from zoo import LLM, SamplingParams
llm = LLM(max_num_seqs=64)  # the setting's default
prompts = [f"def f{i}(x): return " + "x + " * (8 + i % 48) for i in range(64)]
params = SamplingParams(max_new_tokens=32, ignore_eos=True)
llm.generate(prompts, params)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
outs = llm.generate(prompts, params)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, sum(len(o.token_ids) for o in outs))
"""


@pytest.mark.skipif(not ON_CPU or platform.libc_ver()[0] != "glibc",
                    reason="runtime.cpu_keep_freed_memory: glibc's malloc, on CPU")
def test_kept_freed_memory_spares_the_steps_page_faults():
    """runtime.cpu_keep_freed_memory (on by default): after a warm-up, a run of 64 sequences' steps maps almost no
    new pages. With malloc's defaults the count depends on its history: 111k and 39 in two runs of this script, and
    110-190k in every run of bench/cpu_memory.py's larger workload. A process of its own: the setting is the
    process's."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FAULTS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    faults, tokens = map(int, done.stdout.split()[-2:])
    assert tokens == 64 * 32 and faults < 2000, (faults, tokens)


@pytest.mark.skipif(not ON_CPU, reason="runtime.cpu_keep_freed_memory is for CPU runs")
def test_the_engine_keeps_freed_memory_only_when_asked(checkpoints, monkeypatch):
    import zoo.engine
    from zoo.engine_setup import keep_freed_host_memory

    calls = []
    monkeypatch.setattr(zoo.engine, "keep_freed_host_memory", lambda: calls.append(1))
    folder = checkpoints["llama"][0]
    LLM(folder, model=ZOO_MODEL_OPTION["llama"], cpu_keep_freed_memory=False)
    assert calls == []
    LLM(folder, model=ZOO_MODEL_OPTION["llama"])
    assert calls == [1]
    if platform.libc_ver()[0] == "glibc":
        assert keep_freed_host_memory()  # mallopt took both settings
