"""Fused element-wise kernels for the GPU path, in Triton.

A decode step at small batch is a chain of short kernels; unfused, RMSNorm,
rotary, the cache write and SiLU-and-mul were about 20 launches per layer on
the H200 (``bench/results/gpu/profile_step_latest.txt``). Each kernel here
replaces several of them and rounds at the same points as the PyTorch ops it
replaces, so bf16 results match the eager path bit for bit except where
Triton's ``exp``/``cos`` differ from PyTorch's by an ulp before rounding.

``linear`` streams a weight matrix through a Triton kernel at the few rows of
a decode step; the model uses it for the LM head, where it beat cuBLAS on the
H200 by 5% (bench/results/gpu/round2/gemv.txt), and ``projection`` for the
layers' projections at up to 4 rows, where it wins only under programmatic
dependent launch (see PROJECTION_GEMV_MAX_ROWS). ``argmax`` replaces torch's
single-block reduction of a long row inside the decode graphs.

The model uses them only when the runner turns them on (CUDA with triton);
on CPU the PyTorch ops run. Tests check each kernel against those ops in
Triton's interpreter.
"""

from __future__ import annotations

import functools

import torch

from zoo.triton_attention import pdl_options, triton

if triton is not None:
    import triton.language as tl

    from zoo.triton_attention import wait_for_previous_kernel


def available() -> bool:
    return triton is not None


# Rows up to which ``linear`` runs the weight-streaming kernel; past it cuBLAS's tiled GEMMs win (on the LM head
# of a 128k vocabulary: 1.02 to 1.05 times cuBLAS's speed up to 32 rows, 0.94 at 64). 0 turns the kernel off.
GEMV_MAX_ROWS = 32
# The same for the layers' projections (``projection``). Alone, the kernel and cuBLAS tie on them; under
# programmatic dependent launch (triton_attention.PDL) the kernel overlaps the kernels around it, which cuBLAS's
# do not. Decode graph replays on the H200 against cuBLAS's, both under PDL: 1.058x faster at 1 row, 1.041x at 2,
# 1.008x at 4, 0.988x at 8 (bench/results/gpu/round6/profile_pdl_rows.txt).
PROJECTION_GEMV_MAX_ROWS = 4
# Whether rotary with the cache write, and SiLU-and-mul, run in the epilogue of the product before them
# (``qkv_rope_and_write_cache``, ``gate_up_silu``) wherever ``projection`` would stream that product's weights:
# 32 launches fewer per decode step of a 16-layer model. In bf16 the H200 gave the separate kernels' bits, but for
# rotary's one ulp, since removed with EXACT_ROUNDING (below; the bit tests passed on the H200 in round 9);
# float32 parts in its last bits.
FOLD_INTO_PROJECTIONS = True
# Whether an overlapped decode step's inputs advance in one kernel (``advance_decode_rows``) instead of about ten
# PyTorch ops, each a launch the host pays for in every step. The same integers either way (checked on CPU in
# Triton's interpreter, and compiled for sm_90 by bench/compile_sm90.py). Graph replays do not show it (round 9:
# 0.988x); the engine's steps do: on the H200, 1039 against 1020 and 1021 tok/s at batch 1 and 44798 against 44069
# and 43807 at batch 64, same tokens (`bench/gpu.py --compare-switch fused_ops.ADVANCE_KERNEL`,
# bench/results/gpu/round12/gpu_compare_advance.md).
ADVANCE_KERNEL = True
# Whether a step of prompts and chunks laid out on the device (``step_inputs.StepLayout.runs``) derives its per-token
# inputs in one kernel (``lay_out_runs``) instead of about twenty PyTorch ops: the host's launches of those ops come
# before the step's first kernel, with the GPU idle.
RUNS_KERNEL = True
# (BLOCK_N, BLOCK_K, num_stages, num_warps) by output width, the best of a sweep on the H200 (gemv.txt): narrow
# outputs take narrow tiles, so that even a 2048-wide product spreads over every SM.
GEMV_CONFIGS = {2048: (16, 512, 3, 4), 4096: (32, 512, 3, 4), 1 << 62: (64, 128, 3, 4)}
# Tiles for a step of one row where they differ from those above, keyed by (output width, depth K): the first key,
# in sorted order, that covers both. A BLOCK_N under 16 streams without tensor cores (tl.dot takes 16 columns at
# least; the products are summed in float32), so that a narrow matrix spreads over more programs. Round 11's sweep
# with weights that L2 cannot hold, as in a decode step, under WEIGHTS_FIRST (`bench/gemv_kernel.py --one-row-sweep
# --cold` on the H200, bench/results/gpu/round11/gemv_one_row_sweep_cold_h200.txt): a whole 2048-deep row per tile,
# so that all of a program's weights load before its PDL wait, took q/k/v from 5.57 to 3.9 us and o from 4.48 to
# 3.16; the 8192-deep down product took 4 columns by 2048 from 15.03 to 10.71 us; gate/up keeps GEMV_CONFIGS'
# tile. A batch-1 decode graph replayed in 0.9330 against 1.0165 ms with WEIGHTS_FIRST alone (1.089x; 1.167x
# against round 10's kernels; 7 interleaved rounds, bench/results/gpu/round11/profile_deep_rows_h200.txt).
GEMV_ONE_ROW_CONFIGS: dict[tuple[int, int], tuple] = {(4096, 2048): (8, 2048, 3, 2),
                                                       (4096, 1 << 62): (4, 2048, 3, 4)}


