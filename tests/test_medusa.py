"""decoding=medusa: exact greedy tokens in every scheduling regime, released-layout heads, bad settings.

Also: draft tokens get the positions of the model's position plugin (GLM's 2-D rows, Qwen2-VL's mRoPE
rows), shown with drafts that are always right so that every accepted token's logits depend on them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import prompt_set
from test_glm import glm_prompts
from test_qwen2_vl import requests_and_references
from test_speculative import OracleDrafter, assert_three_sampled_tokens_follow_the_target, llm_with
from zoo import LLM, SamplingParams, ZooError

MAX_NEW = 10


def mixed_prompts() -> list[list[int]]:
    """Eight prompts of mixed lengths, two of them repeated (prefix-cache hits)."""
    prompts = prompt_set()
    return prompts + [list(prompts[4]), list(prompts[1])]


REGIMES = {
    "batched": {},
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=12),
    "preemption": dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_medusa_gives_the_tokens_of_plain_decoding(checkpoints, regime):
    folder, _ = checkpoints["llama"]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = mixed_prompts()
    plain = LLM(str(folder), **REGIMES[regime]).generate(prompts, params)
    llm = LLM(str(folder), decoding="medusa", **REGIMES[regime])
    assert llm.engine.decoding.max_draft_tokens == 63  # the reference tree
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert llm.engine.draft_failures == 0
    stats = llm.engine.stats
    assert stats.drafted_depth[0] > 0 and stats.accepted_depth and stats.accepted_depth[0] > 0  # some accepted
    assert sum(o.num_steps for o in outputs) < sum(len(o.token_ids) for o in outputs)
    if regime == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize("name", ["qwen2", "mistral", "gpt2"])
def test_medusa_on_other_architectures(checkpoints, name):
    """Qwen2 (qkv bias, tied embeddings), Mistral (a sliding window shorter than the prompts), GPT-2 (learned
    positions): drafts from an oracle that is always right, so every accepted token's logits depend on the
    draft positions and masks, and from fresh Medusa heads."""
    folder, _ = checkpoints[name]
    option = "gpt2" if name == "gpt2" else "llama"
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = mixed_prompts()
    plain = LLM(str(folder), model=option).generate(prompts, params)
    references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    drafter = OracleDrafter(references, "tree", k=4)
    drafted = llm_with(drafter, str(folder), model=option).generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(o.num_steps for o in drafted) < sum(len(o.token_ids) for o in drafted)
    medusa = LLM(str(folder), model=option, decoding="medusa").generate(prompts, params)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]


def test_medusa_under_sampling_keeps_the_target_distribution(checkpoints):
    folder, model = checkpoints["llama"]
    llm = LLM(str(folder), decoding="medusa", overrides=["decoding.tree=[[0],[1],[2],[0,0],[1,0],[0,0,0]]",
                                                          "decoding.disable_by_batch_size=null"],
              max_num_seqs=64, max_num_batched_tokens=1024)
    assert_three_sampled_tokens_follow_the_target(llm, model, prompt_set()[0])
    assert llm.engine.stats.accepted_depth[0] > 0  # drafts were accepted, so acceptance was exercised


def write_reference_heads(folder, hidden: int, vocab: int, num_heads=3, num_layers=2, seed=0):
    """A Medusa heads folder in the reference repository's key names and config fields."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            tensors[f"{h}.{layer}.linear.weight"] = torch.randn(hidden, hidden, generator=g) * 0.05
            tensors[f"{h}.{layer}.linear.bias"] = torch.randn(hidden, generator=g) * 0.05
        tensors[f"{h}.{num_layers}.weight"] = torch.randn(vocab, hidden, generator=g) * 0.2
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "medusa_lm_head.safetensors"))
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": num_heads, "medusa_num_layers": num_layers,
                                                    "base_model_name_or_path": "tiny-llama"}))
    return tensors


def test_released_layout_heads_load_and_stay_exact(checkpoints, tmp_path):
    folder, hf_model = checkpoints["llama"]
    tensors = write_reference_heads(tmp_path / "heads", hf_model.config.hidden_size, hf_model.config.vocab_size)
    tree = "[[0],[1],[0,0],[0,1],[0,0,0]]"
    llm = LLM(str(folder), decoding="medusa", overrides=[f"decoding.heads={tmp_path / 'heads'}",
                                                          f"decoding.tree={tree}"])
    heads = llm.engine.decoding.heads
    assert len(heads) == 3 and len(heads[0]) == 3  # two residual blocks and the projection
    torch.testing.assert_close(heads[2][2].weight.cpu(), tensors["2.2.weight"])
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    prompts = mixed_prompts()
    plain = LLM(str(folder)).generate(prompts, params)
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]


