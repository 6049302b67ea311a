"""The weight-streaming linear kernel (zoo.fused_ops.linear) against cuBLAS (F.linear) on Llama-3.2-1B's projections.

    python bench/gemv_kernel.py [--sweep] [--out FILE]

Each timing replays a CUDA graph of 20 calls, as decode steps do, so launch costs stay out of it; figures are
microseconds per call and the weight bytes read per second. ``--cold`` cycles each product's calls over copies
of its weights (at least 200 MB in all, four times the H200's 50 MB L2), so that no call finds its weights in L2,
as a decode step's products never do; without it the q/k/v, o and down weights (8-34 MB) stay in L2 from one call
to the next. ``--one-row-sweep``: one-row tiles for q/k/v, o, gate/up (with SiLU) and down with cold weights
(GEMV_ONE_ROW_CONFIGS). ``--sweep`` first tries tile configurations at 1 and 16 rows and prints the best per shape (the values for fused_ops.GEMV_CONFIGS), then, at 1 row, tiles
narrower than tensor cores take (4 or 8 columns, products summed in float32: fused_ops.GEMV_ONE_ROW_CONFIGS)
against the best of those.
"""

from __future__ import annotations

import argparse
import itertools
import sys

from pathlib import Path

import torch

from zoo import fused_ops

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernel import Report, graph_time  # noqa: E402

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
COLD_BYTES = 200 << 20  # --cold: weight copies of at least this much per product, four times the H200's L2


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--cold", action="store_true", help="the last table with weights L2 cannot hold between calls")
    p.add_argument("--one-row-sweep", action="store_true",
                   help="one-row tiles for each layer product, weights cycled as --cold (GEMV_ONE_ROW_CONFIGS)")
    args = p.parse_args()
    say = Report()

    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 30 for name, (n, k) in SHAPES.items()}
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.sweep:
        configs = list(itertools.product((16, 32, 64, 128), (128, 256, 512), (3, 5), (4,)))
        chosen = fused_ops.GEMV_CONFIGS
        say("| shape | rows | best (BLOCK_N, BLOCK_K, stages, warps) | us | cuBLAS us |")
        say("|---|---|---|---|---|")
        for name, w in weights.items():
            for rows in (1, 16):
                x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
                results = []
                for config in configs:
                    if config[0] * config[1] > 64 * 512:
                        continue
                    fused_ops.GEMV_CONFIGS = {1 << 62: config}
                    try:
                        results.append((graph_time(lambda: fused_ops.linear(x, w)), config))
                    except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory
                        say(f"  {name} {config}: {type(exc).__name__}")
                best = min(results)
                cublas = graph_time(lambda: torch.nn.functional.linear(x, w))
                say(f"| {name} {tuple(w.shape)} | {rows} | {best[1]} | {best[0]:.2f} | {cublas:.2f} |")
        fused_ops.GEMV_CONFIGS = chosen
        say("")
        say("One row, tiles narrower than tensor cores take (fused_ops.GEMV_ONE_ROW_CONFIGS):")
        say("| shape | best narrow (BLOCK_N, BLOCK_K, stages, warps) | us | TB/s | GEMV_CONFIGS' tile us | cuBLAS us |")
        say("|---|---|---|---|---|---|")
        narrow = list(itertools.product((4, 8), (256, 512, 1024), (2, 3), (2, 4)))
        for name, w in weights.items():
            x = torch.randn(1, w.shape[1], device="cuda", dtype=torch.bfloat16)
            wide = graph_time(lambda: fused_ops.linear(x, w))
            results = []
            for config in narrow:
                fused_ops.GEMV_ONE_ROW_CONFIGS = {1 << 62: config}
                try:
                    results.append((graph_time(lambda: fused_ops.linear(x, w)), config))
                except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory or registers
                    say(f"  {name} {config}: {type(exc).__name__}")
            fused_ops.GEMV_ONE_ROW_CONFIGS = {}
            best = min(results)
            cublas = graph_time(lambda: torch.nn.functional.linear(x, w))
            nbytes = w.numel() * w.element_size()
            say(f"| {name} {tuple(w.shape)} | {best[1]} | {best[0]:.2f} | {nbytes / best[0] / 1e6:.2f} | {wide:.2f} "
                f"| {cublas:.2f} |")
    if args.one_row_sweep:
        one_row_sweep(weights, say)
    fused_ops.GEMV_MAX_ROWS = max(ROWS)
    say(f"configs {fused_ops.GEMV_CONFIGS}, one-row {fused_ops.GEMV_ONE_ROW_CONFIGS}; weights "
        + ("cycled over copies that L2 cannot hold (--cold)" if args.cold else "the same in every call"))
    say("| shape | rows | kernel us | kernel TB/s | cuBLAS us | cuBLAS TB/s | cuBLAS / kernel |")
    say("|---|---|---|---|---|---|---|")
    for name, w in weights.items():
        nbytes = w.numel() * w.element_size()
        copies = cold_copies(w) if args.cold else [w]
        for rows in ROWS:
            x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
            turn = itertools.cycle(copies)  # each captured call reads the next copy
            ours = graph_time(lambda: fused_ops.linear(x, next(turn)))
            turn = itertools.cycle(copies)
            cublas = graph_time(lambda: torch.nn.functional.linear(x, next(turn)))
            say(f"| {name} | {rows} | {ours:.2f} | {nbytes / ours / 1e6:.2f} | {cublas:.2f} | "
                f"{nbytes / cublas / 1e6:.2f} | {cublas / ours:.2f} |")
    if args.out:
        say.write(args.out)
    return 0


