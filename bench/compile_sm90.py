"""Compile every Triton kernel of zoo for the H200 (sm_90) on a machine without a GPU, with Hopper's launch options.

    python bench/compile_sm90.py

The CPU tests run the kernels in Triton's interpreter, which never compiles them, so an op the compiler refuses
(a shape tl.dot does not take, a constexpr branch that does not lower) would first show on the GPU. This lowers
each kernel, in the variants the runtime launches (tensor-core and narrow one-row tiles, with and without a
folded norm, rotary, GQA and draft trees), to PTX with this machine's Triton, and prints each one's size and
tensor-core instructions. It exits 1 naming any that fails. Run without TRITON_INTERPRET (the interpreter's
kernels cannot be compiled); tests/test_fused_ops.py runs it in a subprocess.
"""

from __future__ import annotations

import os
import sys
import traceback

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zoo import fused_ops, triton_attention  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SCALARS = {"eps": "fp32", "scale": "fp32"}  # every other lower-case argument is an i32


def signature(kernel, pointers: dict[str, str]) -> dict[str, str]:
    """Argument types by zoo's naming: Capitalised arguments are pointers (bf16, or as ``pointers`` names them;
    its key "*": every other pointer's), lower-case ones scalars; constexprs by the kernel's own annotations."""
    default_pointer = pointers.get("*", "*bf16")
    types = {}
    for param in kernel.params:
        if param.is_constexpr:
            types[param.name] = "constexpr"
        elif param.name[0].isupper():
            types[param.name] = pointers.get(param.name, default_pointer)
        else:
            types[param.name] = SCALARS.get(param.name, "i32")
    return types


