"""LoRA and prompt tuning from PEFT folders, request by request against peft.

The adapters are made by peft itself (random A and B: ``init_lora_weights=False``)
and saved with ``save_pretrained``; zoo loads the folders. LoRA requests must
give ``PeftModel.generate``'s greedy tokens. For prompt tuning the peer is
peft's own forward pass over the whole sequence at every step: its cached
``generate`` with transformers 5 drops the virtual tokens from the attention
mask after the first step (peft warns that it ignores position ids), so it is
not the definition.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from peft import LoraConfig, PromptTuningConfig, get_peft_model

from conftest import StepRecorder, make_checkpoint, prompt_set
from zoo import LLM, SamplingParams, ZooError

MAX_NEW = 8
LOGPROB_TOL = 1e-4  # fp32: zoo's log-probability of each chosen token against peft's
ALL_PROJECTIONS = {"llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                   "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                   "gpt2": ["c_attn", "c_proj", "c_fc"]}
QV = {"llama": ["q_proj", "v_proj"], "qwen2": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}


def save_lora(base, folder, r, targets, seed, **kwargs):
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                            init_lora_weights=False, lora_dropout=0.1, **kwargs))
    model.save_pretrained(folder)
    return model.eval()


def save_prompt_tuning(base, folder, n, seed):
    torch.manual_seed(seed)
    model = get_peft_model(copy.deepcopy(base), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=n))
    model.save_pretrained(folder)
    return model.eval()


def scale_folded_into_b(model):
    """A copy of a peft model whose LoRA layers compute B' (A x) with B' = scale x B and scale 1: the same adapter,
    rounded as zoo (and vLLM) round it in bf16, where peft rounds B (A x) and then its product with the scale."""
    model = copy.deepcopy(model)
    for module in model.modules():
        if hasattr(module, "lora_B") and hasattr(module, "scaling"):
            for name in list(module.scaling):
                module.lora_B[name].weight.data *= module.scaling[name]
                module.scaling[name] = 1.0
    return model


class Family:
    """A tiny base checkpoint with four adapters made by peft, and their peers."""

    def __init__(self, name, root):
        self.name, self.folder = name, root / name
        self.base = make_checkpoint(name, self.folder)
        self.peers = {None: self.base,
                      "r4": save_lora(self.base, root / f"{name}_r4", 4, QV[name], seed=1),
                      "r8": save_lora(self.base, root / f"{name}_r8", 8, ALL_PROJECTIONS[name], seed=2, use_rslora=True),
                      "prompt": save_prompt_tuning(self.base, root / f"{name}_prompt", 5, seed=3)}
        self.adapters = {k: str(root / f"{name}_{k}") for k in ("r4", "r8", "prompt")}

    def llm(self, **kwargs) -> LLM:
        return LLM(str(self.folder), model="gpt2" if self.name == "gpt2" else "llama", adapters=self.adapters, **kwargs)

    def reference(self, adapter, prompt) -> tuple[list[int], list[float]]:
        """peft's greedy tokens and the log-probability of each."""
        model, ids = self.peers[adapter], torch.tensor([prompt])
        with torch.no_grad():
            if adapter != "prompt":
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                     do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
                tokens = out.sequences[0, len(prompt):].tolist()
                logits = [step[0] for step in out.logits]
            else:  # the whole sequence through peft's forward at every step (see the module docstring)
                tokens, logits, seq = [], [], list(prompt)
                for _ in range(MAX_NEW):
                    t = torch.tensor([seq])
                    logits.append(model(input_ids=t, attention_mask=torch.ones_like(t)).logits[0, -1])
                    tokens.append(int(logits[-1].argmax()))
                    seq.append(tokens[-1])
        return tokens, [float(torch.log_softmax(l.float(), -1)[t]) for l, t in zip(logits, tokens)]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: Family(name, root) for name in ("llama", "qwen2", "gpt2")}


def mixed_requests(prompts):
    return [{"prompt_ids": p, **({"adapter": a} if a else {})} for a in (None, "r4", "r8", "prompt") for p in prompts]


