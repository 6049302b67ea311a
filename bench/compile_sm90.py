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

import argparse
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from zoo import fused_ops, triton_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from gpu import SHAPE  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
SCALARS = {"eps": "fp32", "scale": "fp32"}  # every other lower-case argument is an i32


def signature_of(kernel, pointers: dict[str, str]) -> dict[str, str]:
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
    ("add_rms_norm of MLP sums", fused_ops._add_rms_norm_kernel, {"X": "*fp32"},
     dict(HAS_RESIDUAL=True, BLOCK=2048, X_ACCUMULATED=True, **PDL), {}),
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
    ("mlp_split_k", fused_ops._mlp_split_k_kernel, {"Acc": "*fp32"},
     dict(IEEE=False, DOT=True, BLOCK_M=16, PAIR=32, BLOCK_K=128, OUT_TILE=128, DOWN_DOT=True, **PRODUCT), {}),
    ("mlp_split_k, narrow", fused_ops._mlp_split_k_kernel, {"Acc": "*fp32"},
     dict(IEEE=False, DOT=False, BLOCK_M=1, PAIR=4, BLOCK_K=1024, OUT_TILE=64, DOWN_DOT=False, **PRODUCT), {}),
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
    ("embedding", fused_ops._embedding_kernel, {"Ids": "*i64"}, dict(BLOCK=1024, **PDL), {}),
    ("rotary tables", fused_ops._rotary_tables_kernel, {"Positions": "*i64", "InvFreq": "*fp32"},
     dict(BLOCK=32, **PDL), {}),
    ("advance_decode_rows", fused_ops._advance_decode_kernel, {"*": "*i64"},
     dict(POSITION_ROWS=3, HAS_INDEX_IN_SEQUENCE=True, BLOCK=fused_ops.ADVANCE_BLOCK), {}),
    ("lay_out_runs", fused_ops._lay_out_runs_kernel, {"*": "*i64"},
     dict(HAS_INDEX_IN_SEQUENCE=True, BLOCK=fused_ops.LAY_OUT_BLOCK, SEQ_BLOCK=fused_ops.LAY_OUT_SEQ_BLOCK), {}),
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


# The benchmark's products at one row (bench/gpu.py's Llama-3.2-1B shape), for --occupancy: (name, kernel, pointers
# not bf16, weight [n, k], the launch's scalar arguments as the runtime passes them)
HIDDEN, HEADS, KV_HEADS = SHAPE["hidden_size"], SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
HEAD_DIM, INTERMEDIATE, VOCAB = HIDDEN // HEADS, SHAPE["intermediate_size"], SHAPE["vocab_size"]
QKV_ROWS = (HEADS + 2 * KV_HEADS) * HEAD_DIM
PRODUCTS = [
    ("q/k/v with rotary and the cache write", fused_ops._qkv_rope_cache_kernel, {"SlotMapping": "*i64"},
     (QKV_ROWS, HIDDEN), dict(rows=1, k=HIDDEN, stride_x=HIDDEN, stride_w=HIDDEN, stride_q=HEADS * HEAD_DIM,
                              stride_ct=HEAD_DIM, stride_cs=KV_HEADS * HEAD_DIM, stride_ch=HEAD_DIM)),
    ("o", fused_ops._gemv_kernel, {}, (HIDDEN, HEADS * HEAD_DIM),
     dict(rows=1, n=HIDDEN, k=HEADS * HEAD_DIM, stride_x=HEADS * HEAD_DIM, stride_w=HEADS * HEAD_DIM, stride_o=HIDDEN)),
    ("gate/up with SiLU", fused_ops._gate_up_silu_kernel, {}, (2 * INTERMEDIATE, HIDDEN),
     dict(rows=1, half=INTERMEDIATE, k=HIDDEN, stride_x=HIDDEN, stride_w=HIDDEN, stride_o=INTERMEDIATE)),
    ("down", fused_ops._gemv_kernel, {}, (HIDDEN, INTERMEDIATE),
     dict(rows=1, n=HIDDEN, k=INTERMEDIATE, stride_x=INTERMEDIATE, stride_w=INTERMEDIATE, stride_o=HIDDEN)),
    ("LM head", fused_ops._gemv_kernel, {"Out": "*fp32"}, (VOCAB, HIDDEN),
     dict(rows=1, n=VOCAB, k=HIDDEN, stride_x=HIDDEN, stride_w=HIDDEN, stride_o=VOCAB)),
]
H200_SMS = 132


def specialised_like_the_runtime(kernel, pointers: dict, constexprs: dict, scalars: dict):
    """(signature, constexprs, attrs) as Triton's launcher specialises a call: every pointer 16-byte aligned (torch's
    allocations are), integer arguments that are multiples of 16 marked so, and those equal to 1 made constants. The
    loads then vectorise as they do on the GPU, which the plain signature above does not show."""
    signature, constexprs, attrs = signature_of(kernel, pointers), dict(constexprs), {}
    for index, param in enumerate(kernel.params):
        if param.is_constexpr:
            continue
        value = scalars.get(param.name)
        if param.name[0].isupper():
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif value == 1:
            signature[param.name], constexprs[param.name] = "constexpr", 1
        elif isinstance(value, int) and value % 16 == 0:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def registers_per_thread(compiled) -> int:
    """A compiled kernel's registers per thread, from cuobjdump (in Triton's wheel)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        report = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                                check=True).stdout
    return int(re.search(r"REG:(\d+)", report).group(1))


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """Hopper's limits on the programs one SM holds at once: 64K registers (allocated per warp in units of 256),
    2,048 threads, 32 blocks, 227 KB of shared memory (1 KB of it reserved per block)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 2048 // (32 * warps), 32, (227 * 1024) // (shared + 1024))


