"""The core's contracts for plugins, each exercised by a small plugin shaped like the feature that needs it.

- a LoRA-shaped plugin: wrapped projections reading a per-token adapter index from the forward context,
  fusion kept on, a prefix-cache key part; checked against transformers with the adapter merged;
- a prompt-tuning-shaped plugin: the prompt transform prepends virtual tokens whose embeddings it writes;
  checked against transformers' ``inputs_embeds``;
- a draft-model-shaped plugin: an extra attention layer with its own KV-cache layer from the same block pool;
- a step-results reader: hidden states of the final norm and of a captured layer, at the positions that
  produced each committed token (accepted drafts included), checked against transformers' hidden states;
- composable cache keys, the finished hook for rejected requests, and plugin scoping.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, prompt_set
from test_speculative import OracleDrafter, llm_with
from zoo import LLM, SamplingParams, Scope, ZooError, hookimpl
from zoo.forward_context import get_forward_context
from zoo.model import Attention, LinearWrapper
from zoo.step import BufferSpec

MAX_NEW = 8
ATOL = 1e-4  # float32


def hf_generate(model, prompt_ids=None, embeds=None, max_new_tokens=MAX_NEW) -> list[int]:
    with torch.no_grad():
        if embeds is not None:
            out = model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, embeds.shape[0]),
                                 max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            return out[0].tolist()  # with inputs_embeds only the new tokens come back
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


# ------------------------------------------------------------------ forward context, wrapped projections


class LowRankDelta(LinearWrapper):
    """``x A^T B^T * scale`` for tokens whose adapter index is 1, nothing for the others."""

    def __init__(self, base, rank: int, generator):
        super().__init__(base)
        self.register_buffer("A", (torch.randn(rank, base.in_features, generator=generator) * 0.3).to(base.weight))
        self.register_buffer("B", (torch.randn(base.out_features, rank, generator=generator) * 0.3).to(base.weight))

    def merged_weight(self) -> torch.Tensor:
        return self.base_layer.weight.detach() + self.B @ self.A

    def delta(self, x):
        on = get_forward_context().buffers["toy_adapter_index"].to(x.dtype)[:, None]
        return (x @ self.A.T) @ self.B.T * on


class ToyLoRA:
    """Per-request adapter on q, v, gate and up projections; requests without one run on the base model."""

    name = "toy_lora"
    targets = ("self_attn.q_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")

    def __init__(self):
        self.wrappers = {}

    @hookimpl
    def zoo_request_fields(self):
        return ["adapter"]

    @hookimpl
    def zoo_request_cache_key(self, request):
        return ("toy_adapter", request.extras["adapter"]) if "adapter" in request.extras else None

    @hookimpl
    def zoo_model_modify(self, model):
        g = torch.Generator().manual_seed(0)
        for i, layer in enumerate(model.model.layers):
            for target in self.targets:
                parent_name, attr = target.split(".")
                parent = getattr(layer, parent_name)
                wrapper = LowRankDelta(getattr(parent, attr), rank=4, generator=g)
                setattr(parent, attr, wrapper)
                self.wrappers[f"model.layers.{i}.{target}.weight"] = wrapper

    @hookimpl
    def zoo_engine_start(self, setup):
        setup.add_buffer(BufferSpec("toy_adapter_index", (setup.limits.max_num_tokens,)))

    @hookimpl
    def zoo_step_prepare(self, batch, buffers):
        flags = batch.per_token([int("adapter" in e.request.extras) for e in batch.scheduled])
        buffers["toy_adapter_index"].copy_(torch.tensor(flags))


def merged_copy(hf_model, lora: ToyLoRA):
    """transformers' model with the toy adapter merged into its weights: the peer for adapter requests."""
    import copy

    merged = copy.deepcopy(hf_model)
    state = merged.state_dict()
    for name, wrapper in lora.wrappers.items():
        state[name] = wrapper.merged_weight().cpu()
    merged.load_state_dict(state)
    return merged


