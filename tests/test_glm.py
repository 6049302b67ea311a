"""GLM 2-D positions (ChatGLM-6B, GLM-10B).

transformers has no GLM-10B or ChatGLM-6B model, so the peers here are the
published rules: the position-id tables as the GLM papers' code lays them out,
and a full recomputation written in this file from the published architectures
(weights read by their checkpoint names, dense attention, bidirectional over
the context). zoo's paged, batched, chunked and prefix-cached decoding must
give the same logits and greedy tokens.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from test_parity import LogitsRecorder as Recorder
from zoo import LLM, SamplingParams
from zoo_plugins.chatglm import zoo_step_positions as chatglm_positions
from zoo_plugins.glm import glm_mask_position, two_d_positions
from zoo.request import Request

LOGIT_ATOL = 1e-4  # float32, different summation orders

# ------------------------------------------------------------------ the position rules, as tables


def test_chatglm_rule_table():
    # prompt of 6 tokens "a b c d [gMASK] <sop>", then 3 generated tokens
    rows = two_d_positions(6, 4, range(9))
    assert rows == [[0, 1, 2, 3, 4, 4, 4, 4, 4],
                    [0, 0, 0, 0, 0, 1, 2, 3, 4]]


def test_chatglm_plugin_uses_the_token_before_sop_as_mask():
    request = Request(0, list(range(10, 17)), None)  # 7 prompt tokens
    assert chatglm_positions(request=request, indices=list(range(9))) == [
        [0, 1, 2, 3, 4, 5, 5, 5, 5], [0, 0, 0, 0, 0, 0, 1, 2, 3]]


def test_glm_rule_table_with_and_without_a_mask_token():
    prompt = [7, 8, 50260, 9, 50264, 10]  # first mask token at index 2; <sop> last
    mask = glm_mask_position(prompt, max_sequence_length=1024)
    assert mask == 2
    assert two_d_positions(len(prompt), mask, range(8)) == [[0, 1, 2, 3, 4, 2, 2, 2],
                                                            [0, 0, 0, 0, 0, 1, 2, 3]]
    assert glm_mask_position([7, 8, 9], max_sequence_length=1024) == 1024  # no mask: the max context length
    assert two_d_positions(3, 1024, range(4)) == [[0, 1, 1024, 1024], [0, 0, 1, 2]]


@pytest.mark.parametrize("cuts", [[3], [1, 4, 5], [2, 6]])
def test_chunks_get_the_ids_of_the_whole_prompt(cuts):
    whole = two_d_positions(7, 5, range(10))
    bounds = [0] + cuts + [10]
    pieces = [two_d_positions(7, 5, range(a, b)) for a, b in zip(bounds, bounds[1:])]
    assert [sum((p[r] for p in pieces), []) for r in range(2)] == whole


# ------------------------------------------------------------------ tiny checkpoints by their published names

VOCAB = 50304  # GLM-10B's, so that its mask token ids exist
HIDDEN, HEADS, LAYERS, MAX_LEN = 64, 4, 2, 128  # head size 16: on a GPU, decode steps run as CUDA graphs


def _randn(g, *shape, scale=0.2):
    return torch.randn(*shape, generator=g) * scale


def _layer_tensors(g, prefix, inner):
    t = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        t[f"{prefix}{norm}.weight"] = 1 + _randn(g, HIDDEN, scale=0.1)
        t[f"{prefix}{norm}.bias"] = _randn(g, HIDDEN, scale=0.1)
    t[f"{prefix}attention.query_key_value.weight"] = _randn(g, 3 * HIDDEN, HIDDEN)
    t[f"{prefix}attention.query_key_value.bias"] = _randn(g, 3 * HIDDEN)
    t[f"{prefix}attention.dense.weight"] = _randn(g, HIDDEN, HIDDEN)
    t[f"{prefix}attention.dense.bias"] = _randn(g, HIDDEN)
    t[f"{prefix}mlp.dense_h_to_4h.weight"] = _randn(g, inner, HIDDEN)
    t[f"{prefix}mlp.dense_h_to_4h.bias"] = _randn(g, inner)
    t[f"{prefix}mlp.dense_4h_to_h.weight"] = _randn(g, HIDDEN, inner)
    t[f"{prefix}mlp.dense_4h_to_h.bias"] = _randn(g, HIDDEN)
    return t


def write_chatglm(folder):
    g = torch.Generator().manual_seed(1)
    inner = 4 * HIDDEN
    t = {"transformer.word_embeddings.weight": _randn(g, VOCAB, HIDDEN, scale=1.0),
         "transformer.final_layernorm.weight": 1 + _randn(g, HIDDEN, scale=0.1),
         "transformer.final_layernorm.bias": _randn(g, HIDDEN, scale=0.1),
         "lm_head.weight": _randn(g, VOCAB, HIDDEN)}
    for i in range(LAYERS):
        t.update(_layer_tensors(g, f"transformer.layers.{i}.", inner))
        t[f"transformer.layers.{i}.attention.rotary_emb.inv_freq"] = torch.ones(HIDDEN // HEADS // 4)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["ChatGLMModel"], "hidden_size": HIDDEN, "num_attention_heads": HEADS,
        "num_layers": LAYERS, "inner_hidden_size": inner, "vocab_size": VOCAB, "max_sequence_length": MAX_LEN,
        "layernorm_epsilon": 1e-5, "position_encoding_2d": True, "bos_token_id": 130004, "eos_token_id": 130005}))
    return t


def write_glm(folder):
    g = torch.Generator().manual_seed(2)
    t = {"glm.word_embeddings.weight": _randn(g, VOCAB, HIDDEN, scale=1.0),
         "glm.transformer.position_embeddings.weight": _randn(g, MAX_LEN + 1, HIDDEN, scale=1.0),
         "glm.transformer.block_position_embeddings.weight": _randn(g, MAX_LEN + 1, HIDDEN, scale=1.0),
         "glm.transformer.final_layernorm.weight": 1 + _randn(g, HIDDEN, scale=0.1),
         "glm.transformer.final_layernorm.bias": _randn(g, HIDDEN, scale=0.1)}
    for i in range(LAYERS):
        t.update(_layer_tensors(g, f"glm.transformer.layers.{i}.", 4 * HIDDEN))
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["GLMModel"], "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_layers": LAYERS,
        "vocab_size": VOCAB, "max_sequence_length": MAX_LEN, "block_position_encoding": True,
        "relative_encoding": False, "output_predict": True}))
    return t


# ------------------------------------------------------------------ full recomputation from the published models


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def _rotate(x, positions):
    """ChatGLM's RoPE on x [L, heads, dim] for one row of positions (rotate-half within x)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rotated * emb.sin()