def assert_one_line_error(forked, method: str, overrides: list[str], message: str, cwd, model_path=None) -> None:
    """The setting fails ``LLM(...)`` with ``message``, and ``python -m zoo.run`` (run by ``forked``, the fixture)
    with that one line and exit 2."""
    with pytest.raises(ZooError) as info:
        LLM(model_path, decoding=method, overrides=overrides)
    assert message in str(info.value)
    path = [f"model.path={model_path}"] if model_path else []
    proc = forked.run("zoo.run", *path, f"decoding={method}", *overrides, cwd=cwd,
                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("override, message", [
    ("decoding.heads={missing}", "decoding.heads={missing}: no such folder"),
    ("decoding.heads={wrong_size}", "the weights do not fit this model (hidden 64, vocabulary 300)"),
    ("decoding.heads={pickled}", "medusa_lm_head.pt is a pickle, which zoo does not load"),
    ("decoding.tree=[[0],[1,2]]", "decoding.tree: the parent of [1, 2] is not in the tree"),
    ("decoding.tree=[[0],[0,0],[0,0,0],[0,0,0,0],[0,0,0,0,0]]", "goes 5 deep; the Medusa heads predict 4"),
    ("decoding.tree=[[0],[-1]]", "is not a path of top-k ranks"),
])
def test_bad_medusa_settings_are_one_line(checkpoints, tmp_path, override, message, forked):
    folder, hf_model = checkpoints["llama"]
    write_reference_heads(tmp_path / "wrong_size", 32, 300)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "medusa_lm_head.pt").write_bytes(b"not loaded")  # as released, with its config
    (tmp_path / "pickled" / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    paths = {k: tmp_path / k for k in ("missing", "wrong_size", "pickled")}
    assert_one_line_error(forked, "medusa", [override.format(**paths)], message.format(**paths), tmp_path, str(folder))


def test_jsonl_records_steps_and_the_summary_reports_acceptance(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zoo.run", "model=gpt2", "decoding=medusa", "output.format=jsonl",
                           "sampling.max_new_tokens=24", "prompt=zoo zoo zoo"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.splitlines()[0])
    assert len(record["token_ids"]) == 24 and 1 <= record["num_steps"] <= 24
    assert "decoding medusa: mean accepted length" in proc.stderr and "acceptance by draft depth 1:" in proc.stderr
    assert "starts from fresh heads" in proc.stderr


# ------------------------------------------------------------------ draft positions of the position plugins


def test_drafts_take_glm_positions(glm_checkpoint):
    kind, folder, _ = glm_checkpoint
    prompts = glm_prompts()
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = LLM(str(folder), model=kind).generate(prompts, params)
    references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    drafter = OracleDrafter(references, "tree", k=4)
    outputs = llm_with(drafter, str(folder), model=kind).generate(prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert sum(o.num_steps for o in outputs) < sum(len(o.token_ids) for o in outputs)
    medusa = LLM(str(folder), model=kind, decoding="medusa").generate(prompts, params)
    assert [o.token_ids for o in medusa] == [o.token_ids for o in plain]


def test_drafts_take_mrope_positions_with_images(qwen2_vl, tmp_path):
    requests, references = requests_and_references(qwen2_vl, tmp_path)
    folder = str(qwen2_vl[0])
    by_prompt = {tuple(r["prompt_ids"]): tokens for r, (tokens, _) in zip(requests, references)}
    drafter = OracleDrafter(by_prompt, "wrong_tail", k=4)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    outputs = llm_with(drafter, folder, model="qwen2_vl").generate(requests, params)
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in references]
    assert sum(o.num_steps for o in outputs) < sum(len(o.token_ids) for o in outputs)
    medusa = LLM(folder, model="qwen2_vl", decoding="medusa").generate(requests, params)
    assert [o.token_ids for o in medusa] == [tokens for tokens, _ in references]


def test_typical_acceptance_accepts_more_and_keeps_greedy_exact(checkpoints):
    """Typical acceptance (sampled requests only) accepts any draft token the target finds likely enough:
    more accepted than the exact rule, every token still inside the target's top-k support; greedy
    requests are verified exactly as before."""
    folder, model = checkpoints["llama"]
    prompt = prompt_set()[1]
    tree = "decoding.tree=[[0],[1],[2],[0,0],[1,0],[2,0],[0,0,0]]"
    sampled = [SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=1.0, top_k=3, seed=s)
               for s in range(32)]
    rates = {}
    for acceptance in ("exact", "typical"):
        llm = LLM(str(folder), decoding="medusa", overrides=[tree, f"decoding.acceptance={acceptance}",
                                                             "decoding.posterior_threshold=0.05",
                                                             "decoding.posterior_alpha=0.05"])
        outputs = llm.generate([prompt] * 32, sampled)
        stats = llm.engine.stats
        rates[acceptance] = stats.generated_tokens / stats.token_steps
        for out in outputs[:4]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
            top = logits.topk(3).indices
            assert all(t in row for t, row in zip(out.token_ids, top.tolist()))
        greedy = llm.generate(mixed_prompts(), SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        plain = LLM(str(folder)).generate(mixed_prompts(), SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
        assert [o.token_ids for o in greedy] == [o.token_ids for o in plain]
    assert rates["typical"] > rates["exact"], rates


def test_unknown_acceptance_is_an_error():
    with pytest.raises(ZooError, match="decoding.acceptance='nosuch' must be exact or typical"):
        LLM(decoding="medusa", overrides=["decoding.acceptance=nosuch"])


def test_an_unknown_method_is_one_line_listing_the_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zoo.run", "decoding=nosuch"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: decoding=nosuch: no such option (available: eagle, lookahead, medusa, none)")