# Whether the weight-streaming kernels load their first weight tile before waiting for the kernel before them
# (programmatic dependent launch): weights are never written inside a step, so that tile streams while the
# kernel before finishes, and a product after a short kernel (attention, a norm) starts with part of its bytes in.
WEIGHTS_FIRST = True


# Whether a step's first kernels, the token embedding (with its clamp of ids past the vocabulary) and the rotary
# tables (positions to cos and sin: seven PyTorch ops), run as two Triton launches under programmatic dependent
# launch instead of nine PyTorch kernels, which a graph replays one after another without overlap. The same bits:
# the tables take CUDA's cosf and sinf, as PyTorch's kernels do.
STEP_INPUT_KERNELS = True


# Launch option of the rotary kernels: with Triton's default floating-point fusion, LLVM contracted one of
# rotary's two rounded products into the add (fma.rn.bf16 in the PTX), so the result skipped a rounding that
# PyTorch's ops make, and which product it took depended on the kernel: the rotary in the q/k/v epilogue then
# parted from the rotary kernel by one bf16 ulp in 13% of the elements on the H200
# (bench/results/gpu/round8/pytest_cuda_call1.txt). Without fusion each operation rounds as written.
EXACT_ROUNDING = {"enable_fp_fusion": False}


def gemv_config(n: int, rows: int | None = None, k: int = 0) -> tuple:
    """(BLOCK_N, BLOCK_K, num_stages, num_warps) for an output ``n`` wide and ``k`` deep: at one row
    GEMV_ONE_ROW_CONFIGS' where a key covers ``n`` and ``k``, else GEMV_CONFIGS'."""
    if rows == 1:
        one_row = next((config for (width, depth), config in sorted(GEMV_ONE_ROW_CONFIGS.items())
                        if n <= width and k <= depth), None)
        if one_row is not None:
            return one_row
    return next(config for width, config in sorted(GEMV_CONFIGS.items()) if n <= width)


