"""Paged attention for decode steps on GPU, in Triton (flash-decoding).

The context is cut into splits of ``BLOCKS_PER_SPLIT`` cache blocks. One
program handles one query token, one KV head (with the query heads that share
it, for GQA) and the splits ``lane, lane + lanes, ...`` of the token's context;
the launch has as many lanes as keep about ``LAUNCH_PROGRAMS`` programs busy,
so long contexts spread over the GPU even at batch 1 while a large batch
launches no programs for context it does not have. K/V are read straight from
the paged cache through the block table, so nothing is gathered. Each split
writes a partial result with its log-sum-exp; a second kernel merges them.
(Merging inside the decode kernel, by the lane that finishes last, was tried:
at batch 1 it cost 15 us per step more than the second launch saved, so it
is not here; bench/results/gpu/round2/profile_main_vs_new.txt.)

Each query token sees cache indices ``j <= query_cache_index[t]`` and
``j < context_lens[seq]``; inside a draft block (``j >= draft_start[seq]``)
only the draft tokens ``j - draft_start`` set in row ``t`` of ``draft_visible``
(its ancestors). That is the same rule the SDPA path builds as a dense mask.

Shapes and strides are fixed per launch configuration, so the kernel is
captured inside the decode CUDA graphs.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - not installed or broken: the SDPA path still runs everywhere
    triton = None

# Blocks one program walks. Small, so that even one short sequence spreads over many programs:
# at batch 1 a 150-token context with 16 blocks per split ran in one program per KV head (17 us per layer).
BLOCKS_PER_SPLIT = 4
# From this many (query token, KV head) pairs per launch up (batch 64 on Llama-3.2-1B's 8 KV heads), splits of
# WIDE_BLOCKS_PER_SPLIT: fewer partial results to write and merge. On the H200, batch 64 at context 1024 took 52.3
# against 65.3 us per layer, batch 256 at context 700 141.8 against 177.1; below it the short splits stay faster
# (bench/results/gpu/round2/decode_kernel_sweep.txt).
WIDE_ROWS = 512
WIDE_BLOCKS_PER_SPLIT = 16
# Blocks one loop iteration reads as a single tile (a divisor of BLOCKS_PER_SPLIT). On the H200 a whole split
# in one tile was fastest: 23.7 us per layer at batch 64 and context 256, against 30.7 us for one block per
# iteration, 154 against 254 us at batch 256 and context 700 (bench/results/gpu/decode_kernel.txt).
BLOCKS_PER_ITER = 4
# Programs launched per call, about: lanes per (token, KV head) = this over tokens x KV heads, at most the
# splits of the widest block table. At batch 1 that is every split; at batch 64, four lanes.
LAUNCH_PROGRAMS = 2048
# Triton's launch options for the decode kernel (None: Triton's defaults); bench/decode_kernel.py sweeps them.
NUM_WARPS: int | None = None
NUM_STAGES: int | None = None


def available() -> bool:
    return triton is not None


# Programmatic dependent launch (Hopper and later): zoo's Triton kernels are launched so that each may start while
# the kernel before it in the stream is still finishing, and wait inside (``griddepcontrol.wait``) for that
# kernel's writes before reading anything it may have produced. A decode step at small batch is a chain of short,
# latency-bound kernels, so the next one's launch, and the weight prefetch of a matrix product, overlap the tail
# of the one before. Every program waits, even one with nothing to do: a grid that finished without waiting could
# let the kernel after it run before the one before it. False turns it off (for A/B timings).
PDL = True


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def launches_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` are launched with programmatic dependent launch (Hopper or later, and a
    Triton that has it: 3.3 on)."""
    if not PDL or triton is None or device.type != "cuda" or not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def pdl_options(device: torch.device) -> dict:
    """Launch options and the kernels' PDL switch for a launch on ``device``."""
    return {"PDL": True, "launch_pdl": True} if launches_pdl(device) else {"PDL": False}


# Whether the decode kernel reads the first tile of its context before its PDL wait, but for the positions the
# step may write (see the kernel): that read overlaps the kernel before it. On the H200 a batch-1 decode graph
# replayed in 0.906 against 0.938 ms (medians of 7 interleaved rounds, bench/profile_gpu_step.py
# --variants current cached_first; bench/results/gpu/round12/profile_switches.txt).
CACHED_FIRST = True
# Steps from this many (query token, KV head) pairs up read nothing before the wait: there the early reads of many
# programs compete with the kernel before for memory, and the rows after it came on fell. On an H100, bench/gpu.py
# with it on everywhere against on below 64 pairs (batch 8 of Llama-3.2-1B's 8 KV heads): 892 against 885 tok/s at
# batch 1 (on in both), 5964 against 5977 at 8, 18978 against 21359 at 32, 35468 against 37907 at 64, and offline
# 27982 against 32886 (bench/results/gpu/round14/gpu_cached_first_ab_h100.json).
CACHED_FIRST_MAX_PAIRS = 64


