"""Interleaved A/B/C of zoo.model.masked_attention's gather and decode call: LLM.generate of 256 prompts at
max_num_seqs 64 on the embedded model, greedy; each variant patched in for its runs.

    python bench/results/cpu_attention/ab_masked_attention.py THREADS ROUNDS
"""
import random
import statistics
import sys

import time

import torch
import torch.nn.functional as F

import zoo.model as M
from zoo import LLM, SamplingParams


def gathered(key_cache, value_cache, block_tables, by_index_select):
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    if not by_index_select:  # what zoo did before: advanced indexing
        return (key_cache[block_tables].flatten(1, 2).transpose(1, 2),
                value_cache[block_tables].flatten(1, 2).transpose(1, 2))
    blocks, width = block_tables.flatten(), block_tables.shape[1] * key_cache.shape[1]
    return (key_cache.index_select(0, blocks).view(-1, width, num_kv_heads, head_dim).transpose(1, 2),
            value_cache.index_select(0, blocks).view(-1, width, num_kv_heads, head_dim).transpose(1, 2))


def unpacked(by_index_select):
    """masked_attention with one query row per query head (enable_gqa) at decode, and the given gather."""
    def attention(q, key_cache, value_cache, block_tables, mask, seq, query_index, longest, scale):
        num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        keys, values = gathered(key_cache, value_cache, block_tables, by_index_select)
        if longest == 1:
            queries = q[:, None]
        else:
            queries = q.new_zeros(block_tables.shape[0], longest, q.shape[1], head_dim)
            queries[seq, query_index] = q
        out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != num_kv_heads).transpose(1, 2)
        return out[:, 0] if longest == 1 else out[seq, query_index]
    return attention


VARIANTS = {"advanced indexing, enable_gqa (before)": unpacked(False), "index_select, enable_gqa": unpacked(True),
            "index_select, packed GQA (zoo now)": M.masked_attention}
torch.set_num_threads(int(sys.argv[1]))
WORDS = ["def", "class", "import", "return", "for", "while", "if", "self", "print", "yield", "lambda", "(", ")"]
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(256)]
llm = LLM(max_num_seqs=64)
params = SamplingParams(max_new_tokens=64, ignore_eos=True)
llm.generate(prompts[:64], params)
rates, outputs = {name: [] for name in VARIANTS}, {}
names = list(VARIANTS)
for r in range(int(sys.argv[2])):
    for name in names[r % 3:] + names[:r % 3]:  # each variant first in turn
        M.masked_attention = VARIANTS[name]
        start = time.perf_counter()
        out = llm.generate(prompts, params)
        rates[name].append(sum(len(o.token_ids) for o in out) / (time.perf_counter() - start))
        outputs[name] = [o.token_ids for o in out]
print("same tokens:", all(o == outputs[names[0]] for o in outputs.values()))
for name, values in rates.items():
    print(f"{name}: median {statistics.median(values):.0f} output tok/s ({', '.join(f'{v:.0f}' for v in values)})")
