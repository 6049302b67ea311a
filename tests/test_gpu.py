"""GPU-only: CUDA graphs and the Triton decode kernel give the tokens of the eager SDPA path.

Skipped on machines without CUDA (CI); run with ``ZOO_DEVICE=cuda python -m pytest tests/test_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy, prompt_set
from zoo import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_graphs_and_kernel_match_transformers_in_float32(checkpoints, name):
    folder, model = checkpoints[name]
    option = "gpt2" if name == "gpt2" else "llama"
    prompts = prompt_set()
    llm = LLM(str(folder), model=option, device="cuda", dtype="float32")
    assert llm.engine.uses_cuda_graphs and llm.engine.runner.decode_kernel
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(model, prompt, 12)[0]


def test_graphs_on_and_off_give_identical_tokens_in_bfloat16(checkpoints):
    folder, _ = checkpoints["llama"]
    prompts = prompt_set() * 3  # 18 requests: padded graph batch sizes
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    runs = {}
    for mode, kwargs in {"graphs": {}, "eager": {"enforce_eager": True}}.items():
        llm = LLM(str(folder), device="cuda", dtype="bfloat16", **kwargs)
        assert llm.engine.uses_cuda_graphs == (mode == "graphs")
        runs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    assert runs["graphs"] == runs["eager"]