def occupancy(tiles: list[tuple] | None) -> int:
    """Each product of the benchmark at one row, compiled as the runtime launches it (its tile from fused_ops, or each
    of ``tiles``): registers, the programs an SM holds, the grid in waves of the H200's 132 SMs, and the weight bytes
    each program loads before its PDL wait."""
    print(f"the benchmark's products at one row, compiled as launched (Triton {triton.__version__} here; the device's "
          "Triton may allocate registers differently)")
    for name, kernel, pointers, (n, k), scalars in PRODUCTS:
        for tile in tiles or [None]:
            chosen = fused_ops.GEMV_ONE_ROW_CONFIGS
            if tile is not None:  # every product on this tile, as bench/gemv_kernel.py's sweep forces it
                fused_ops.GEMV_ONE_ROW_CONFIGS = {(1 << 62, 1 << 62): tile}
            try:
                tile = block_n, block_k, stages, warps = fused_ops.gemv_config(n, 1, k)
                if kernel is fused_ops._gemv_kernel:
                    grid = -(-n // block_n)
                    constexprs = dict(HAS_BIAS=False, ROUND_TO=tl.bfloat16, IEEE=False, BLOCK_N=block_n,
                                      BLOCK_K=block_k, **fused_ops.row_tile(1, block_n), **PRODUCT)
                else:  # the paired kernels, with the launch settings the runtime gives them (PDL: Hopper's)
                    qkv = kernel is fused_ops._qkv_rope_cache_kernel
                    launch = fused_ops._paired_launch(torch.empty(1, k, dtype=torch.bfloat16, device="meta"),
                                                      torch.empty(n, k, dtype=torch.bfloat16, device="meta"), None,
                                                      HEAD_DIM // 2 if qkv else 1 << 30)
                    stages, warps = launch.pop("num_stages"), launch.pop("num_warps")
                    grid = n // 2 // launch["PAIR"]
                    extra = dict(NUM_HEADS=HEADS, NUM_KV_HEADS=KV_HEADS, HALF=HEAD_DIM // 2, HAS_ROPE=True) if qkv else {}
                    constexprs = dict(launch, **extra, **PRODUCT)
            finally:
                fused_ops.GEMV_ONE_ROW_CONFIGS = chosen
            signature, constexprs, attrs = specialised_like_the_runtime(kernel, pointers, constexprs, scalars)
            options = {"num_warps": warps, "num_stages": stages, "launch_pdl": True}
            if kernel is fused_ops._qkv_rope_cache_kernel:
                options.update(fused_ops.EXACT_ROUNDING)
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=HOPPER, options=options)
            registers, shared = registers_per_thread(compiled), compiled.metadata.shared
            resident = programs_per_sm(registers, warps, shared)
            # bf16 bytes of the first weight tile, which a program loads before its wait: only the first wave's
            # programs are there to load it before the kernel before them ends
            early = 2 * min(block_k, k) * block_n * min(grid, resident * H200_SMS)
            print(f"  {name:38s} tile {tile}: {registers:3d} registers, {shared:6d} B shared, {resident:2d} programs "
                  f"an SM, {grid:5d} programs = {grid / (resident * H200_SMS):.2f} waves, "
                  f"{early / 2**20:5.1f} MB of {2 * n * k / 2**20:.1f} before the wait")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--occupancy", action="store_true",
                   help="instead: the benchmark's products at one row as the runtime launches them, with their "
                        "registers and waves on the H200")
    p.add_argument("--tiles", nargs="+", default=None, metavar="N,K,STAGES,WARPS",
                   help="with --occupancy: these tiles for every product instead of fused_ops' choice")
    args = p.parse_args()
    if args.occupancy:
        return occupancy([tuple(int(v) for v in tile.split(",")) for tile in args.tiles] if args.tiles else None)
    failed = []
    for name, kernel, pointers, constexprs, options in CASES:
        launch = {"num_warps": 4, "num_stages": 3, **options}
        if constexprs.get("PDL"):
            launch["launch_pdl"] = True
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature_of(kernel, pointers),
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
        if "sin.approx" in ptx or "cos.approx" in ptx:  # the rotary tables must match PyTorch's cosf and sinf
            failed.append(name)
            print(f"FAILED {name}: approximate sin or cos instructions in its PTX", flush=True)
    if failed:
        print(f"{len(failed)} of {len(CASES)} kernels failed to compile for sm_90: {', '.join(failed)}")
        return 1
    print(f"all {len(CASES)} kernels compiled for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