def check_against_peft(family: Family, llm: LLM, prompts, logprobs=True) -> None:
    requests = mixed_requests(prompts)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=1 if logprobs else None)
    outputs = llm.generate(requests, params)
    for request, out in zip(requests, outputs):
        assert out.error is None, out.error
        assert out.prompt_token_ids == request["prompt_ids"]  # virtual tokens are not the user's
        tokens, logprobs_ref = family.reference(request.get("adapter"), request["prompt_ids"])
        assert out.token_ids == tokens, request.get("adapter")
        if logprobs:
            got = [step["logprob"] for step in out.logprobs]
            assert max(abs(a - b) for a, b in zip(got, logprobs_ref)) < LOGPROB_TOL, request.get("adapter")


def test_the_peer_with_the_scale_folded_into_b_is_the_same_adapter(families):
    """The bf16 GPU test's peer (scale_folded_into_b) computes what peft computes, in float32."""
    family = families["llama"]
    for adapter in ("r4", "r8"):
        peer, folded = family.peers[adapter], scale_folded_into_b(family.peers[adapter])
        assert all(scale == 1.0 for m in folded.modules() if hasattr(m, "lora_B") for scale in m.scaling.values())
        ids = torch.tensor([prompt_set()[0]])
        with torch.no_grad():
            torch.testing.assert_close(folded(input_ids=ids).logits, peer(input_ids=ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_a_mixed_batch_gives_peft_tokens_request_by_request(families, name):
    """Base, LoRA r4 on q/v, LoRA r8 with rslora on every projection, prompt tuning: one batch."""
    family = families[name]
    llm = family.llm()
    layer = llm.engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None  # fusion stayed on
    assert layer.mlp.gate_proj is None or layer.mlp.gate_up_proj is not None
    check_against_peft(family, llm, prompt_set()[:3])
    summary = llm.engine.summary()
    assert "adapter r8: LORA r=8, alpha 16, rslora" in summary and "adapter prompt: PROMPT_TUNING 5 virtual tokens" in summary


def test_chunked_prefill_preemption_and_eviction(families):
    """Small steps, a cache that forces preemption, one device slot and one host copy: the same tokens."""
    family = families["llama"]
    steps = StepRecorder(lambda batch: {e.request.extras.get("adapter") for e in batch.scheduled} - {None})
    llm = family.llm(max_num_batched_tokens=16, num_kv_blocks=16, block_size=4, max_num_seqs=6, max_loras=1,
                     max_cpu_loras=1, plugins=[steps])
    check_against_peft(family, llm, prompt_set()[:3], logprobs=False)
    lora = llm.engine.adapters.kinds["LORA"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(s - {"prompt"}) <= 1 for s in steps.steps)  # never more distinct LoRAs in a step than slots
    assert len({frozenset(s - {"prompt"}) for s in steps.steps}) >= 3  # base-only, r4 and r8 steps
    # r8 took the one slot and the one host copy: r4 comes back from its folder, and gives its tokens again.
    assert lora.slots == ["r8"] and list(lora.cpu) == ["r8"]
    loads, prompt = lora.loads, prompt_set()[0]
    out = llm.generate([{"prompt_ids": prompt, "adapter": "r4"}], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert out[0].token_ids == family.reference("r4", prompt)[0] and lora.loads == loads + 1


def test_prefix_blocks_are_not_shared_between_adapters(families):
    """The same prompts, first on the base model, then on each adapter: cached blocks must not leak."""
    family = families["llama"]
    llm = family.llm()
    prompts = prompt_set()[3:]  # share a 20-token prefix
    for adapter in (None, "r4", "r8", "prompt", "r4"):
        requests = [{"prompt_ids": p, **({"adapter": adapter} if adapter else {})} for p in prompts]
        for request, out in zip(requests, llm.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))):
            assert out.token_ids == family.reference(adapter, request["prompt_ids"])[0]
    assert llm.engine.blocks.prefix_hit_tokens > 0  # the cache was used, within each adapter


def test_adding_and_removing_adapters_while_running(families, tmp_path):
    family = families["llama"]
    llm = LLM(str(family.folder), adapters={"r8": family.adapters["r8"]})
    prompt = prompt_set()[1]
    assert llm.generate([{"prompt_ids": prompt, "adapter": "r4"}])[0].error == "unknown adapter 'r4' (loaded: r8)"
    llm.add_adapter("r4", family.adapters["r4"])
    llm.add_adapter("prompt", family.adapters["prompt"])
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for adapter in ("r4", "prompt", "r8"):
        assert llm.generate([{"prompt_ids": prompt, "adapter": adapter}], params)[0].token_ids == \
            family.reference(adapter, prompt)[0]
    waiting = llm.engine.add_request(prompt_token_ids=prompt, extras={"adapter": "r4"})
    with pytest.raises(ZooError, match="adapter 'r4' is in use by 1 unfinished request"):
        llm.remove_adapter("r4")
    llm.engine.run_until_done()
    assert waiting.is_finished and waiting.error is None
    llm.remove_adapter("r4")
    out = llm.generate([{"prompt_ids": prompt, "adapter": "r4"}, {"prompt_ids": prompt}], params)
    assert out[0].error.startswith("unknown adapter 'r4'") and out[1].token_ids == family.reference(None, prompt)[0]
    with pytest.raises(ZooError, match="adapter 'prompt' is loaded already"):
        llm.add_adapter("prompt", family.adapters["r4"])


@pytest.mark.parametrize("method", ["medusa", "eagle", "lookahead"])
def test_lora_requests_under_speculative_decoding_get_their_own_tokens(families, method):
    """The target applies the adapter to every drafted token; drafts come from the base's heads."""
    family = families["llama"]
    llm = LLM(str(family.folder), decoding=method, adapters=family.adapters,
              overrides=["decoding.disable_by_batch_size=null"])
    prompts = prompt_set()[:3]
    requests = mixed_requests(prompts)
    outputs = llm.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for request, out in zip(requests, outputs):
        assert out.token_ids == family.reference(request.get("adapter"), request["prompt_ids"])[0]
    assert sum(llm.engine.stats.drafted_depth) > 0


# ---------------------------------------------------------------------- bad input


def write_folder(folder, config: dict | None, tensors: dict | None, pickle=False):
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if config is not None:
        (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    if pickle:
        torch.save({}, folder / "adapter_model.bin")
    return folder


def bad_folders(family: Family, root):
    """name -> (folder, the message its requests get)."""
    good = json.loads((family.folder.parent / "llama_r4" / "adapter_config.json").read_text())
    a, b = torch.randn(4, 64), torch.randn(64, 4)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    other = make_checkpoint("llama", root / "other_base_model")  # noqa: F841 - only its folder
    cases = {
        "rank": (write_folder(root / "rank", good, {key.format("A"): torch.randn(32, 64), key.format("B"): torch.randn(64, 32)}),
                 "has rank 32, above runtime.max_lora_rank=16"),
        "target": (write_folder(root / "target", good, {
            "base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": torch.randn(300, 4)}),
            "target module lm_head is not an attention or MLP projection"),
        "shape": (write_folder(root / "shape", good, {key.format("A"): torch.randn(4, 32), key.format("B"): torch.randn(32, 4)}),
                  "an adapter made for another base"),
        "no_config": (write_folder(root / "no_config", None, {key.format("A"): a, key.format("B"): b}),
                      "no adapter_config.json"),
        "pickle": (write_folder(root / "pickle", good, None, pickle=True), "adapter_model.bin is a pickle"),
        "saved_modules": (write_folder(root / "saved_modules", {**good, "modules_to_save": ["lm_head"]},
                                       {key.format("A"): a, key.format("B"): b}), "modules_to_save"),
        "missing": (root / "does_not_exist", "no such adapter folder"),
        "type": (write_folder(root / "type", {"peft_type": "IA3"}, {key.format("A"): a}), "peft_type IA3 is not served"),
    }
    return cases


def test_bad_adapters_fail_only_their_requests(families, tmp_path):
    family = families["llama"]
    cases = bad_folders(family, tmp_path)
    llm = LLM(str(family.folder), adapters={"r4": family.adapters["r4"], **{n: str(f) for n, (f, _) in cases.items()}})
    prompt = prompt_set()[0]
    requests = [{"prompt_ids": prompt, "adapter": n} for n in cases] + [
        {"prompt_ids": prompt, "adapter": "r4"}, {"prompt_ids": prompt, "adapter": "nosuch"}, {"prompt_ids": prompt}]
    outputs = llm.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for (name, (_, message)), out in zip(cases.items(), outputs):
        assert out.finish_reason == "error" and message in out.error, (name, out.error)
    assert outputs[-3].token_ids == family.reference("r4", prompt)[0]
    assert outputs[-2].error == "unknown adapter 'nosuch' (loaded: r4)"
    assert outputs[-1].token_ids == family.reference(None, prompt)[0]
    for name, (folder, message) in cases.items():  # at run time: the caller hears it
        with pytest.raises(ZooError, match=message.split(" (")[0].replace(".", r"\.").replace("[", r"\[")):
            llm.add_adapter(f"late_{name}", folder)


def test_cli_serves_adapter_requests_and_warns_of_a_bad_adapter_in_one_line(families, tmp_path):
    family = families["llama"]
    prompt = prompt_set()[0]
    lines = [{"prompt_ids": prompt, "adapter": "r4"}, {"prompt_ids": prompt, "adapter": "bad"}, {"prompt_ids": prompt}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run([sys.executable, "-m", "zoo.run", f"model.path={family.folder}", f"+adapters.r4={family.adapters['r4']}",
                           f"+adapters.bad={tmp_path / 'nowhere'}", f"input.file={tmp_path / 'in.jsonl'}", "output.format=jsonl",
                           f"sampling.max_new_tokens={MAX_NEW}", "sampling.ignore_eos=true"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 3, proc.stderr  # a request failed
    warnings = [line for line in proc.stderr.splitlines() if "adapter 'bad'" in line]
    assert len(warnings) == 1 and "no such adapter folder" in warnings[0] and "Traceback" not in proc.stderr
    records = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: r["id"])
    assert records[0]["token_ids"] == family.reference("r4", prompt)[0]
    assert records[1]["finish_reason"] == "error" and "no such adapter folder" in records[1]["error"]
    assert records[2]["token_ids"] == family.reference(None, prompt)[0]


def test_virtual_tokens_placed_in_the_prompt_index_the_table(families):
    """TensorRT-LLM's convention: ids from vocab_size on are rows of the request's table."""
    family = families["llama"]
    llm = family.llm()
    prompt = prompt_set()[0]
    placed = [300 + i for i in range(5)] + prompt  # where peft puts them: the same as prepending
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    out = llm.generate([{"prompt_ids": placed, "adapter": "prompt"}, {"prompt_ids": [300] + prompt, "adapter": "r4"},
                        {"prompt_ids": [305] + prompt, "adapter": "prompt"}, {"prompt_ids": prompt + [301], "adapter": "prompt"}],
                       params)
    assert out[0].token_ids == family.reference("prompt", prompt)[0]
    assert "outside the vocabulary [0, 300)" in out[1].error
    assert "outside the vocabulary [0, 300) and the request's prompt table [300, 305)" in out[2].error
    assert "a prompt's last token must be a vocabulary token" in out[3].error


def test_zoo_plugins_lists_the_adapters(families):
    family = families["llama"]
    proc = subprocess.run([sys.executable, "-m", "zoo.plugins", f"model.path={family.folder}",
                           f"+adapters.r8={family.adapters['r8']}", f"+adapters.prompt={family.adapters['prompt']}"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "lora: ACTIVE (adapters is set)" in proc.stdout
    assert ("r8: LORA r=8, alpha 16, rslora, targets down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"
            in proc.stdout)
    assert "prompt: PROMPT_TUNING 5 virtual tokens" in proc.stdout