def check_toy_lora(llm: LLM, lora: ToyLoRA, hf_model) -> None:
    """Base and adapter requests in one batch (same prompts: the cache key keeps their blocks apart)."""
    layer = llm.engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj is not None and layer.mlp.gate_up_proj is not None  # fusion stayed on
    merged = merged_copy(hf_model, lora)
    prompts = prompt_set()[:4]
    requests = [{"prompt_ids": p} for p in prompts] + [{"prompt_ids": p, "adapter": "a"} for p in prompts]
    outputs = llm.generate(requests, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outputs[:4]):
        assert out.token_ids == hf_generate(hf_model, prompt)
    for prompt, out in zip(prompts, outputs[4:]):
        assert out.token_ids == hf_generate(merged, prompt)
    assert any(a.token_ids != b.token_ids for a, b in zip(outputs[:4], outputs[4:]))  # the adapter matters


def test_wrapped_projections_read_the_forward_context_and_stay_fused(checkpoints):
    folder, hf_model = checkpoints["llama"]
    lora = ToyLoRA()
    check_toy_lora(LLM(str(folder), plugins=[lora], block_size=4, max_num_batched_tokens=16), lora, hf_model)


# ------------------------------------------------------------------ prompt transform


class VirtualTokens:
    """Prompt tuning's shape: N virtual tokens before every prompt, their embeddings from a table."""

    name = "virtual_tokens"
    placeholder = 0

    def __init__(self, count: int, hidden: int):
        self.table = torch.randn(count, hidden, generator=torch.Generator().manual_seed(1)) * 0.5

    @hookimpl
    def zoo_prompt_transform(self, request):
        request.prompt_token_ids[:0] = [self.placeholder] * len(self.table)

    @hookimpl
    def zoo_request_cache_key(self):
        return ("virtual_tokens", id(self))  # the table changes the K/V of every block

    @hookimpl
    def zoo_engine_start(self, engine, setup):
        setup.add_buffer(BufferSpec("virtual_row", (setup.limits.max_num_tokens,), fill=-1))
        self.device_table = self.table.to(engine.device, engine.dtype)  # read inside captured graphs

    @hookimpl
    def zoo_step_prepare(self, batch, buffers):
        rows = []
        for entry in batch.scheduled:
            first = entry.start
            rows += [i if i < len(self.table) else -1 for i in range(first, first + entry.num_query_tokens)]
        buffers["virtual_row"].copy_(torch.tensor(rows))

    @hookimpl
    def zoo_embed_modify(self, hidden, context):
        rows = context.buffers["virtual_row"]
        hidden.copy_(torch.where((rows >= 0)[:, None], self.device_table[rows.clamp(min=0)], hidden))  # graph-safe


def test_prompt_transform_prepends_virtual_tokens(checkpoints):
    folder, hf_model = checkpoints["llama"]
    plugin = VirtualTokens(5, hf_model.config.hidden_size)
    llm = LLM(str(folder), plugins=[plugin], block_size=4, max_num_batched_tokens=8)
    prompts = prompt_set()[:3]
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    embed = hf_model.get_input_embeddings()
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            embeds = torch.cat([plugin.table, embed(torch.tensor(prompt))])
        assert out.token_ids == hf_generate(hf_model, embeds=embeds)
        assert out.prompt_token_ids == prompt  # the user's prompt, not the transformed one


def test_virtual_tokens_count_against_the_model_length(checkpoints):
    folder, hf_model = checkpoints["llama"]
    llm = LLM(str(folder), plugins=[VirtualTokens(5, hf_model.config.hidden_size)], max_model_len=30)
    too_long, fits = llm.generate([list(range(1, 26)), list(range(1, 24))], SamplingParams(max_new_tokens=1))
    assert too_long.finish_reason == "error"
    assert too_long.error.startswith("the prompt has 30 tokens (5 added by plugins); the model's limit is 30")
    assert fits.finish_reason == "length"


# ------------------------------------------------------------------ engine start: KV layers of a draft model


class ShadowAttention:
    """A copy of layer 1's attention with its own KV-cache layer; its output must equal the original's."""

    name = "shadow_attention"

    def __init__(self):
        self.max_diff, self.calls = 0.0, 0

    @hookimpl
    def zoo_engine_start(self, engine, setup):
        original = engine.model.model.layers[1].self_attn
        self.shadow = Attention(engine.description).to(engine.device, engine.dtype)
        self.shadow.load_state_dict(original.state_dict(), strict=False)
        setup.add_kv_layers([self.shadow])
        original.register_forward_hook(self._compare)

    def _compare(self, module, args, output):
        self.max_diff = max(self.max_diff, float((self.shadow(*args) - output).abs().max()))
        self.calls += 1