PDL = dict(PDL=True)
PRODUCT = dict(PDL=True, WEIGHTS_FIRST=fused_ops.WEIGHTS_FIRST)  # the weight-streaming kernels
# (name, kernel, pointers not bf16 ("*": all of them), constexprs, launch options)
CASES = [
    ("add_rms_norm", fused_ops._add_rms_norm_kernel, {}, dict(HAS_RESIDUAL=True, BLOCK=2048, **PDL), {}),
    ("rope_cache_write", fused_ops._rope_cache_write_kernel, {"SlotMapping": "*i64"},
     dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEADS_PAD=32, KV_HEADS_PAD=8, HALF=32, HAS_ROPE=True, **PDL),
     fused_ops.EXACT_ROUNDING),
    ("silu_mul", fused_ops._silu_mul_kernel, {}, dict(BLOCK=1024, **PDL), {}),
    ("gemv tensor cores", fused_ops._gemv_kernel, {},
     dict(HAS_BIAS=True, ROUND_TO=tl.bfloat16, IEEE=False, DOT=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, **PRODUCT), {}),
    ("gemv narrow, one row", fused_ops._gemv_kernel, {},
     dict(HAS_BIAS=False, ROUND_TO=tl.bfloat16, IEEE=False, DOT=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, **PRODUCT), {}),
    ("gemv float32", fused_ops._gemv_kernel, {"X": "*fp32", "W": "*fp32", "Bias": "*fp32", "Out": "*fp32"},
     dict(HAS_BIAS=False, ROUND_TO=tl.float32, IEEE=True, DOT=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, **PRODUCT), {}),
    ("gate_up_silu", fused_ops._gate_up_silu_kernel, {},
     dict(HAS_BIAS=False, IEEE=False, DOT=True, BLOCK_M=16, PAIR=32, BLOCK_K=128, **PRODUCT), {}),
    ("gate_up_silu, narrow", fused_ops._gate_up_silu_kernel, {},
     dict(HAS_BIAS=False, IEEE=False, DOT=False, BLOCK_M=1, PAIR=4, BLOCK_K=1024, **PRODUCT), {}),
    ("qkv_rope_cache", fused_ops._qkv_rope_cache_kernel, {"SlotMapping": "*i64"},
     dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, HAS_ROPE=True, HAS_BIAS=False, IEEE=False, DOT=True,
          BLOCK_M=16, PAIR=16, BLOCK_K=512, **PRODUCT), fused_ops.EXACT_ROUNDING),
    ("qkv_rope_cache, narrow", fused_ops._qkv_rope_cache_kernel, {"SlotMapping": "*i64"},
     dict(NUM_HEADS=32, NUM_KV_HEADS=8, HALF=32, HAS_ROPE=True, HAS_BIAS=True, IEEE=False, DOT=False,
          BLOCK_M=1, PAIR=4, BLOCK_K=1024, **PRODUCT), fused_ops.EXACT_ROUNDING),
    ("argmax chunks", fused_ops._argmax_chunk_kernel, {"Logits": "*fp32", "Values": "*fp32", "Indices": "*i32"},
     dict(BLOCK=fused_ops.ARGMAX_BLOCK, **PDL), {}),
    ("argmax rows", fused_ops._argmax_rows_kernel, {"Values": "*fp32", "Indices": "*i32", "Out": "*i64"},
     dict(CHUNKS_PAD=32, **PDL), {}),
    ("advance_decode_rows", fused_ops._advance_decode_kernel, {"*": "*i64"},
     dict(POSITION_ROWS=3, HAS_INDEX_IN_SEQUENCE=True, BLOCK=fused_ops.ADVANCE_BLOCK), {}),
    ("paged decode, GQA", triton_attention._paged_decode_kernel,
     {"OutPartial": "*fp32", "LsePartial": "*fp32", "BlockTables": "*i64", "ContextLens": "*i64", "TokenSeq": "*i64",
      "QueryCacheIndex": "*i64", "DraftStart": "*i64", "DraftVisible": "*i8"},
     dict(BLOCK_SIZE=16, HEAD_DIM=64, GROUP=4, GROUP_PAD=16, BLOCKS_PER_SPLIT=4, BLOCKS_PER_ITER=4, HAS_TREE=False,
          IEEE=False, **PDL), {}),
    ("paged decode, draft tree", triton_attention._paged_decode_kernel,
     {"OutPartial": "*fp32", "LsePartial": "*fp32", "BlockTables": "*i64", "ContextLens": "*i64", "TokenSeq": "*i64",
      "QueryCacheIndex": "*i64", "DraftStart": "*i64", "DraftVisible": "*i8"},
     dict(BLOCK_SIZE=16, HEAD_DIM=64, GROUP=4, GROUP_PAD=16, BLOCKS_PER_SPLIT=16, BLOCKS_PER_ITER=4, HAS_TREE=True,
          IEEE=False, **PDL), {}),
    ("paged decode, cached tile first", triton_attention._paged_decode_kernel,
     {"OutPartial": "*fp32", "LsePartial": "*fp32", "BlockTables": "*i64", "ContextLens": "*i64", "TokenSeq": "*i64",
      "QueryCacheIndex": "*i64", "DraftStart": "*i64", "DraftVisible": "*i8"},
     dict(BLOCK_SIZE=16, HEAD_DIM=64, GROUP=4, GROUP_PAD=16, BLOCKS_PER_SPLIT=4, BLOCKS_PER_ITER=4, HAS_TREE=False,
          IEEE=False, CACHED_FIRST=True, **PDL), {}),
    ("merge splits", triton_attention._merge_splits_kernel,
     {"OutPartial": "*fp32", "LsePartial": "*fp32", "TokenSeq": "*i64", "QueryCacheIndex": "*i64",
      "ContextLens": "*i64"},
     dict(HEAD_DIM=64, SPLITS_PAD=16, SPLIT_TOKENS=64, **PDL), {}),
]


def main() -> int:
    failed = []
    for name, kernel, pointers, constexprs, options in CASES:
        launch = {"num_warps": 4, "num_stages": 3, **options}
        if constexprs.get("PDL"):
            launch["launch_pdl"] = True
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature(kernel, pointers),
                                                constexprs=constexprs), target=HOPPER, options=launch)
        except Exception:  # noqa: BLE001 - reported by name, the others still compiled
            failed.append(name)
            print(f"FAILED {name}:\n{traceback.format_exc()}", flush=True)
            continue
        ptx = compiled.asm["ptx"]
        # global loads issued before the PDL wait: only the weight-streaming kernels' first weight tile and, with
        # CACHED_FIRST, the decode kernel's first tile of cached keys and values
        before_wait = ptx.split("griddepcontrol.wait")[0] if "griddepcontrol.wait" in ptx else ""
        early = sum(before_wait.count(op) for op in ("ld.global", "cp.async"))
        print(f"{name}: {len(ptx.splitlines())} lines of PTX, {ptx.count('mma.')} tensor-core instructions, "
              f"{early} global loads before the PDL wait", flush=True)
    if failed:
        print(f"{len(failed)} of {len(CASES)} kernels failed to compile for sm_90: {', '.join(failed)}")
        return 1
    print(f"all {len(CASES)} kernels compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
