"""Tensor parallelism (runtime.tensor_parallel_size) on CPU: two processes over gloo, as torchrun starts them.

Each rank reads only its slices of the checkpoint; the greedy tokens and log-probs at two ranks equal those of
one process and of transformers.
"""

from __future__ import annotations

import os
import socket
from collections import Counter

import pytest
import torch
import torch.multiprocessing as mp

from conftest import TWO_RANKS, ZOO_MODEL_OPTION, hf_greedy, prompt_set
from zoo import LLM, SamplingParams
from zoo.errors import ZooError
from zoo.parallel import end_rank

MAX_NEW = 8
LOGPROB_ATOL = 1e-4  # float32: the all-reduce adds the ranks' partial sums in another order than one product


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, folder, option, prompts, out_dir, adapters=None, decoding=None, overrides=()):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    result = {}
    try:
        llm = LLM(folder, model=option, tensor_parallel_size=world, **({"adapters": adapters} if adapters else {}),
                  **({"decoding": decoding} if decoding else {}), overrides=list(overrides))
        scheduler, calls = llm.engine.scheduler, Counter()
        for name in ("schedule", "replay"):  # who decides the steps: counted per rank
            def counted(*a, _method=getattr(scheduler, name), _name=name, **k):
                calls[_name] += 1
                return _method(*a, **k)
            setattr(scheduler, name, counted)
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
        result = {"tokens": [o.token_ids for o in outs], "logprobs": [[e["logprob"] for e in o.logprobs] for o in outs],
                  "bytes": llm.engine.model.loaded_bytes, "kv_heads": llm.engine.runner.kv.description.num_kv_heads,
                  "calls": dict(calls)}
    except ZooError as exc:
        result = {"error": str(exc)}
    except Exception:  # noqa: BLE001 - anything else: its traceback, for the test's message
        import traceback

        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank(0)  # multiprocessing's children skip exit handlers