def reference_logits(kind, t, prompt, tokens):
    """Logits at every position of ``tokens`` (prompt + generated), computed from scratch."""
    pre = "transformer." if kind == "chatglm" else "glm.transformer."
    L, P, d = len(tokens), len(prompt), HIDDEN // HEADS
    mask_pos = P - 2 if kind == "chatglm" else glm_mask_position(prompt, MAX_LEN)
    pos = torch.tensor(two_d_positions(P, mask_pos, range(L)))
    ids = torch.tensor(tokens)
    if kind == "chatglm":
        h = t["transformer.word_embeddings.weight"][ids]
    else:
        h = (t["glm.word_embeddings.weight"][ids] + t[pre + "position_embeddings.weight"][pos[0]]
             + t[pre + "block_position_embeddings.weight"][pos[1]])
    allowed = torch.ones(L, L).tril().bool()
    allowed[:, :P - 1] = True  # the context is seen by every token, in both directions
    alpha = math.sqrt(2 * LAYERS) if kind == "chatglm" else 1.0
    for i in range(LAYERS):
        p = f"{pre}layers.{i}."

        def ln(x, name):
            return F.layer_norm(x, (HIDDEN,), t[p + name + ".weight"], t[p + name + ".bias"], 1e-5)

        def lin(x, name):
            return x @ t[p + name + ".weight"].T + t[p + name + ".bias"]

        x = ln(h, "input_layernorm")
        qkv = lin(x, "attention.query_key_value")
        if kind == "chatglm":  # per head: q, k, v
            q, k, v = qkv.view(L, HEADS, 3 * d).split(d, dim=-1)
            q = torch.cat([_rotate(q[..., :d // 2], pos[0]), _rotate(q[..., d // 2:], pos[1])], -1)
            k = torch.cat([_rotate(k[..., :d // 2], pos[0]), _rotate(k[..., d // 2:], pos[1])], -1)
        else:  # all q, then all k, then all v
            q, k, v = (y.view(L, HEADS, d) for y in qkv.chunk(3, dim=-1))
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~allowed, float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(L, HIDDEN)
        h = (x * alpha if kind == "chatglm" else h) + lin(attn, "attention.dense")
        x = ln(h, "post_attention_layernorm")
        h = (x * alpha if kind == "chatglm" else h) + lin(_gelu(lin(x, "mlp.dense_h_to_4h")), "mlp.dense_4h_to_h")
    h = F.layer_norm(h, (HIDDEN,), t[pre + "final_layernorm.weight"], t[pre + "final_layernorm.bias"], 1e-5)
    head = t["lm_head.weight"] if kind == "chatglm" else t["glm.word_embeddings.weight"]
    return h @ head.T


def reference_greedy(kind, t, prompt, n):
    tokens = list(prompt)
    steps = []
    for _ in range(n):
        logits = reference_logits(kind, t, prompt, tokens)[-1]
        steps.append(logits)
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):], torch.stack(steps)


def glm_prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 1000, (21,), generator=g).tolist()
    sop = [2]
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() + sop for n in (4, 30, 11)]
    prompts.append([5, 6, 50263, 7, 8] + sop)  # GLM: mask token at index 2
    # a shared 21-token start, different contexts after it: must not share cached context blocks
    prompts += [shared + torch.randint(0, 1000, (n,), generator=g).tolist() + sop for n in (3, 12)]
    prompts.append(list(prompts[-1]))  # the same context again: may share
    return prompts


@pytest.mark.parametrize("runtime", [
    {},  # everything in one batch
    {"max_num_batched_tokens": 36, "block_size": 4},  # chunked: long contexts wait for a step that fits them
    {"max_num_seqs": 2, "block_size": 4, "num_kv_blocks": 40},  # few sequences at a time, prefix caching on
])
def test_paged_decoding_equals_full_recomputation(glm_checkpoint, runtime):
    kind, folder, tensors = glm_checkpoint
    prompts = glm_prompts()
    recorder = Recorder()
    llm = LLM(str(folder), model=kind, plugins=[recorder], **runtime)
    if llm.engine.device.type == "cuda" and not runtime:
        assert llm.engine.uses_cuda_graphs  # the 2-D positions and block embeddings replay in graphs
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=5, ignore_eos=True))
    for i, (out, prompt) in enumerate(zip(outs, prompts)):  # a fresh engine numbers requests from 0
        assert out.error is None
        tokens, logits = reference_greedy(kind, tensors, prompt, 5)
        assert out.token_ids == tokens
        zoo_logits = torch.stack(recorder.rows[i])
        torch.testing.assert_close(zoo_logits, logits, atol=LOGIT_ATOL, rtol=0)
    if "num_kv_blocks" in runtime:
        assert llm.engine.blocks.prefix_hit_tokens > 0  # the repeated prompt reused its context blocks


def test_prompt_in_chunks_gives_the_logits_of_the_whole(glm_checkpoint):
    """The context fills one step and <sop> the next: the logits equal a one-step prefill."""
    kind, folder, _ = glm_checkpoint
    prompt = glm_prompts()[1]  # 30 context tokens + <sop>
    runs = {}
    for budget in (30, 512):
        recorder = Recorder()
        llm = LLM(str(folder), model=kind, plugins=[recorder], max_num_batched_tokens=budget)
        out = llm.generate([prompt], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
        runs[budget] = (out.token_ids, torch.stack(recorder.rows[0]))
        if budget == 30:
            assert llm.engine.stats.steps == 2 + 2  # context, <sop>, then two decode steps
    assert runs[30][0] == runs[512][0]
    torch.testing.assert_close(runs[30][1], runs[512][1], atol=LOGIT_ATOL, rtol=0)


# ------------------------------------------------------------------ bad input


def test_bad_glm_requests_fail_alone(glm_checkpoint):
    kind, folder, _ = glm_checkpoint
    llm = LLM(str(folder), model=kind, max_num_batched_tokens=40)
    good = glm_prompts()[0]
    outs = llm.generate([
        {"prompt_ids": good, "position_ids": [[0, 1, 2, 3, 3], [0, 0, 0, 0, 1]]},
        {"prompt_ids": [4]},
        {"prompt_ids": list(range(10, 60)) + [2]},  # a 50-token context: more than one step computes
        {"prompt_ids": good},
    ], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert "2-D position layout" in outs[0].error and "remove position_ids" in outs[0].error
    assert "at least 2 tokens" in outs[1].error
    assert "bidirectional context has 50 tokens" in outs[2].error and "max_num_batched_tokens" in outs[2].error
    assert outs[3].error is None and len(outs[3].token_ids) == 3


def test_position_ids_on_other_models_are_a_clear_error():
    out = LLM().generate([{"prompt_ids": [1, 2, 3], "position_ids": [[0, 1, 2]]}])[0]
    assert out.error.startswith("unknown request field(s): position_ids; position_ids is read by plugin ")
    assert "which does not take part in this run" in out.error
    assert "the checkpoint is LlamaForCausalLM" in out.error
