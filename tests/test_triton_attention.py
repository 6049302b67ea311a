"""The Triton paged decode kernel against dense attention in float64.

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported); on a GPU run of the suite it runs compiled.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")  # conftest chose the interpreter on CPU

from zoo import triton_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, key_cache, value_cache, tables, context_lens, token_seq, query_index, draft_start, visible, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // key_cache.shape[2]
    bs = key_cache.shape[1]
    for t in range(q.shape[0]):
        b = int(token_seq[t])
        n = int(context_lens[b])
        slots = [int(tables[b, j // bs]) * bs + j % bs for j in range(n)]
        k = key_cache.reshape(-1, *key_cache.shape[2:])[slots].double()
        v = value_cache.reshape(-1, *value_cache.shape[2:])[slots].double()
        allowed = torch.tensor([j <= int(query_index[t]) and (j < int(draft_start[b]) or
                                bool(visible[t, j - int(draft_start[b])])) for j in range(n)])
        for h in range(q.shape[1]):
            scores = (k[:, h // group] @ q[t, h].double()) * scale
            scores[~allowed] = float("-inf")
            out[t, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 8)])
# launch_programs 1: one lane per (token, KV head), which loops over every split of the context;
# wide_rows 1: the wide splits (WIDE_BLOCKS_PER_SPLIT blocks) that large batches take
# cached_first: each lane's first tile read before the PDL wait, but for the positions the step may write; "wide":
# on, in a step of as many (token, KV head) pairs as CACHED_FIRST_MAX_PAIRS, from which it reads nothing early
@pytest.mark.parametrize("blocks_per_iter, launch_programs, wide_rows, cached_first",
                         [(*launch, cached_first) for launch in [(1, 2048, 512), (2, 2048, 512), (4, 2048, 512),
                                                                 (4, 1, 512), (4, 2048, 1), (2, 1, 1)]
                          for cached_first in (False, True)] + [(4, 2048, 512, "wide")])
def test_kernel_matches_dense_attention(dtype, tol, heads, kv_heads, blocks_per_iter, launch_programs, wide_rows,
                                        cached_first, monkeypatch):
    monkeypatch.setattr(triton_attention, "CACHED_FIRST", bool(cached_first))
    monkeypatch.setattr(triton_attention, "CACHED_FIRST_MAX_PAIRS", 7 * kv_heads if cached_first == "wide" else 64)
    monkeypatch.setattr(triton_attention, "BLOCKS_PER_ITER", blocks_per_iter)
    monkeypatch.setattr(triton_attention, "LAUNCH_PROGRAMS", launch_programs)
    monkeypatch.setattr(triton_attention, "WIDE_ROWS", wide_rows)
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's interpreter computes bf16 dot products wrongly; checked on the GPU run")
    g = torch.Generator().manual_seed(heads + kv_heads)
    bs, head_dim, num_blocks = 16, 32, 40
    key_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=g).to(dtype)
    # three sequences: a long plain decode (spans two splits), a short one, and one verifying a draft tree
    lengths = [300, 5, 40]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(3, 20, dtype=torch.int64)
    used = 0
    for b, n in enumerate(lengths):
        need = -(-n // bs)
        tables[b, :need] = torch.tensor(perm[used:used + need])
        used += need
    # seq 2: committed context 35, then the last committed token and a 4-node tree at indices 35..39
    parents = [-1, -1, 0, 2]
    visible = torch.zeros(7, 4, dtype=torch.int8)  # rows 3..6 are the draft tokens; each sees its ancestors
    for i in range(4):
        node = i
        while node >= 0:
            visible[3 + i, node] = 1
            node = parents[node]
    token_seq = torch.tensor([0, 1, 2, 2, 2, 2, 2])
    query_index = torch.tensor([299, 4, 35, 36, 37, 38, 39])
    draft_start = torch.tensor([300, 5, 36])
    context_lens = torch.tensor(lengths)
    q = torch.randn(len(token_seq), heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    expected = reference(q, key_cache, value_cache, tables, context_lens, token_seq, query_index, draft_start,
                         visible, scale)
    args = [x.to(DEVICE) for x in (q, key_cache, value_cache, tables, context_lens, token_seq, query_index,
                                   draft_start, visible)]
    # What the kernel may read before its PDL wait (CACHED_FIRST) comes from copies whose slots of this step's
    # tokens (each sequence's last ones, one per query token) are NaN, as if the kernel before had not yet
    # written them: the result must not see them.
    new_tokens = torch.bincount(token_seq, minlength=len(lengths))
    before_step = [cache.clone() for cache in (key_cache, value_cache)]
    for b, n in enumerate(lengths):
        for j in range(n - int(new_tokens[b]), n):
            for cache in before_step:
                cache[tables[b, j // bs], j % bs] = float("nan")
    early = [cache.to(DEVICE) for cache in before_step]
    got = triton_attention.paged_decode_attention(*args, scale=scale, has_tree=True,
                                                  caches_before_step=early).cpu().double()
    rel = (got - expected).norm() / expected.norm()
    assert rel < tol, rel
    # and the early reads happen: an old slot spoiled in those copies alone shows in the result only then
    for cache in early:
        cache[tables[0, 0], 0] = float("nan")
    spoiled = triton_attention.paged_decode_attention(*args, scale=scale, has_tree=True, caches_before_step=early)
    assert bool(spoiled[0].isnan().any()) == (cached_first is True)