def test_extra_kv_layers_share_the_block_pool(checkpoints):
    folder, _ = checkpoints["llama"]
    runtime = dict(block_size=4, max_num_batched_tokens=16, num_kv_blocks=30, enforce_eager=True)
    prompts = prompt_set()
    shadow = ShadowAttention()
    plain = LLM(str(folder), **runtime)
    llm = LLM(str(folder), plugins=[shadow], **runtime)
    assert llm.engine.runner.kv.bytes_per_block() * 2 == plain.engine.runner.kv.bytes_per_block() * 3
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts + prompts[3:], params)  # repeats hit the prefix cache
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain.generate(prompts + prompts[3:], params)]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.blocks.prefix_hit_tokens > 0
    assert shadow.calls > 0 and shadow.max_diff < 1e-5


def test_extra_kv_layers_count_in_the_memory_budget(checkpoints):
    folder, _ = checkpoints["llama"]
    if os.environ["ZOO_DEVICE"] != "cpu":  # conftest's default; a GPU run of the suite sets cuda
        pytest.skip("the CPU budget (runtime.cpu_kv_cache_gb) is what this sizes; on GPU the profile step does")
    runtime = dict(block_size=4, cpu_kv_cache_gb=9e-5)
    plain, llm = LLM(str(folder), **runtime), LLM(str(folder), plugins=[ShadowAttention()], **runtime)
    assert llm.engine.num_blocks == plain.engine.num_blocks * 2 // 3  # three layers in the budget of two


# ------------------------------------------------------------------ step results


class HiddenStateReader:
    """Keeps, per request, the final and layer-0 hidden states that predicted each committed token."""

    name = "hidden_state_reader"

    def __init__(self):
        self.final, self.layer0 = {}, {}

    @hookimpl
    def zoo_engine_start(self, setup):
        setup.capture_layers([0])

    @hookimpl
    def zoo_step_results(self, results):
        for seq in results.sequences:
            if not seq.new_tokens:
                continue
            rows = seq.rows[len(seq.rows) - len(seq.new_tokens):]
            rid = seq.request.request_id
            self.final.setdefault(rid, []).extend(results.hidden_states(rows).cpu())
            self.layer0.setdefault(rid, []).extend(results.layer_states(0, rows).cpu())


