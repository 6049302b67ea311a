"""An experiment for issue 15's batch-1 step: RMSNorm (with the residual add) folded into the projection after it.

    python bench/norm_gemv.py [--out FILE]        # on the GPU: correctness, then timings
    TRITON_INTERPRET=1 python bench/norm_gemv.py --check-only --small   # the check alone, in the interpreter

A decode layer runs add_rms_norm, then the q/k/v product; later add_rms_norm again, then gate/up. At batch 1 each
norm is a 2-us kernel the product must wait for. Here one kernel does both: every program sums the squares of its
row (2,048 values: 4 KB, from L2 after the first program), then streams its weight columns against the normalised
row, and program 0 writes the summed residual. The timings replay CUDA graphs of 20 pairs (norm kernel, then
zoo's weight-streaming kernel) against 20 fused calls, both under programmatic dependent launch, on the
Llama-3.2-1B shapes. Not used by zoo: a measurement to decide whether the model should fold it in.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from zoo import fused_ops
from zoo.triton_attention import pdl_options, triton

sys.path.insert(0, str(Path(__file__).parent))

if triton is not None:
    import triton.language as tl

    from zoo.triton_attention import wait_for_previous_kernel

    @triton.jit
    def _norm_gemv_kernel(X, Residual, NormWeight, W, Out, Summed, rows, n, k, eps, stride_x, stride_w, stride_o,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        wait_for_previous_kernel(PDL)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < rows
        col_ok = cols < n
        dtype = X.dtype.element_ty
        squares = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, k, BLOCK_K):  # the rows' mean squares, of x + residual rounded as eager adds
            ks = start + offs_k
            mask = row_ok[:, None] & (ks < k)[None, :]
            at = offs_m[:, None] * stride_x + ks[None, :]
            summed = (tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
                      + tl.load(Residual + at, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            if tl.program_id(0) == 0:
                tl.store(Summed + at, summed, mask=mask)
            summed = summed.to(tl.float32)
            squares += tl.sum(summed * summed, 1)
        inverse = tl.rsqrt(squares / k + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + offs_k
            mask = row_ok[:, None] & (ks < k)[None, :]
            at = offs_m[:, None] * stride_x + ks[None, :]
            summed = (tl.load(X + at, mask=mask, other=0.0).to(tl.float32)
                      + tl.load(Residual + at, mask=mask, other=0.0).to(tl.float32)).to(dtype).to(tl.float32)
            scale = tl.load(NormWeight + ks, mask=ks < k, other=0.0).to(tl.float32)
            normed = ((summed * inverse[:, None]).to(dtype).to(tl.float32) * scale[None, :]).to(dtype)
            w = tl.load(W + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & (ks < k)[None, :],
                        other=0.0)
            acc += tl.dot(normed, tl.trans(w))
        tl.store(Out + offs_m[:, None] * stride_o + cols[None, :], acc.to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])


def norm_gemv(x, residual, norm_weight, weight, eps):
    """``(rms_norm(x + residual) * norm_weight) @ weight.T`` and ``x + residual``, in one launch."""
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    summed = torch.empty_like(x)
    block_n, block_k, stages, warps = fused_ops.gemv_config(n)
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual, norm_weight, weight, out, summed, rows, n, k, eps, x.stride(0), weight.stride(0),
        out.stride(0), BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_stages=stages, num_warps=warps, **pdl_options(x.device))
    return out, summed


def two_kernels(x, residual, norm_weight, weight, eps):
    normed, summed = fused_ops.add_rms_norm(x, residual, norm_weight, eps)
    return fused_ops._gemv(normed, weight, None, x.dtype), summed


def check(device, dtype, shapes, say) -> bool:
    ok = True
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        for rows in (1, 3):
            x = torch.randn(rows, k, generator=g).to(device, dtype)
            residual = torch.randn(rows, k, generator=g).to(device, dtype)
            norm_weight = (torch.rand(k, generator=g) + 0.5).to(device, dtype)
            weight = (torch.randn(n, k, generator=g) / k ** 0.5).to(device, dtype)
            out, summed = norm_gemv(x, residual, norm_weight, weight, 1e-5)
            ref_out, ref_summed = two_kernels(x, residual, norm_weight, weight, 1e-5)
            error = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            same_sum = torch.equal(summed, ref_summed)
            good = same_sum and error < (1e-5 if dtype == torch.float32 else 1e-2)
            ok &= good
            say(f"check {name} {tuple(weight.shape)} rows {rows} {dtype}: relative error {error:.2e}, "
                f"summed residual {'equal' if same_sum else 'DIFFERS'} -> {'ok' if good else 'FAILED'}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--small", action="store_true", help="small shapes (for the interpreter)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from decode_kernel import Report, graph_time

    say = Report()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ({"qkv": (48, 600), "gate_up": (160, 96)} if args.small
              else {"qkv": (3072, 2048), "gate_up": (16384, 2048)})
    dtypes = [torch.float32] if device.type == "cpu" else [torch.bfloat16]
    ok = all(check(device, dtype, shapes, say) for dtype in dtypes)
    if not ok or args.check_only or device.type != "cuda":
        return 0 if ok else 1
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, PDL {pdl_options(device)}")
    say("| shape | rows | norm + GEMV us | fused us | two / fused |")
    say("|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / 30
        norm_weight = torch.rand(k, device=device, dtype=torch.bfloat16) + 0.5
        for rows in (1, 4):
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            residual = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            two = graph_time(lambda: two_kernels(x, residual, norm_weight, weight, 1e-5))
            one = graph_time(lambda: norm_gemv(x, residual, norm_weight, weight, 1e-5))
            say(f"| {name} {(n, k)} | {rows} | {two:.2f} | {one:.2f} | {two / one:.3f} |")
    if args.out:
        say.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