# The partial results' strides follow the step's split count. Triton would compile a variant per stride class
# (1, a multiple of 16, other), which mixed steps of a server meet one by one, each a compile of 100+ ms in the
# middle of serving; these strides are not on the innermost dimension, so the hint buys nothing.
SPLIT_STRIDES = ("stride_ot", "stride_oh", "stride_os", "stride_lt", "stride_lh")

if triton is not None:

    @triton.jit
    def wait_for_previous_kernel(PDL: tl.constexpr):
        """Under PDL: wait until the kernel before this one has finished and its writes are visible, then let the
        next one launch. A no-op otherwise."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def _attend_tile(q, k, v, valid, m, l, acc, scale, IEEE: tl.constexpr):
        # One tile of keys and values into the running softmax (m: max, l: mass, acc: weighted values).
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit(do_not_specialize=SPLIT_STRIDES)
    def _paged_decode_kernel(
        Q, KCache, VCache, KEarly, VEarly, OutPartial, LsePartial,
        BlockTables, ContextLens, TokenSeq, QueryCacheIndex, DraftStart, DraftVisible,
        scale,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_bt, stride_vt,
        stride_ot, stride_oh, stride_os,
        stride_lt, stride_lh,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        BLOCKS_PER_SPLIT: tl.constexpr, BLOCKS_PER_ITER: tl.constexpr, HAS_TREE: tl.constexpr,
        IEEE: tl.constexpr, PDL: tl.constexpr, CACHED_FIRST: tl.constexpr,
    ):
        token = tl.program_id(0)
        kv_head = tl.program_id(1)
        lane = tl.program_id(2)
        lanes = tl.num_programs(2)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_k = tl.arange(0, BLOCK_SIZE * BLOCKS_PER_ITER)
        # CACHED_FIRST: the first tile of this lane's first split is read before the PDL wait, but for the cache
        # positions this step may write. A step's new tokens are the last of their sequence's context, at most
        # one per query token of the launch, so positions under context - tokens were written by earlier steps;
        # the step's inputs (token_seq, context_lens, block tables) come from kernels two or more launches back,
        # which have finished by the time this one starts.
        if not CACHED_FIRST:
            wait_for_previous_kernel(PDL)
        seq = tl.load(TokenSeq + token)
        last = tl.load(QueryCacheIndex + token)
        context = tl.load(ContextLens + seq)
        visible = tl.minimum(last + 1, context)
        # Graphs launch lanes for a fixed batch; a lane computes splits lane, lane + lanes, ... of this token's
        # context, so a short context leaves lanes idle and a long one loops, never launching empty programs
        # for the longest context a sequence might have.
        splits_used = tl.cdiv(visible, BLOCKS_PER_SPLIT * BLOCK_SIZE)
        if CACHED_FIRST:
            first_positions = lane * BLOCKS_PER_SPLIT * BLOCK_SIZE + offs_k
            old = (first_positions < visible) & (first_positions < context - tl.num_programs(0))
            blocks = tl.load(BlockTables + seq * stride_bt + first_positions // BLOCK_SIZE, mask=old, other=0)
            kv_offsets = (blocks[:, None] * stride_kb + (first_positions % BLOCK_SIZE)[:, None] * stride_ks
                          + kv_head * stride_kh + offs_d[None, :])
            k_old = tl.load(KEarly + kv_offsets, mask=old[:, None], other=0.0)
            v_old = tl.load(VEarly + kv_offsets, mask=old[:, None], other=0.0)
            wait_for_previous_kernel(PDL)
        heads = kv_head * GROUP + offs_g
        group_mask = offs_g < GROUP
        if lane < splits_used:
            q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                        mask=group_mask[:, None], other=0.0)
            if HAS_TREE:
                draft_start = tl.load(DraftStart + seq)
            for split in range(lane, splits_used, lanes):
                first_block = split * BLOCKS_PER_SPLIT
                m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
                l = tl.zeros([GROUP_PAD], tl.float32)
                acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
                for i in range(BLOCKS_PER_SPLIT // BLOCKS_PER_ITER):
                    tile_first = (first_block + i * BLOCKS_PER_ITER) * BLOCK_SIZE
                    if tile_first < visible:
                        # BLOCKS_PER_ITER cache blocks in one tile: more loads in flight per iteration.
                        positions = tile_first + offs_k
                        valid = positions < visible
                        late = valid
                        if CACHED_FIRST:  # read before the wait: this lane's first tile (of its first split)
                            early = old & (tile_first == lane * BLOCKS_PER_SPLIT * BLOCK_SIZE)
                            late = valid & (early == 0)
                        blocks = tl.load(BlockTables + seq * stride_bt + positions // BLOCK_SIZE, mask=late,
                                         other=0)
                        kv_offsets = (blocks[:, None] * stride_kb + (positions % BLOCK_SIZE)[:, None] * stride_ks
                                      + kv_head * stride_kh + offs_d[None, :])
                        k = tl.load(KCache + kv_offsets, mask=late[:, None], other=0.0)
                        v = tl.load(VCache + kv_offsets, mask=late[:, None], other=0.0)
                        if CACHED_FIRST:
                            k = tl.where(early[:, None], k_old, k)
                            v = tl.where(early[:, None], v_old, v)
                        if HAS_TREE:
                            offset = positions - draft_start
                            in_tree = offset >= 0
                            sees = tl.load(DraftVisible + token * stride_vt + offset, mask=valid & in_tree, other=0)
                            valid = valid & (~in_tree | (sees != 0))
                        m, l, acc = _attend_tile(q, k, v, valid, m, l, acc, scale, IEEE)
                l_safe = tl.where(l > 0, l, 1.0)
                out = acc / l_safe[:, None]
                lse = tl.where(l > 0, m + tl.log(l_safe), float("-inf"))
                tl.store(OutPartial + token * stride_ot + heads[:, None] * stride_oh + split * stride_os
                         + offs_d[None, :], out, mask=group_mask[:, None])
                tl.store(LsePartial + token * stride_lt + heads * stride_lh + split, lse, mask=group_mask)


if triton is not None:

    @triton.jit(do_not_specialize=SPLIT_STRIDES)
    def _merge_splits_kernel(OutPartial, LsePartial, Out, TokenSeq, QueryCacheIndex, ContextLens,
                             stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_t, stride_h,
                             HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
                             PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        visible = tl.minimum(tl.load(QueryCacheIndex + token) + 1, tl.load(ContextLens + tl.load(TokenSeq + token)))
        valid = offs_s * SPLIT_TOKENS < visible  # the splits the decode kernel wrote
        lse = tl.load(LsePartial + token * stride_lt + head * stride_lh + offs_s, mask=valid, other=float("-inf"))
        weights = tl.exp(lse - tl.max(lse, 0))  # split 0 always sees a token, so the max is finite
        weights = weights / tl.sum(weights, 0)
        partial = tl.load(OutPartial + token * stride_ot + head * stride_oh + offs_s[:, None] * stride_os
                          + offs_d[None, :], mask=valid[:, None], other=0.0)
        out = tl.sum(partial * weights[:, None], 0)
        tl.store(Out + token * stride_t + head * stride_h + offs_d, out.to(Out.dtype.element_ty))


def paged_decode_attention(q, key_cache, value_cache, block_tables, context_lens, token_seq, query_cache_index,
                           draft_start, draft_visible, scale: float, has_tree: bool,
                           caches_before_step: tuple | None = None) -> torch.Tensor:
    """q: [T, H, D]; caches: [blocks, block_size, Hkv, D]; draft_visible: [T, max_draft] int8 or None.
    ``caches_before_step``: where CACHED_FIRST's early reads go, the caches themselves unless a test passes copies
    without this step's tokens.

    Returns [T, H, D] in q's dtype.
    """
    early_key, early_value = caches_before_step or (key_cache, value_cache)
    if draft_visible is None:  # no drafts this step: the kernel never reads it
        draft_visible = token_seq[:, None]
    tokens, heads, head_dim = q.shape
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    blocks_per_split = WIDE_BLOCKS_PER_SPLIT if tokens * kv_heads >= WIDE_ROWS else BLOCKS_PER_SPLIT
    num_splits = -(-block_tables.shape[1] // blocks_per_split)
    out_partial = torch.empty(tokens, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    lse_partial = torch.empty(tokens, heads, num_splits, dtype=torch.float32, device=q.device)
    if q.stride(-1) != 1:
        q = q.contiguous()
    lanes = min(num_splits, max(1, -(-LAUNCH_PROGRAMS // (tokens * kv_heads))))
    _paged_decode_kernel[(tokens, kv_heads, lanes)](
        q, key_cache, value_cache, early_key, early_value, out_partial, lse_partial,
        block_tables, context_lens, token_seq, query_cache_index, draft_start, draft_visible,
        scale,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), draft_visible.stride(0),
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCKS_PER_SPLIT=blocks_per_split, BLOCKS_PER_ITER=BLOCKS_PER_ITER, HAS_TREE=has_tree,
        IEEE=q.dtype == torch.float32, CACHED_FIRST=CACHED_FIRST and tokens * kv_heads < CACHED_FIRST_MAX_PAIRS,
        **pdl_options(q.device),
        **({"num_warps": NUM_WARPS} if NUM_WARPS else {}), **({"num_stages": NUM_STAGES} if NUM_STAGES else {}),
    )
    # Merge the splits: weight each by its share of the total softmax mass. At least 16 split slots: steps whose
    # block tables differ in width (mixed steps) then share one compiled variant instead of one per power of two.
    out = torch.empty_like(q)
    _merge_splits_kernel[(tokens, heads)](
        out_partial, lse_partial, out, token_seq, query_cache_index, context_lens,
        out_partial.stride(0), out_partial.stride(1), out_partial.stride(2),
        lse_partial.stride(0), lse_partial.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=max(16, triton.next_power_of_2(num_splits)),
        SPLIT_TOKENS=blocks_per_split * block_size, **pdl_options(q.device))
    return out
