"""Interleaved A/B of the gather in masked_attention: LLM.generate, 256 prompts at max_num_seqs 64, 1 thread."""
import random, time, statistics, sys, torch, torch.nn.functional as F
import zoo.model as M
from zoo import LLM, SamplingParams
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
new = M.masked_attention
def old(q, key_cache, value_cache, block_tables, mask, seq, query_index, longest, scale):
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    keys = key_cache[block_tables].flatten(1, 2).transpose(1, 2)
    values = value_cache[block_tables].flatten(1, 2).transpose(1, 2)
    if longest == 1:
        queries = q[:, None]
    else:
        queries = q.new_zeros(block_tables.shape[0], longest, q.shape[1], head_dim)
        queries[seq, query_index] = q
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != num_kv_heads).transpose(1, 2)
    return out[:, 0] if longest == 1 else out[seq, query_index]
WORDS = ["def", "class", "import", "return", "for", "while", "if", "self", "print", "yield", "lambda", "(", ")"]
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(256)]
llm = LLM(max_num_seqs=64)
params = SamplingParams(max_new_tokens=64, ignore_eos=True)
llm.generate(prompts[:64], params)
res = {"old": [], "new": []}
outs = {}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 4):
    for name, fn in (("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old)):
        M.masked_attention = fn
        t = time.perf_counter(); o = llm.generate(prompts, params)
        res[name].append(sum(len(x.token_ids) for x in o) / (time.perf_counter() - t))
        outs[name] = [x.token_ids for x in o]
print("same tokens:", outs["old"] == outs["new"])
for k, v in res.items():
    print(k, "median %.0f" % statistics.median(v), [round(x) for x in v])