def cold_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """``w`` and clones of it, COLD_BYTES in all (at most 20), for calls that never find their weights in L2."""
    return [w] + [w.clone() for _ in range(min(19, -(-COLD_BYTES // (w.numel() * w.element_size())) - 1))]


def one_row_sweep(weights, say) -> None:
    """At one row, the layer products on each candidate tile with the weights cycled over copies L2 cannot hold,
    under zoo's launch options (WEIGHTS_FIRST, PDL): the best per shape, the values for GEMV_ONE_ROW_CONFIGS."""
    narrow = [c for c in itertools.product((2, 4, 8), (1024, 2048, 4096, 8192), (1, 3), (2, 4, 8))
              if c[0] * c[1] <= 8 * 4096]  # wider tiles spill registers
    tensor_core = [(16, 256, 4, 4), (16, 512, 3, 4), (16, 1024, 2, 4), (32, 512, 3, 4)]
    chosen = fused_ops.GEMV_ONE_ROW_CONFIGS
    say(f"One row, weights cycled over copies L2 cannot hold; WEIGHTS_FIRST={fused_ops.WEIGHTS_FIRST}")
    say("| shape | zoo's tile | us | best (BLOCK_N, BLOCK_K, stages, warps) | us | TB/s | next best |")
    say("|---|---|---|---|---|---|---|")
    for name in ("qkv", "o", "gate_up", "down"):
        w = weights[name]
        n, k = w.shape
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        copies = cold_copies(w)
        if name == "gate_up":  # the model streams it through the paired kernel with SiLU
            def call(w):
                return fused_ops.gate_up_silu(x, w, None)
        else:
            def call(w):
                return fused_ops.linear(x, w)

        def timed():
            turn = itertools.cycle(copies)
            return graph_time(lambda: call(next(turn)))

        fused_ops.GEMV_ONE_ROW_CONFIGS = chosen
        current = (timed(), fused_ops.gemv_config(n, 1, k))
        results = []
        for config in narrow + tensor_core:
            if config[1] > k:
                continue
            fused_ops.GEMV_ONE_ROW_CONFIGS = {(1 << 62, 1 << 62): config}
            try:
                results.append((timed(), config))
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit shared memory or registers
                say(f"  {name} {config}: {type(exc).__name__}")
        results.sort()
        nbytes = w.numel() * w.element_size()
        say(f"| {name} {tuple(w.shape)} | {current[1]} | {current[0]:.2f} | {results[0][1]} | {results[0][0]:.2f} "
            f"| {nbytes / results[0][0] / 1e6:.2f} | {results[1][1]} {results[1][0]:.2f} |")
    fused_ops.GEMV_ONE_ROW_CONFIGS = chosen
    say("")


if __name__ == "__main__":
    sys.exit(main())