def row_tile(rows: int, block_n: int) -> dict:
    """BLOCK_M and DOT of a product's tile ``block_n`` columns wide: tensor cores (tl.dot) take 16 rows and 16
    columns at least; a narrower tile multiplies and sums in float32 over the step's rows alone."""
    if block_n >= 16:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), DOT=True)
    return dict(BLOCK_M=triton.next_power_of_2(rows), DOT=False)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, Residual, Weight, Out, Summed, stride_x, stride_r, stride_o, stride_s, n_cols, eps,
                             HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                             X_ACCUMULATED: tl.constexpr = False):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        valid = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=valid, other=0.0)
        if X_ACCUMULATED:  # mlp_split_k's float32 sums: rounded as the product would have been, then zeroed for
            # the next layer's (every kernel in between waits for this one to finish)
            x = x.to(Summed.dtype.element_ty)
            tl.store(X + row * stride_x + cols, tl.zeros([BLOCK], tl.float32), mask=valid)
        if HAS_RESIDUAL:
            # The residual add rounds to the model dtype before the norm reads it, as in eager PyTorch.
            x = (x.to(tl.float32) + tl.load(Residual + row * stride_r + cols, mask=valid, other=0.0).to(tl.float32))
            x = x.to(Summed.dtype.element_ty)
            tl.store(Summed + row * stride_s + cols, x, mask=valid)
        elif X_ACCUMULATED:
            tl.store(Summed + row * stride_s + cols, x, mask=valid)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, 0) / n_cols
        normed = (xf * tl.rsqrt(variance + eps)).to(Out.dtype.element_ty)
        weight = tl.load(Weight + cols, mask=valid, other=0.0)
        tl.store(Out + row * stride_o + cols,
                 (normed.to(tl.float32) * weight.to(tl.float32)).to(Out.dtype.element_ty), mask=valid)

    @triton.jit
    def _rotate_half(x1, x2, c1, c2, s1, s2, DTYPE: tl.constexpr):
        # x*cos + rotate_half(x)*sin with rotate_half(x) = (-x2, x1); each product rounds like the eager ops.
        out1 = (x1 * c1).to(DTYPE).to(tl.float32) + (-x2 * s1).to(DTYPE).to(tl.float32)
        out2 = (x2 * c2).to(DTYPE).to(tl.float32) + (x1 * s2).to(DTYPE).to(tl.float32)
        return out1.to(DTYPE), out2.to(DTYPE)

    @triton.jit
    def _rope_cache_write_kernel(Q, K, V, Cos, Sin, KCache, VCache, SlotMapping,
                                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                 stride_ct, stride_cs, stride_ch,
                                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                                 HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr,
                                 HALF: tl.constexpr, HAS_ROPE: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0)
        dtype = Q.dtype.element_ty
        offs_d = tl.arange(0, HALF)
        offs_h = tl.arange(0, HEADS_PAD)
        offs_kh = tl.arange(0, KV_HEADS_PAD)
        q_mask = (offs_h < NUM_HEADS)[:, None]
        kv_mask = (offs_kh < NUM_KV_HEADS)[:, None]
        k_ptr = K + token * stride_kt + offs_kh[:, None] * stride_kh + offs_d[None, :]
        k1 = tl.load(k_ptr, mask=kv_mask, other=0.0)
        k2 = tl.load(k_ptr + HALF, mask=kv_mask, other=0.0)
        if HAS_ROPE:
            c1 = tl.load(Cos + token * stride_ct + offs_d).to(tl.float32)[None, :]
            c2 = tl.load(Cos + token * stride_ct + HALF + offs_d).to(tl.float32)[None, :]
            s1 = tl.load(Sin + token * stride_ct + offs_d).to(tl.float32)[None, :]
            s2 = tl.load(Sin + token * stride_ct + HALF + offs_d).to(tl.float32)[None, :]
            q_ptr = Q + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
            q1 = tl.load(q_ptr, mask=q_mask, other=0.0).to(tl.float32)
            q2 = tl.load(q_ptr + HALF, mask=q_mask, other=0.0).to(tl.float32)
            q1, q2 = _rotate_half(q1, q2, c1, c2, s1, s2, dtype)
            tl.store(q_ptr, q1, mask=q_mask)
            tl.store(q_ptr + HALF, q2, mask=q_mask)
            k1, k2 = _rotate_half(k1.to(tl.float32), k2.to(tl.float32), c1, c2, s1, s2, dtype)
        slot = tl.load(SlotMapping + token)
        cache_offsets = slot * stride_cs + offs_kh[:, None] * stride_ch + offs_d[None, :]
        tl.store(KCache + cache_offsets, k1.to(KCache.dtype.element_ty), mask=kv_mask)
        tl.store(KCache + cache_offsets + HALF, k2.to(KCache.dtype.element_ty), mask=kv_mask)
        v_ptr = V + token * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
        tl.store(VCache + cache_offsets, tl.load(v_ptr, mask=kv_mask, other=0.0).to(VCache.dtype.element_ty),
                 mask=kv_mask)
        tl.store(VCache + cache_offsets + HALF,
                 tl.load(v_ptr + HALF, mask=kv_mask, other=0.0).to(VCache.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _embedding_kernel(Ids, Weight, Out, vocab, hidden, stride_i, stride_w, stride_o, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < hidden
        row = tl.minimum(tl.load(Ids + token * stride_i), vocab - 1)
        tl.store(Out + token * stride_o + cols, tl.load(Weight + row * stride_w + cols, mask=valid), mask=valid)

    @triton.jit
    def _rotary_tables_kernel(Positions, InvFreq, Cos, Sin, half, stride_p, stride_t, BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        token = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        valid = offs < half
        # as rotate_half_tables: the position as float32 times each inverse frequency, one rounding
        freqs = tl.load(Positions + token * stride_p).to(tl.float32) * tl.load(InvFreq + offs, mask=valid, other=0.0)
        # On CUDA tl.cos and tl.sin call libdevice's cosf and sinf, as PyTorch's kernels do, not the approximate
        # instructions, whose error grows with the argument (positions reach 10^5 radians)
        cos, sin = tl.cos(freqs).to(Cos.dtype.element_ty), tl.sin(freqs).to(Sin.dtype.element_ty)
        for start in tl.static_range(2):  # the table holds the frequencies twice, [freqs, freqs]
            tl.store(Cos + token * stride_t + start * half + offs, cos, mask=valid)
            tl.store(Sin + token * stride_t + start * half + offs, sin, mask=valid)

    @triton.jit
    def _silu_mul_kernel(GateUp, Out, stride_g, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = cols < n_cols
        dtype = Out.dtype.element_ty
        gate = tl.load(GateUp + row * stride_g + cols, mask=valid, other=0.0).to(tl.float32)
        up = tl.load(GateUp + row * stride_g + n_cols + cols, mask=valid, other=0.0).to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu rounds before the product
        tl.store(Out + row * stride_o + cols, (activated * up).to(dtype), mask=valid)


if triton is not None:

    @triton.jit
    def _tile_product(acc, x, w, IEEE: tl.constexpr, DOT: tl.constexpr):
        if not DOT:  # a tile narrower than tensor cores take (see row_tile)
            return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        elif IEEE:  # float32 models: no TF32 rounding of the operands
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            return acc + tl.dot(x, tl.trans(w))

    @triton.jit
    def _stream_product(X, W, cols, col_ok, offs_m, row_ok, k, stride_x, stride_w,
                        IEEE: tl.constexpr, DOT: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
        # x [rows, k] times the weight rows ``cols`` over the whole of K, accumulated in float32. Waits for the
        # kernel before (PDL) after loading the first weight tile when WEIGHTS_FIRST: no kernel of a step writes
        # weights, so their first bytes may stream while that kernel finishes.
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        w_first = W + cols[:, None] * stride_w + offs_k[None, :]
        if WEIGHTS_FIRST:
            w = tl.load(w_first, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            wait_for_previous_kernel(PDL)
        else:
            wait_for_previous_kernel(PDL)
            w = tl.load(w_first, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_x + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _tile_product(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), x, w, IEEE, DOT)
        for start in range(BLOCK_K, k, BLOCK_K):
            ks = start + offs_k
            k_ok = ks < k
            w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(X + offs_m[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _tile_product(acc, x, w, IEEE, DOT)
        return acc

    @triton.jit
    def _gemv_kernel(X, W, Bias, Out, rows, n, k, stride_x, stride_w, stride_o,
                     HAS_BIAS: tl.constexpr, ROUND_TO: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     WEIGHTS_FIRST: tl.constexpr):
        # One program: BLOCK_N output columns for every row, over the whole of K, so no partial sums leave it.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        col_ok = cols < n
        # (Prefetching all of this program's weights into L2 before the wait was tried: 0.3% at batch 1 for the
        # first 512 columns, 19% slower for all of them, profile_pdl_ab.txt. WEIGHTS_FIRST loads one tile.)
        acc = _stream_product(X, W, cols, col_ok, offs_m, row_ok, k, stride_x, stride_w, IEEE, DOT, BLOCK_M, BLOCK_N,
                              BLOCK_K, PDL, WEIGHTS_FIRST)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out = acc.to(ROUND_TO).to(Out.dtype.element_ty)  # logits: rounded to the weights' dtype, stored wider
        tl.store(Out + offs_m[:, None] * stride_o + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _paired_product(X, W, Bias, first, second, n, rows, k, stride_x, stride_w,
                        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                        PAIR: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
        """Weight rows ``first + i`` and ``second + i`` (i < PAIR, first + i < n) as one tile, so that one program
        holds both halves of what an epilogue combines; returns them apart, rounded to the weights' dtype."""
        i = tl.arange(0, 2 * PAIR)
        cols = tl.where(i < PAIR, first + i, second + i - PAIR)
        col_ok = first + i % PAIR < n
        offs_m = tl.arange(0, BLOCK_M)
        acc = _stream_product(X, W, cols, col_ok, offs_m, offs_m < rows, k, stride_x, stride_w,
                              IEEE, DOT, BLOCK_M, 2 * PAIR, BLOCK_K, PDL, WEIGHTS_FIRST)
        if HAS_BIAS:
            acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc = acc.to(W.dtype.element_ty)
        return tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, PAIR]), [0, 2, 1]))

    @triton.jit
    def _gate_up_silu_tile(X, W, Bias, first, rows, half, k, stride_x, stride_w,
                           HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                           PAIR: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
        # W = [gate; up], each ``half`` rows: silu(gate) * up for gate rows first + i and the up rows that go with
        # them (i < PAIR), [BLOCK_M, PAIR] in X's dtype
        gate, up = _paired_product(X, W, Bias, first, half + first, half, rows, k, stride_x, stride_w,
                                   HAS_BIAS, IEEE, DOT, BLOCK_M, PAIR, BLOCK_K, PDL, WEIGHTS_FIRST)
        dtype = X.dtype.element_ty
        gate = gate.to(tl.float32)
        activated = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as in _silu_mul_kernel
        return (activated * up.to(tl.float32)).to(dtype)

    @triton.jit
    def _gate_up_silu_kernel(X, W, Bias, Out, rows, half, k, stride_x, stride_w, stride_o,
                             HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr,
                             PAIR: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                             WEIGHTS_FIRST: tl.constexpr):
        first = tl.program_id(0) * PAIR
        act = _gate_up_silu_tile(X, W, Bias, first, rows, half, k, stride_x, stride_w,
                                 HAS_BIAS, IEEE, DOT, BLOCK_M, PAIR, BLOCK_K, PDL, WEIGHTS_FIRST)
        offs_m = tl.arange(0, BLOCK_M)
        cols = first + tl.arange(0, PAIR)
        tl.store(Out + offs_m[:, None] * stride_o + cols[None, :], act.to(Out.dtype.element_ty),
                 mask=(offs_m < rows)[:, None] & (cols < half)[None, :])

    @triton.jit
    def _mlp_split_k_kernel(X, W, Down, Acc, rows, half, k, hidden, stride_x, stride_w, stride_d, stride_a,
                            IEEE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, PAIR: tl.constexpr,
                            BLOCK_K: tl.constexpr, OUT_TILE: tl.constexpr, DOWN_DOT: tl.constexpr,
                            PDL: tl.constexpr, WEIGHTS_FIRST: tl.constexpr):
        # The whole MLP of a decode step, split over its intermediate columns: this program's PAIR gate and up rows
        # (with SiLU), then its PAIR columns of the down projection times them, added into the float32 sums Acc.
        # Nothing waits for all of gate/up to finish before down starts, so one launch streams both.
        first = tl.program_id(0) * PAIR
        act = _gate_up_silu_tile(X, W, W, first, rows, half, k, stride_x, stride_w,  # what gate_up_silu stores
                                 False, IEEE, DOT, BLOCK_M, PAIR, BLOCK_K, PDL, WEIGHTS_FIRST)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        cols = first + tl.arange(0, PAIR)
        col_ok = cols < half
        for start in range(0, hidden, OUT_TILE):
            outs = start + tl.arange(0, OUT_TILE)
            out_ok = outs < hidden
            w = tl.load(Down + outs[:, None] * stride_d + cols[None, :], mask=out_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if DOWN_DOT:
                partial = tl.dot(act, tl.trans(w), input_precision="ieee") if IEEE else tl.dot(act, tl.trans(w))
            else:
                partial = tl.sum(act.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], 2)
            tl.atomic_add(Acc + offs_m[:, None] * stride_a + outs[None, :], partial,
                          mask=row_ok[:, None] & out_ok[None, :], sem="relaxed")

    @triton.jit
    def _qkv_rope_cache_kernel(X, W, Bias, Q, Cos, Sin, KCache, VCache, SlotMapping, rows, k,
                               stride_x, stride_w, stride_q, stride_ct, stride_cs, stride_ch,
                               NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                               HAS_ROPE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, DOT: tl.constexpr,
                               BLOCK_M: tl.constexpr, PAIR: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                               WEIGHTS_FIRST: tl.constexpr):
        # W = [q; k; v] by heads of 2 * HALF rows. A program takes PAIR columns of one head's first half and the
        # PAIR that rotate with them, so rotary and the cache write run on the product before it is stored.
        head = tl.program_id(0) // (HALF // PAIR)
        start = (tl.program_id(0) % (HALF // PAIR)) * PAIR  # of this program's run in the head's first half
        offs_d = start + tl.arange(0, PAIR)
        first = head * 2 * HALF + start
        x1, x2 = _paired_product(X, W, Bias, first, first + HALF, (NUM_HEADS + 2 * NUM_KV_HEADS) * 2 * HALF,
                                 rows, k, stride_x, stride_w, HAS_BIAS, IEEE, DOT, BLOCK_M, PAIR, BLOCK_K, PDL,
                                 WEIGHTS_FIRST)
        offs_m = tl.arange(0, BLOCK_M)
        row_ok = (offs_m < rows)[:, None]
        dtype = Q.dtype.element_ty
        if HAS_ROPE:
            if head < NUM_HEADS + NUM_KV_HEADS:  # queries and keys rotate; values do not
                table = offs_m[:, None] * stride_ct + offs_d[None, :]
                c1 = tl.load(Cos + table, mask=row_ok, other=0.0).to(tl.float32)
                c2 = tl.load(Cos + table + HALF, mask=row_ok, other=0.0).to(tl.float32)
                s1 = tl.load(Sin + table, mask=row_ok, other=0.0).to(tl.float32)
                s2 = tl.load(Sin + table + HALF, mask=row_ok, other=0.0).to(tl.float32)
                x1, x2 = _rotate_half(x1.to(tl.float32), x2.to(tl.float32), c1, c2, s1, s2, dtype)
        if head < NUM_HEADS:
            q_ptr = Q + offs_m[:, None] * stride_q + head * 2 * HALF + offs_d[None, :]
            tl.store(q_ptr, x1, mask=row_ok)
            tl.store(q_ptr + HALF, x2, mask=row_ok)
        else:
            slot = tl.load(SlotMapping + offs_m, mask=offs_m < rows, other=0)
            if head < NUM_HEADS + NUM_KV_HEADS:
                cache_ptr = KCache + slot[:, None] * stride_cs + (head - NUM_HEADS) * stride_ch + offs_d[None, :]
                tl.store(cache_ptr, x1.to(KCache.dtype.element_ty), mask=row_ok)
                tl.store(cache_ptr + HALF, x2.to(KCache.dtype.element_ty), mask=row_ok)
            else:
                kv_head = head - NUM_HEADS - NUM_KV_HEADS
                cache_ptr = VCache + slot[:, None] * stride_cs + kv_head * stride_ch + offs_d[None, :]
                tl.store(cache_ptr, x1.to(VCache.dtype.element_ty), mask=row_ok)
                tl.store(cache_ptr + HALF, x2.to(VCache.dtype.element_ty), mask=row_ok)


    @triton.jit
    def _first_max(values, indices, none):
        # The largest value and the lowest index holding it, as torch.argmax picks among ties.
        best = tl.max(values, 0)
        return best, tl.min(tl.where(values == best, indices, none), 0)

    @triton.jit
    def _argmax_chunk_kernel(Logits, Values, Indices, n, stride, chunks, BLOCK: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(Logits + row * stride + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN ranks above everything, as in torch.argmax
        best, index = _first_max(x, offs, n)
        tl.store(Values + row * chunks + chunk, best)
        tl.store(Indices + row * chunks + chunk, index)

    @triton.jit
    def _argmax_rows_kernel(Values, Indices, Out, chunks, n, CHUNKS_PAD: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, CHUNKS_PAD)
        valid = offs < chunks
        values = tl.load(Values + row * chunks + offs, mask=valid, other=float("-inf"))
        indices = tl.load(Indices + row * chunks + offs, mask=valid, other=n)
        tl.store(Out + row, _first_max(values, indices, n)[1].to(tl.int64))


if triton is not None:

    @triton.jit
    def _advance_decode_kernel(Positions, stride_p, CacheIndex, ContextLens, DraftStart, QueryCacheIndex, stride_q,
                               IndexInSequence, stride_i, BlockTables, stride_b, SlotMapping, n, block_size,
                               POSITION_ROWS: tl.constexpr, HAS_INDEX_IN_SEQUENCE: tl.constexpr,
                               BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < n
        for p in tl.static_range(POSITION_ROWS):
            tl.store(Positions + p * stride_p + rows, tl.load(Positions + p * stride_p + rows, mask=ok) + 1, mask=ok)
        index = tl.load(CacheIndex + rows, mask=ok, other=0) + 1
        tl.store(CacheIndex + rows, index, mask=ok)
        tl.store(ContextLens + rows, tl.load(ContextLens + rows, mask=ok) + 1, mask=ok)
        tl.store(DraftStart + rows, tl.load(DraftStart + rows, mask=ok) + 1, mask=ok)
        tl.store(QueryCacheIndex + rows * stride_q, tl.load(QueryCacheIndex + rows * stride_q, mask=ok) + 1, mask=ok)
        if HAS_INDEX_IN_SEQUENCE:
            tl.store(IndexInSequence + rows * stride_i, tl.load(IndexInSequence + rows * stride_i, mask=ok) + 1,
                     mask=ok)
        block = tl.load(BlockTables + rows * stride_b + index // block_size, mask=ok, other=0)
        tl.store(SlotMapping + rows, block * block_size + index % block_size, mask=ok)


ADVANCE_BLOCK = 128


def advance_decode_rows(buffers: dict[str, torch.Tensor], n: int, block_size: int) -> None:
    """What ``ModelRunner.advance_decode`` does to its first ``n`` rows in about ten PyTorch ops, in one launch:
    the positions, cache indices, context lengths, draft starts and query cache indices one further, and each
    row's slot looked up in its block table at its new cache index. Each op of those costs the host a launch
    in every overlapped step, the steps of a busy server included."""
    positions, index_in_sequence = buffers["positions"], buffers.get("query_index_in_sequence")
    query_cache_index, block_tables = buffers["query_cache_index"], buffers["block_tables"]
    _advance_decode_kernel[(triton.cdiv(n, ADVANCE_BLOCK),)](
        positions, positions.stride(0), buffers["token_cache_index"], buffers["context_lens"],
        buffers["draft_start"], query_cache_index, query_cache_index.stride(0),
        query_cache_index if index_in_sequence is None else index_in_sequence,
        0 if index_in_sequence is None else index_in_sequence.stride(0),
        block_tables, block_tables.stride(0), buffers["slot_mapping"], n, block_size,
        POSITION_ROWS=positions.shape[0], HAS_INDEX_IN_SEQUENCE=index_in_sequence is not None,
        BLOCK=ADVANCE_BLOCK)


if triton is not None:

    # Not specialised on the step's sizes (Triton compiles a variant for a size of 1 and for multiples of 16): the
    # kernel runs outside the graphs, so each variant would first compile in the middle of serving.
    @triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
    def _lay_out_runs_kernel(Runs, num_seqs, num_tokens, TokenSeq, TokenQueryIndex, TokenCacheIndex, Positions,
                             BlockTables, stride_b, SlotMapping, QueryCacheIndex, stride_q, IndexInSequence,
                             stride_i, block_size, HAS_INDEX_IN_SEQUENCE: tl.constexpr, BLOCK: tl.constexpr,
                             SEQ_BLOCK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = rows < num_tokens
        # A row's sequence: the runs (in row order) starting at or before it, less one. A loop over blocks of
        # runs rather than one block of them all, so that any number of sequences takes the same compiled kernel.
        seq = tl.zeros([BLOCK], dtype=tl.int64) - 1
        for first_seq in range(0, num_seqs, SEQ_BLOCK):
            seqs = first_seq + tl.arange(0, SEQ_BLOCK)
            first_rows = tl.load(Runs + seqs * 3, mask=seqs < num_seqs, other=num_tokens)
            seq += tl.sum((first_rows[None, :] <= rows[:, None]).to(tl.int64), axis=1)
        seq = tl.where(ok, seq, 0)
        query_index = rows - tl.load(Runs + seq * 3)
        cache_index = tl.load(Runs + seq * 3 + 1) + query_index
        tl.store(TokenSeq + rows, seq, mask=ok)
        tl.store(TokenQueryIndex + rows, query_index, mask=ok)
        tl.store(TokenCacheIndex + rows, cache_index, mask=ok)
        tl.store(Positions + rows, cache_index, mask=ok)
        block = tl.load(BlockTables + seq * stride_b + cache_index // block_size, mask=ok, other=0)
        tl.store(SlotMapping + rows, block * block_size + cache_index % block_size, mask=ok)
        tl.store(QueryCacheIndex + seq * stride_q + query_index, cache_index, mask=ok)
        if HAS_INDEX_IN_SEQUENCE:
            tl.store(IndexInSequence + seq * stride_i + query_index, cache_index, mask=ok)


LAY_OUT_BLOCK, LAY_OUT_SEQ_BLOCK = 128, 64


def lay_out_runs(buffers: dict[str, torch.Tensor], runs: torch.Tensor, num_tokens: int, max_query: int,
                 block_size: int) -> None:
    """What ``step_inputs.lay_out_runs`` derives from a step's runs in about twenty PyTorch ops, in one launch
    (and a fill of the per-sequence query tables' padding): each token's sequence, query index, cache index,
    position and slot, and the tables by sequence and query index."""
    num_seqs = runs.shape[0]
    query_cache_index, index_in_sequence = buffers["query_cache_index"], buffers.get("query_index_in_sequence")
    tables = (query_cache_index,) if index_in_sequence is None else (query_cache_index, index_in_sequence)
    for table in tables:  # the padding past each sequence's queries reads 0, as the lists' padded rows do
        table[:num_seqs, :max_query].zero_()
    block_tables = buffers["block_tables"]
    _lay_out_runs_kernel[(triton.cdiv(num_tokens, LAY_OUT_BLOCK),)](
        runs, num_seqs, num_tokens, buffers["token_seq"], buffers["token_query_index"],
        buffers["token_cache_index"], buffers["positions"], block_tables, block_tables.stride(0),
        buffers["slot_mapping"], query_cache_index, query_cache_index.stride(0), tables[-1], tables[-1].stride(0),
        block_size, HAS_INDEX_IN_SEQUENCE=index_in_sequence is not None, BLOCK=LAY_OUT_BLOCK,
        SEQ_BLOCK=LAY_OUT_SEQ_BLOCK)


# Logits one program of the argmax reads: a 128k vocabulary is 32 programs per row.
ARGMAX_BLOCK = 4096


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[rows, vocab]``, in two short launches. torch's reduction of one long row runs
    in one block: 30 us per launch on a 128k vocabulary at batch 1 on the H200, inside the decode graph."""
    rows, n = logits.shape
    chunks = triton.cdiv(n, ARGMAX_BLOCK)
    values = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    options = pdl_options(logits.device)
    _argmax_chunk_kernel[(rows, chunks)](logits, values, indices, n, logits.stride(0), chunks,
                                         BLOCK=ARGMAX_BLOCK, **options)
    _argmax_rows_kernel[(rows,)](values, indices, out, chunks, n, CHUNKS_PAD=triton.next_power_of_2(chunks),
                                 **options)
    return out


def _gemv(x: torch.Tensor, weight: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    rows = x.shape[0]
    n, k = weight.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    block_n, block_k, stages, warps = gemv_config(n, rows, k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, out, rows, n, k, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, ROUND_TO=_TL_DTYPES[weight.dtype],
        IEEE=weight.dtype == torch.float32, **row_tile(rows, block_n), BLOCK_N=block_n, BLOCK_K=block_k,
        num_stages=stages, num_warps=warps, WEIGHTS_FIRST=WEIGHTS_FIRST, **pdl_options(x.device))
    return out


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16} if triton is not None else {}


@functools.cache
def _shared_memory_limit(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def _gemv_shared_memory_fits(rows: int, weight: torch.Tensor) -> bool:
    # Each pipeline stage holds a tile of x and one of W: wide row counts on wide tiles overflow shared memory.
    if weight.device.type != "cuda":
        return True
    block_n, block_k, stages, _ = gemv_config(weight.shape[0], rows, weight.shape[1])
    needed = stages * (row_tile(rows, block_n)["BLOCK_M"] + block_n) * block_k * weight.element_size()
    index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
    return needed <= _shared_memory_limit(index)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, max_rows: int | None = None) -> bool:
    """Whether the Triton kernel takes this input: at most ``max_rows`` rows (``GEMV_MAX_ROWS``), contiguous, its
    tiles within shared memory."""
    max_rows = GEMV_MAX_ROWS if max_rows is None else max_rows
    return (x.dim() == 2 and 0 < x.shape[0] <= max_rows and x.stride(-1) == 1 and weight.stride(-1) == 1
            and x.dtype == weight.dtype and _gemv_shared_memory_fits(x.shape[0], weight))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (cast to ``out_dtype`` after rounding to x's dtype) for ``x: [rows, k]``."""
    if gemv_fits(x, weight):
        return _gemv(x, weight, bias, out_dtype or x.dtype)
    out = torch.nn.functional.linear(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a layer's projection: the weight-streaming kernel up to
    ``PROJECTION_GEMV_MAX_ROWS`` rows, cuBLAS past them."""
    if gemv_fits(x, weight, PROJECTION_GEMV_MAX_ROWS):
        return _gemv(x, weight, bias, x.dtype)
    return torch.nn.functional.linear(x, weight, bias)


def folds_into_projection(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``qkv_rope_and_write_cache`` and ``gate_up_silu`` take this input (``FOLD_INTO_PROJECTIONS`` on and
    ``projection`` streaming the weights at this row count)."""
    return FOLD_INTO_PROJECTIONS and gemv_fits(x, weight, PROJECTION_GEMV_MAX_ROWS)


def _paired_launch(x: torch.Tensor, weight: torch.Tensor, bias, pair_limit: int) -> dict:
    # The tile of the plain kernel for this weight, cut into two runs of PAIR rows.
    block_n, block_k, stages, warps = gemv_config(weight.shape[0], x.shape[0], weight.shape[1])
    pair = min(block_n // 2, pair_limit)
    return dict(HAS_BIAS=bias is not None, IEEE=weight.dtype == torch.float32, **row_tile(x.shape[0], 2 * pair),
                PAIR=pair, BLOCK_K=block_k, num_stages=stages, num_warps=warps, WEIGHTS_FIRST=WEIGHTS_FIRST,
                **pdl_options(x.device))


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``silu_and_mul(F.linear(x, weight, bias))`` for ``weight = [gate; up]``, as one launch: each program
    streams matching gate and up rows and stores only the activated product."""
    half = weight.shape[0] // 2
    out = torch.empty(x.shape[0], half, dtype=x.dtype, device=x.device)
    options = _paired_launch(x, weight, bias, 1 << 30)
    _gate_up_silu_kernel[(triton.cdiv(half, options["PAIR"]),)](
        x, weight, bias if bias is not None else weight, out, x.shape[0], half, weight.shape[1],
        x.stride(0), weight.stride(0), out.stride(0), **options)
    return out


# Whether a decode step's MLP (gated SiLU, no biases) runs as one launch, split over its intermediate columns
# (``mlp_split_k``), where gate/up with SiLU and then down would stream their weights as two. The down product's
# float32 partial sums meet by atomic adds, so their order, and the last bit of a sum now and then, changes from
# run to run: off gives the same bits every run. On an H100, batch-1 decode steps took 1.063-1.065 against
# 1.103-1.106 ms and batch 4 1.150-1.153 against 1.290-1.296 (bench/results/gpu/round19/).
MLP_SPLIT_K = True
# Tiles of mlp_split_k: (PAIR intermediate columns a program, BLOCK_K, OUT_TILE down rows an iteration, num_stages,
# num_warps). PAIR 64 gives Llama-3.2-1B's 8192 columns 128 programs, one wave of an H100's or H200's 132 SMs; the
# best of 16 tiles at one row on an H100 (bench/mlp_split_k.py --quick-sweep).
MLP_SPLIT_K_CONFIG = (64, 128, 256, 3, 4)


def mlp_split_k(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Adds ``F.linear(silu_and_mul(F.linear(x, gate_up)), down)`` into ``acc`` (float32 ``[rows, hidden]``, zeros
    before), as one launch: each program streams a slice of gate/up and the down columns that slice feeds. Returns
    ``acc``; ``add_rms_norm(acc, ..., accumulated=True)`` reads it and zeroes it again."""
    rows, k = x.shape
    half, hidden = gate_up.shape[0] // 2, down.shape[0]
    pair, block_k, out_tile, stages, warps = MLP_SPLIT_K_CONFIG
    tile = row_tile(rows, 2 * pair)
    _mlp_split_k_kernel[(triton.cdiv(half, pair),)](
        x, gate_up, down, acc, rows, half, k, hidden, x.stride(0), gate_up.stride(0), down.stride(0), acc.stride(0),
        IEEE=gate_up.dtype == torch.float32, **tile, PAIR=pair, BLOCK_K=block_k, OUT_TILE=out_tile,
        DOWN_DOT=tile["DOT"] and pair >= 16, num_stages=stages, num_warps=warps, WEIGHTS_FIRST=WEIGHTS_FIRST,
        **pdl_options(x.device))
    return acc


def qkv_rope_and_write_cache(x, weight, bias, cos, sin, key_cache, value_cache, slot_mapping,
                             num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """``rope_and_write_cache`` applied to ``F.linear(x, weight, bias)`` split into q, k and v, as one launch.
    ``weight``: the fused ``[q; k; v]`` projection, heads of a power-of-two half; cos, sin: ``[T, head_dim]`` or
    None (no rotary). Returns q ``[T, heads, head_dim]``."""
    tokens = x.shape[0]
    head_dim = weight.shape[0] // (num_heads + 2 * num_kv_heads)
    half = head_dim // 2
    q = torch.empty(tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)
    has_rope = cos is not None
    options = _paired_launch(x, weight, bias, half)
    _qkv_rope_cache_kernel[((num_heads + 2 * num_kv_heads) * half // options["PAIR"],)](
        x, weight, bias if bias is not None else weight, q, cos if has_rope else q, sin if has_rope else q,
        flat_k, flat_v, slot_mapping, tokens, weight.shape[1], x.stride(0), weight.stride(0), q.stride(0),
        cos.stride(0) if has_rope else 0, flat_k.stride(0), flat_k.stride(1),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, HAS_ROPE=has_rope, **options,
        **EXACT_ROUNDING)
    return q


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 accumulated: bool = False):
    """``(rms_norm(x + residual) * weight, x + residual)``; with no residual, ``(rms_norm(x) * weight, x)``.
    ``accumulated``: x is mlp_split_k's float32 sums, rounded to the model dtype (the norm weight's) first and
    zeroed after."""
    rows, cols = x.shape
    dtype = weight.dtype if accumulated else x.dtype
    out = torch.empty(rows, cols, dtype=dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None or accumulated else x
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, summed,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), summed.stride(0), cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols), **pdl_options(x.device),
        X_ACCUMULATED=accumulated)
    return out, summed


def rope_and_write_cache(q, k, v, cos, sin, key_cache, value_cache, slot_mapping) -> torch.Tensor:
    """Rotate q (in place) and k by the rotate-half tables, write k and v to the cache slots; returns q.

    q: [T, H, D], k, v: [T, Hkv, D] (views with unit last stride); cos, sin: [T, D] or None (no rotary);
    caches: [blocks, block_size, Hkv, D].
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    flat_k = key_cache.view(-1, kv_heads, head_dim)
    flat_v = value_cache.view(-1, kv_heads, head_dim)
    has_rope = cos is not None
    _rope_cache_write_kernel[(tokens,)](
        q, k, v, cos if has_rope else q, sin if has_rope else q, flat_k, flat_v, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0) if has_rope else 0, flat_k.stride(0), flat_k.stride(1),
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEADS_PAD=triton.next_power_of_2(heads),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HALF=head_dim // 2, HAS_ROPE=has_rope,
        **pdl_options(q.device), **EXACT_ROUNDING)
    return q


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids.clamp(max=vocab - 1), weight)`` for ``ids: [T]``, in one launch."""
    vocab, hidden = weight.shape
    out = torch.empty(ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _embedding_kernel[(ids.shape[0], triton.cdiv(hidden, block))](
        ids, weight, out, vocab, hidden, ids.stride(0), weight.stride(0), out.stride(0), BLOCK=block,
        **pdl_options(out.device))
    return out


def rotate_half_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """``zoo.model.rotate_half_tables`` in one launch: (cos, sin), each ``[T, 1, 2 * len(inv_freq)]``, for
    ``positions: [T]``."""
    tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(tokens, 1, 2 * half, dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    _rotary_tables_kernel[(tokens,)](positions, inv_freq, cos, sin, half, positions.stride(0), cos.stride(0),
                                     BLOCK=triton.next_power_of_2(half), **pdl_options(cos.device))
    return cos, sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate_up, out, gate_up.stride(0), out.stride(0), cols,
                                                        BLOCK=block, **pdl_options(out.device))
    return out