@pytest.mark.parametrize("drafting", [False, True])
def test_step_results_carry_hidden_states_of_committed_tokens(checkpoints, drafting):
    folder, hf_model = checkpoints["llama"]
    prompts = prompt_set()[:4]
    references = {tuple(p): hf_generate(hf_model, p) for p in prompts}
    reader = HiddenStateReader()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    if drafting:
        drafter = OracleDrafter(references, "wrong_tail", k=4)
        llm = llm_with(drafter, str(folder), plugins=[reader], block_size=4)
    else:
        llm = LLM(str(folder), plugins=[reader], block_size=4, max_num_batched_tokens=16)
    outputs = llm.generate(prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        assert out.token_ids == references[tuple(prompt)]
        with torch.no_grad():
            hf = hf_model(torch.tensor([prompt + out.token_ids]), output_hidden_states=True).hidden_states
        positions = range(len(prompt) - 1, len(prompt) - 1 + MAX_NEW)  # each predicted the next token
        torch.testing.assert_close(torch.stack(reader.final[i]), hf[-1][0, positions], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.stack(reader.layer0[i]), hf[1][0, positions], atol=ATOL, rtol=0)
    if drafting:
        assert llm.engine.stats.steps < 1 + MAX_NEW * len(prompts)  # drafts were accepted along the way


def test_capturing_a_layer_that_does_not_exist_is_an_error():
    class Greedy:
        @hookimpl
        def zoo_engine_start(self, setup):
            setup.capture_layers([7])

    with pytest.raises(ZooError, match=r"cannot capture layers \[7\]: the model has layers 0..3"):
        LLM(plugins=[Greedy()])


# ------------------------------------------------------------------ cache keys, finished hook


class KeyPart:
    def __init__(self, field: str):
        self.name, self.field = f"key_{field}", field

    @hookimpl
    def zoo_request_fields(self):
        return [self.field]

    @hookimpl
    def zoo_request_cache_key(self, request):
        return (self.field, request.extras.get(self.field))


def test_cache_key_parts_of_several_plugins_compose():
    llm = LLM(plugins=[KeyPart("a"), KeyPart("b")], block_size=4)
    prompt, params = list(range(1, 30)), SamplingParams(max_new_tokens=1)
    hits = []
    for a, b in [(1, 1), (1, 1), (1, 2), (2, 1), (2, 1)]:
        before = llm.engine.blocks.prefix_hit_tokens
        llm.generate([{"prompt_ids": prompt, "a": a, "b": b}], params)
        hits.append(llm.engine.blocks.prefix_hit_tokens - before)
    assert hits == [0, 28, 0, 0, 28]  # shared only when both parts are equal


def test_finished_hook_runs_for_every_request_including_rejected():
    finished = []

    class Watcher:
        @hookimpl
        def zoo_request_validate(self, request):
            return "no sevens" if 7 in request.prompt_token_ids else None

        @hookimpl
        def zoo_request_finished(self, request):
            finished.append((request.finish_reason, request.error))

    llm = LLM(plugins=[Watcher()])
    llm.generate([[1, 2], [1, 7], [VOCAB * 10], {"prompt_ids": [1], "nosuch": 1}, [3, 4]],
                 SamplingParams(max_new_tokens=2))
    assert sorted(r for r, _ in finished) == ["error", "error", "error", "length", "length"]
    assert ("error", "no sevens") in finished


# ------------------------------------------------------------------ scoping


def test_an_architecture_plugin_only_hears_its_own_checkpoints(tmp_path):
    """A plugin registering another architecture never sees a Llama request, even one it would reject."""
    calls = []

    class OtherArchitecture:
        @hookimpl
        def zoo_model_architectures(self):
            return {"OtherForCausalLM": lambda hf: None}

        @hookimpl
        def zoo_request_validate(self, request):
            calls.append(request)
            return "rejects everything"

    llm = LLM(plugins=[OtherArchitecture()])
    out = llm.generate(["hi"], SamplingParams(max_new_tokens=2))[0]
    assert out.finish_reason == "length" and calls == []
    status = {s.name: s for s in llm.engine.plugins}["OtherArchitecture"]
    assert not status.active and "the checkpoint is LlamaForCausalLM" in status.reason


def test_a_feature_plugin_takes_part_only_when_its_option_is_chosen():
    class Penalty:
        zoo_scope = Scope(option="processor=penalty")

        @hookimpl
        def zoo_logits_process(self, logits):
            logits[:, 65] += 100.0

    plugin_off = LLM(plugins=[Penalty()]).generate(["x"], SamplingParams(max_new_tokens=3))[0]
    plugin_on = LLM(plugins=[Penalty()], overrides=["processor.name=penalty"]).generate(
        ["x"], SamplingParams(max_new_tokens=3))[0]
    assert plugin_on.token_ids == [65, 65, 65] and plugin_off.token_ids != [65, 65, 65]


def test_a_required_plugin_that_is_disabled_is_an_error_at_start():
    from zoo.config import compose_config
    from zoo.plugins import load_plugins, plan_plugins

    config = compose_config(["model=qwen2_vl"])
    with pytest.raises(ZooError, match="plugin 'qwen2_vl' needs plugin 'mrope', which is disabled"):
        plan_plugins(load_plugins(disable=["mrope"]), config, "Qwen2VLForConditionalGeneration")
    rows = {r.name: r for r in plan_plugins(load_plugins(), config, "Qwen2VLForConditionalGeneration")}
    assert rows["mrope"].active and rows["mrope"].reason == "required by qwen2_vl"


def test_no_plugin_hook_checks_which_architecture_is_running():
    plugins = Path(__file__).parent.parent / "plugins"
    for source in plugins.glob("*.py"):
        text = source.read_text()
        assert "description.architecture" not in text and ".architecture ==" not in text, source.name


def test_python_m_zoo_plugins_says_what_takes_part_and_why(tmp_path):
    from test_plugins import run_module

    proc = run_module("zoo.plugins", "model=gpt2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gpt: ACTIVE (the checkpoint's architecture GPT2LMHeadModel is one it registers)" in proc.stdout
    assert "llama: inactive (registers LlamaForCausalLM" in proc.stdout
    assert "mrope: inactive (takes part only when a plugin that takes part requires it)" in proc.stdout