def run_ranks(folder, option, prompts, tmp_path, world=2, adapters=None, decoding=None, overrides=()):
    mp.spawn(_rank, args=(world, free_port(), str(folder), option, prompts, str(tmp_path), adapters, decoding,
                          tuple(overrides)), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def checkpoint_bytes(folder) -> int:
    from safetensors import safe_open

    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():
                t = reader.get_tensor(name)
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "gpt2"])
@TWO_RANKS
def test_two_ranks_give_the_tokens_of_one_process(checkpoints, name, tmp_path):
    """llama: GQA; qwen2: q/k/v biases and tied embeddings; mistral: one KV head, kept whole on both ranks;
    gpt2: converted while loading (fused q/k/v, Conv1D), learned positions, LayerNorm, row-parallel biases."""
    folder, model = checkpoints[name]
    prompts = prompt_set()[:4]
    ranks = run_ranks(folder, ZOO_MODEL_OPTION[name], prompts, tmp_path)
    single = LLM(str(folder), model=ZOO_MODEL_OPTION[name]).generate(
        prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["tokens"] == [o.token_ids for o in single]
        assert rank["tokens"] == [hf_greedy(model, p, MAX_NEW)[0] for p in prompts]
        for got, expected in zip(rank["logprobs"], single):
            assert torch.allclose(torch.tensor(got), torch.tensor([e["logprob"] for e in expected.logprobs]),
                                  atol=LOGPROB_ATOL, rtol=0)
        # each rank read its slices: about half of the checkpoint (norms are read whole); a converted
        # checkpoint is read whole, then cut
        assert rank["bytes"] < (1.01 if name == "gpt2" else 0.6) * checkpoint_bytes(folder)
    # rank 0 schedules every step; rank 1 only replays its decisions
    assert ranks[0]["calls"].get("schedule", 0) > 0 and "replay" not in ranks[0]["calls"]
    assert ranks[1]["calls"].get("replay", 0) == ranks[0]["calls"]["schedule"] and "schedule" not in ranks[1]["calls"]
    kv_heads = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    assert ranks[0]["kv_heads"] == max(1, kv_heads // 2)


def test_tensor_parallel_without_a_launcher_says_how_to_launch(checkpoints, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ZooError, match="torchrun --nproc-per-node 2"):
        LLM(str(checkpoints["llama"][0]), tensor_parallel_size=2)


def _rank_that_dies(rank, world, port, folder, option, prompts, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    llm = LLM(folder, model=option, tensor_parallel_size=world)
    if rank == 1:
        os._exit(9)  # a worker killed mid-run
    import time

    start = time.perf_counter()
    try:
        llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        result = {"error": None}
    except ZooError as exc:
        result = {"error": str(exc)}
    result["seconds"] = time.perf_counter() - start
    torch.save(result, os.path.join(out_dir, "rank0.pt"))
    end_rank(0)  # multiprocessing's children skip exit handlers


@TWO_RANKS
def test_a_killed_rank_ends_the_others_with_one_clear_error(checkpoints, tmp_path):
    folder, _ = checkpoints["llama"]
    context = mp.start_processes(_rank_that_dies, args=(2, free_port(), str(folder), "llama", prompt_set()[:2],
                                                        str(tmp_path)), nprocs=2, join=False)
    for process in context.processes:
        process.join(120)
    result = torch.load(tmp_path / "rank0.pt")
    assert result["error"] and "another rank has stopped or failed" in result["error"], result
    assert result["seconds"] < 60


@TWO_RANKS
def test_the_command_line_starts_its_ranks_itself(checkpoints, tmp_path):
    """``python -m zoo.run runtime.tensor_parallel_size=2`` runs itself under torchrun; rank 0 writes the records.
    The two-rank run reads its requests from a pipe (``input.file=/dev/stdin``), which only one process can read:
    rank 0 reads the input and hands it to rank 1."""
    import json
    import subprocess
    import sys

    folder, _ = checkpoints["llama"]
    prompts = prompt_set()[:3]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    outputs = {}
    for size in (1, 2):
        out = tmp_path / f"out{size}.jsonl"
        source = tmp_path / "in.jsonl" if size == 1 else "/dev/stdin"
        done = subprocess.run([sys.executable, "-m", "zoo.run", f"model.path={folder}", f"input.file={source}",
                               f"output.file={out}", "output.format=jsonl", "sampling.max_new_tokens=6",
                               "sampling.ignore_eos=true", f"runtime.tensor_parallel_size={size}"],
                              input=(tmp_path / "in.jsonl").read_text(), capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs[size] = [json.loads(line)["token_ids"] for line in out.read_text().splitlines()]
        if size == 2:
            assert "starting 2 tensor-parallel ranks" in done.stderr
    assert outputs[2] == outputs[1] and len(outputs[1]) == 3


@TWO_RANKS
def test_eagle3_on_two_ranks_gives_the_tokens_of_plain_decoding(eight_layer_llama, tmp_path):
    """EAGLE-3: three target layers' features, q/k/v over doubled inputs, its own head kept whole."""
    folder, model = eight_layer_llama
    prompts = prompt_set()[:3]
    ranks = run_ranks(folder, "llama", prompts, tmp_path, decoding="eagle", overrides=["decoding.version=3"])
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["tokens"] == [hf_greedy(model, p, MAX_NEW)[0] for p in prompts]


@pytest.mark.parametrize("method", ["lookahead", "medusa", "eagle"])
@TWO_RANKS
def test_drafting_on_two_ranks_gives_the_tokens_of_plain_decoding(checkpoints, tmp_path, method):
    """Verify steps with draft trees under the split: every rank proposes the same drafts (lookahead's n-grams;
    Medusa's fresh heads, started from the LM head gathered from both ranks, run whole on each; EAGLE's draft
    layer split as the target's layers are, its KV heads in each rank's cache)."""
    folder, model = checkpoints["llama"]
    prompts = [p * 3 for p in prompt_set()[:3]]  # repetitive: lookahead finds n-grams to propose
    ranks = run_ranks(folder, "llama", prompts, tmp_path, decoding=method)
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["tokens"] == [hf_greedy(model, p, MAX_NEW)[0] for p in prompts]


@TWO_RANKS
def test_a_lora_and_a_prompt_tuning_batch_on_two_ranks(tmp_path):
    """LoRA's A and B cut like the layer they change (B by rows for q/k/v and gate/up, A by columns for o and
    down); prompt tuning's virtual rows written after the vocabulary-parallel embedding. Against one process,
    whose adapters the adapter tests check against peft."""
    from test_adapters import ALL_PROJECTIONS, make_checkpoint, save_lora, save_prompt_tuning

    base = make_checkpoint("llama", tmp_path / "llama")
    save_lora(base, tmp_path / "lora", 8, ALL_PROJECTIONS["llama"], seed=2)
    save_prompt_tuning(base, tmp_path / "prompt", 5, seed=3)
    adapters = {"lora": str(tmp_path / "lora"), "prompt": str(tmp_path / "prompt")}
    prompts = [{"prompt_ids": p, "adapter": a} for p, a in zip(prompt_set()[:4], ["lora", None, "prompt", "lora"])]
    prompts.append({"prompt_ids": prompt_set()[0]})  # request 0 without its adapter: the LoRA must show
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    ranks = run_ranks(tmp_path / "llama", "llama", prompts, out_dir, adapters=adapters)
    single = LLM(str(tmp_path / "llama"), adapters=adapters).generate(
        prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    assert single[0].logprobs != single[4].logprobs
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["tokens"] == [o.token_ids for o in single]
        assert rank["logprobs"][0] != rank["logprobs"][4]
        for i, (got, expected) in enumerate(zip(rank["logprobs"], single)):
            assert torch.allclose(torch.tensor(got), torch.tensor([e["logprob"] for e in expected.logprobs]),
                                  atol=LOGPROB_ATOL, rtol=0), f"request {i}"


@TWO_RANKS
def test_qwen2_vl_images_on_two_ranks(qwen2_vl, tmp_path):
    """mRoPE's three position rows and image rows written into the embeddings; the vision tower runs whole on
    every rank (no split rule names it)."""
    from test_qwen2_vl import requests_and_references

    folder, _ = qwen2_vl
    requests, references = requests_and_references(qwen2_vl, tmp_path, n=MAX_NEW)
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    ranks = run_ranks(folder, "qwen2_vl", requests, out_dir)
    for rank in ranks:
        assert "error" not in rank, rank.get("error")
        assert rank["tokens"] == [tokens for tokens, _ in references]


def _ranks_given_different_requests(rank, world, port, folder, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    llm = LLM(folder, tensor_parallel_size=world)
    prompts = prompt_set()[:2] if rank == 0 else prompt_set()[:3]  # rank 1 was given one request more
    try:
        llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        result = {"error": None}
    except ZooError as exc:
        result = {"error": str(exc)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    end_rank(0)  # multiprocessing's children skip exit handlers


@TWO_RANKS
def test_ranks_given_different_requests_stop_with_a_clear_error(checkpoints, tmp_path):
    """Rank 0 schedules; the fingerprints gathered with its decisions each step catch ranks that hold other requests."""
    mp.spawn(_ranks_given_different_requests, args=(2, free_port(), str(checkpoints["llama"][0]), str(tmp_path)),
             nprocs=2, join=True)
    for r in range(2):
        error = torch.load(tmp_path / f"rank{r}.pt")["error"]
        assert error and "the ranks disagree on this step's schedule" in error


def test_a_plugin_declares_the_split_of_its_own_parameters():
    """zoo_tensor_parallel_split answers first; the core's rule covers what it leaves."""
    import pluggy

    from zoo import hookimpl, hookspecs
    from zoo.description import ModelDescription
    from zoo.parallel import TensorParallel, shard_of

    class Rule:
        @hookimpl
        def zoo_tensor_parallel_split(self, name, description, rank, world):
            if name == "model.extra.weight":
                return 0, rank * 6, 6
            if name == "model.layers.0.self_attn.q_proj.weight":
                return "whole"
            return None

    manager = pluggy.PluginManager("zoo")
    manager.add_hookspecs(hookspecs)
    manager.register(Rule())
    desc = ModelDescription("x", 300, 64, 2, 4, 2, 128)
    rank1 = TensorParallel(1, 2, 300, torch.device("cpu"), manager.hook)
    assert shard_of("model.extra.weight", desc, rank1) == (0, 6, 6)
    assert shard_of("model.layers.0.self_attn.q_proj.weight", desc, rank1) is None  # whole, by the plugin
    assert shard_of("model.layers.1.self_attn.q_proj.weight", desc, rank1) == (0, 32, 32)  # the core's


def test_a_sweep_without_a_launcher_is_refused_with_how_to_launch_it(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "zoo.run", "-m", "runtime.tensor_parallel_size=2", "prompt=hi"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 3  # the sweep's job did not succeed
    assert "error: a sweep (-m) with runtime.tensor_parallel_size > 1 runs under torchrun" in done.stderr
    assert "Traceback" not in done.stderr
