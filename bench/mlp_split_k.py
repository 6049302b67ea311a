"""The MLP of a decode step as one split-K launch (fused_ops.mlp_split_k) against zoo's two (gate/up with SiLU, then
down), on Llama-3.2-1B's MLP shape, for every layer of the model in one CUDA graph.

    python bench/mlp_split_k.py [--rows 1 2 4] [--sweep | --quick-sweep] [--rounds 7] [--out FILE] [--best-out FILE]

A graph holds, per layer, the norm that reads the MLP's output (with the residual add) and the MLP: 16 layers of
their own weights (1.6 GB, so none stays in L2 from one layer to the next, as in a decode step), under zoo's launch
options (programmatic dependent launch, WEIGHTS_FIRST). Figures are microseconds per layer, medians of interleaved
rounds; ``--sweep`` first picks the split-K tile (fused_ops.MLP_SPLIT_K_CONFIG) at one row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

from zoo import fused_ops

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernel import Report, replay_ms  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS = 2048, 8192, 16


def build(rows: int, split_k: bool, layers):
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    residual = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    norm_weight = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    acc = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.float32)

    def step():
        x, res = hidden, residual
        if split_k:
            acc.copy_(hidden.float())  # the first norm reads the sums as every later one does
            x = acc
        for gate_up, down in layers:
            normed, res = fused_ops.add_rms_norm(x, res, norm_weight, 1e-6, accumulated=split_k)
            if split_k:
                x = fused_ops.mlp_split_k(normed, gate_up, down, acc)
            else:
                x = fused_ops.projection(fused_ops.gate_up_silu(normed, gate_up, None), down)
        return fused_ops.add_rms_norm(x, res, norm_weight, 1e-6, accumulated=split_k)[0]

    out = step().clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def one_layer_errors(rows: int, gate_up, down) -> tuple[float, float]:
    """Max abs error of one layer's MLP output, the two launches' and split-K's, against float32 math: a chain of 16
    random layers magnifies a last-bit difference, so only this says whether split-K computes the same thing."""
    g = torch.Generator(device="cuda").manual_seed(100 + rows)
    x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    gate, up = torch.nn.functional.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
    exact = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down.float())
    two = fused_ops.projection(fused_ops.gate_up_silu(x, gate_up, None), down).float()
    acc = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.float32)
    split = fused_ops.mlp_split_k(x, gate_up, down, acc).to(torch.bfloat16).float()
    return (two - exact).abs().max().item(), (split - exact).abs().max().item()


def per_layer_us(graph) -> float:
    return 1000 * replay_ms(graph, 10) / LAYERS


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--quick-sweep", action="store_true", help="--sweep over the splits (PAIR) and down tiles only")
    p.add_argument("--best-out", default=None, help="write the best tile as JSON, for --set in bench/gpu.py")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    say = Report()
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, PDL {fused_ops.pdl_options(torch.device('cuda'))}")
    layers = [(torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) / 30,
               torch.randn(HIDDEN, INTERMEDIATE, device="cuda", dtype=torch.bfloat16) / 60) for _ in range(LAYERS)]
    ideal = (3 * INTERMEDIATE * HIDDEN * 2) / (4.28e12) * 1e6
    say(f"{LAYERS} layers of gate/up {2 * INTERMEDIATE}x{HIDDEN} and down {HIDDEN}x{INTERMEDIATE}, bf16; "
        f"{ideal:.2f} us a layer at 4.28 TB/s")
    if args.sweep or args.quick_sweep:
        separate, _ = build(1, False, layers)
        base = min(per_layer_us(separate) for _ in range(3))
        say(f"two launches (gate/up, down) at 1 row: {base:.2f} us a layer")
        say("| (PAIR, BLOCK_K, OUT_TILE, stages, warps) | us a layer | against two launches |")
        say("|---|---|---|")
        results = []
        # Round 19's H100 sweep gave (64, 128, 256, 3, 4), 128 programs for 132 SMs: the quick sweep looks around it.
        grid = (((32, 64), (128, 256), (256, 512), (3,), (4, 8)) if args.quick_sweep else
                ((16, 32, 64), (128, 256), (64, 128, 256), (3,), (4, 8)))
        for config in itertools.product(*grid):
            fused_ops.MLP_SPLIT_K_CONFIG = config
            try:
                graph, _ = build(1, True, layers)
            except Exception as exc:  # noqa: BLE001 - a tile past shared memory or registers
                say(f"| {config} | {type(exc).__name__} | |")
                continue
            us = min(per_layer_us(graph) for _ in range(3))
            results.append((us, config))
            say(f"| {config} | {us:.2f} | {base / us:.3f}x |")
            del graph
        results.sort()
        fused_ops.MLP_SPLIT_K_CONFIG = results[0][1]
        say(f"best: {results[0][1]} {results[0][0]:.2f} us")
        if args.best_out:
            Path(args.best_out).write_text(json.dumps(list(results[0][1])))
    say("")
    say(f"Interleaved rounds ({args.rounds}), split-K tile {fused_ops.MLP_SPLIT_K_CONFIG}:")
    say("| rows | two launches us a layer | split-K us a layer | ratio | max abs difference after 16 layers "
        "| one layer's max abs error against float32: two launches, split-K |")
    say("|---|---|---|---|---|---|")
    for rows in args.rows:
        (separate, expected), (split, got) = build(rows, False, layers), build(rows, True, layers)
        times = {"separate": [], "split": []}
        for r in range(args.rounds):
            order = ("separate", "split") if r % 2 == 0 else ("split", "separate")
            for name in order:
                times[name].append(per_layer_us(separate if name == "separate" else split))
        a, b = statistics.median(times["separate"]), statistics.median(times["split"])
        diff = (expected.float() - got.float()).abs().max().item()
        two_error, split_error = one_layer_errors(rows, *layers[0])
        say(f"| {rows} | {a:.2f} | {b:.2f} | {a / b:.3f}x | {diff:.3g} | {two_error:.3g}, {split_error:.3g} |")
    if args.out:
        say.write(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
