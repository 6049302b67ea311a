"""Shared fixtures: tiny random-init HF checkpoints written with save_pretrained.

transformers is the peer zoo is checked against; it is imported only here and
in tests, never by zoo itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zoo import hookimpl

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Parity is checked in float32; ZOO_DEVICE=cuda runs the same suite on a GPU.
os.environ.setdefault("ZOO_DEVICE", "cpu")
os.environ.setdefault("ZOO_DTYPE", "float32")
# On a GPU each engine's KV cache fills its gpu_memory_utilization share; tests keep many engines alive at once.
os.environ.setdefault("ZOO_GPU_MEMORY_UTILIZATION", "0.02")
# Under pytest-xdist (README's test command: two workers) each worker computes on one thread, so the two share
# the machine's cores instead of each spinning on both.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # and so do the processes the tests start (zoo.run, zoo.serve, zoo.train, the bench scripts): with two threads
    # each beside the other worker, their OpenMP threads waited on each other (a zoo.train round trip 17.6 against
    # 11.7 s, a stopped run's resume 23.2 against 14.1 s)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
if not torch.cuda.is_available():
    # The Triton kernels' tests run in Triton's interpreter on CPU; it must be chosen before triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The files that take longest, longest first (seconds in one run of the suite on 2 cores, 2026-12-06: 220, 97, 169,
# 69, 67, 67, 66, 55, 60; test_cli.py's and test_serve.py's bad-setting tests have since moved to the forked
# fixture, about 75 and 20 s less). Under `-n 2 --dist loadfile` the workers take whole files off one queue; xdist
# orders it by each file's count of tests, which put test_tensor_parallel.py (16 tests, 97 s) near the end, where
# one worker ran it alone while the other sat idle. Longest first, the two finish together.
LONGEST_FILES = ["test_serve.py", "test_tensor_parallel.py", "test_cli.py", "test_triton_attention.py",
                 "test_parity.py", "test_mixed_graphs.py", "test_fused_ops.py", "test_bench_smoke.py", "test_train.py"]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below, not its own
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


VOCAB = 300

TINY_CONFIGS = {
    # GQA (4 query heads over 2 KV heads) and llama3 RoPE scaling.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    # qkv bias, tied embeddings.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)),
    # sliding window shorter than the prompts, so the window matters.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=256, sliding_window=24)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
}
ZOO_MODEL_OPTION = {"llama": "llama", "qwen2": "llama", "mistral": "llama", "gpt2": "gpt2"}


def make_checkpoint(name: str, folder, eos_token_id=None, initializer_range=0.1):
    import transformers

    config_class, model_class, kwargs = TINY_CONFIGS[name]
    config = getattr(transformers, config_class)(
        vocab_size=VOCAB, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None,
        initializer_range=initializer_range, **kwargs)
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


@pytest.fixture(scope="module", autouse=True)
def free_the_gpu_after_each_module():
    """Under ZOO_DEVICE=cuda, hand a finished module's engines back to the device. Test workers share one card;
    with three workers on an 80 GB H100, one worker held 42 GiB (dead engines awaiting the cycle collector and the
    caching allocator's cached blocks) and the other workers' engines ran out of memory."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


class ForkedCommands:
    """``run("zoo.run", *args, cwd=...)``: ``python -m zoo.run ARGS`` as ``subprocess.run(..., capture_output=True,
    text=True)`` gives it (``returncode``, ``stdout``, ``stderr``), run in a fork of one process that imported zoo's
    commands once (``tests/command_zygote.py``) instead of a fresh interpreter: 0.1-0.5 s a run instead of 3. For the
    many tests of a command refusing a bad setting; a test of what a whole process does (start-up, signals, child
    processes, output as it runs) starts a real one."""

    def __init__(self, scratch):
        self.scratch = scratch
        self.process = None
        self.count = 0

    def run(self, module: str, *args: str, cwd, env: dict | None = None, timeout: float = 120):
        if self.process is None or self.process.poll() is not None:
            zygote = Path(__file__).with_name("command_zygote.py")
            self.process = subprocess.Popen([sys.executable, str(zygote)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, text=True)
        self.count += 1
        out, err = self.scratch / f"{self.count}.out", self.scratch / f"{self.count}.err"
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": dict(env or os.environ),
                   "stdout": str(out), "stderr": str(err), "timeout": timeout}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError("the command zygote (tests/command_zygote.py) died")
        return subprocess.CompletedProcess([sys.executable, "-m", module, *args], json.loads(reply)["returncode"],
                                           out.read_text(), err.read_text())

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def forked(tmp_path_factory):
    """:class:`ForkedCommands` of this test worker."""
    commands = ForkedCommands(tmp_path_factory.mktemp("forked_commands"))
    yield commands
    commands.close()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{name: (folder, transformers model)} for every tiny architecture."""
    out = {}
    for name in TINY_CONFIGS:
        folder = tmp_path_factory.mktemp(name)
        out[name] = (folder, make_checkpoint(name, folder))
    return out


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' greedy tokens and per-step logits for one prompt."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        # An explicit mask: generate would otherwise take every token equal to pad_token_id for padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    return tokens, torch.stack([l[0] for l in out.logits])


# Tests that start two tensor-parallel ranks: under ZOO_DEVICE=cuda each rank takes a GPU of its own (NCCL), so a
# one-GPU machine cannot run them (the engine's second rank fails to start: tests/test_serve.py on the H200).
TWO_RANKS = pytest.mark.skipif(os.environ["ZOO_DEVICE"] == "cuda" and torch.cuda.device_count() < 2,
                               reason="two tensor-parallel ranks on CUDA need two GPUs")


def prompt_set(seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, some sharing a 20-token prefix (for prefix caching)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (20,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 33, 11)]
    prompts += [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]
    return prompts


def arrivals_beside_decodes(engine, prompts, params) -> list:
    """Requests arriving in groups while the ones before decode (two steps apart), so that steps mix decodes with
    whole prompts and, after prompt_set's shared prefix, chunks; returns them in order once all are done."""
    requests = []
    for group in (prompts[:1], prompts[1:3], prompts[3:5], prompts[5:]):
        requests += [engine.add_request(prompt_token_ids=prompt, params=params) for prompt in group]
        engine.step()
        engine.step()
    engine.run_until_done()
    return requests


class StepRecorder:
    """A plugin that keeps ``see(batch)`` for every step the engine prepares."""

    name = "step_recorder"

    def __init__(self, see):
        self.see, self.steps = see, []

    @hookimpl
    def zoo_step_prepare(self, batch):
        self.steps.append(self.see(batch))


# ------------------------------------------------------------------ checkpoints several test files share
# Fixtures live here rather than imported from one test file into another (pytest's way to share them); the
# writers stay beside the references they are checked against.

@pytest.fixture(scope="module", params=["chatglm", "glm"])
def glm_checkpoint(request, tmp_path_factory):
    """(kind, folder, tensors) of a tiny ChatGLM-6B or GLM-10B checkpoint (tests/test_glm.py writes them)."""
    from test_glm import write_chatglm, write_glm

    folder = tmp_path_factory.mktemp(request.param)
    tensors = (write_chatglm if request.param == "chatglm" else write_glm)(folder)
    return request.param, folder, tensors


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory):
    """(folder, transformers model) of a random-init tiny Qwen2-VL (tests/test_qwen2_vl.py writes it)."""
    from test_qwen2_vl import write_qwen2_vl

    folder = tmp_path_factory.mktemp("qwen2_vl")
    return folder, write_qwen2_vl(folder)


@pytest.fixture(scope="module")
def eight_layer_llama(tmp_path_factory):
    """(folder, transformers model) of a random-init 8-layer Llama: EAGLE-3 reads three of its layers."""
    import transformers

    folder = tmp_path_factory.mktemp("llama8")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(8)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model
