"""The Triton decode kernel alone (with its merge), for each launch configuration, on Llama-3.2-1B attention shapes.

    python bench/decode_kernel.py            # a table of configurations x cases, then the fastest per case

A configuration is blocks per split, blocks per tile, programs per launch, warps and stages (``CONFIGS``); its
split size is used at every batch size (zoo switches to ``WIDE_BLOCKS_PER_SPLIT`` from ``WIDE_ROWS`` up).

Each timing replays a CUDA graph of 16 kernel calls, as decode steps do, so launch
costs stay out of it; the figure is microseconds per call (one layer).
"""

from __future__ import annotations

import sys

import torch

from zoo import triton_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, TABLE_WIDTH = 32, 8, 64, 16, 128  # table: max_model_len 2048


def time_kernel(batch: int, context: int, calls: int = 16, replays: int = 50) -> float:
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tables = torch.zeros(batch, TABLE_WIDTH, dtype=torch.int64, device="cuda")
    tables[:, :blocks_per_seq] = torch.randperm(batch * blocks_per_seq, device="cuda").view(batch, -1)
    context_lens = torch.full((batch,), context, device="cuda")
    seq = torch.arange(batch, device="cuda")
    last = context_lens - 1
    bits = torch.full((batch,), -1, device="cuda")

    def call():
        return triton_attention.paged_decode_attention(q, cache[0], cache[1], tables, context_lens, seq, last,
                                                       context_lens, bits, HEAD_DIM ** -0.5, False)

    return graph_time(call, calls, replays)


class Report:
    """Lines printed as they come and kept, then written with the command that made them (``--out``)."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def write(self, path) -> None:
        with open(path, "w") as f:
            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
            f.write(f"Command ({device}): python3 {' '.join(sys.argv)}\n" + "\n".join(self.lines) + "\n")


def graph_time(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds per ``fn()`` call: a CUDA graph of ``calls`` calls replayed ``replays`` times (best of 3)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return 1000 * min(replay_ms(graph, replays) for _ in range(3)) / calls


def replay_ms(graph, replays: int) -> float:
    """Milliseconds per replay of a captured graph, ``replays`` back to back, timed with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


CASES = [(1, 256), (1, 2048), (8, 256), (64, 256), (64, 1024), (256, 700)]
# (blocks per split, blocks per tile, programs per launch, warps, stages); None: Triton's default
CONFIGS = [(4, 4, 2048, None, None), (4, 4, 2048, 2, 1), (4, 4, 2048, 4, 1), (4, 4, 2048, 8, 1),
           (4, 4, 1024, None, None), (4, 4, 4096, None, None), (4, 2, 2048, None, None),
           (8, 4, 2048, None, None), (8, 8, 2048, None, None), (8, 4, 2048, 4, 2), (8, 8, 2048, 8, 1),
           (16, 4, 2048, None, None), (16, 8, 2048, None, None), (16, 16, 2048, 8, 1), (16, 4, 2048, 4, 3)]


def main() -> int:
    """Every configuration on every case; then the fastest configuration per case."""
    saved = (triton_attention.BLOCKS_PER_SPLIT, triton_attention.BLOCKS_PER_ITER, triton_attention.LAUNCH_PROGRAMS,
             triton_attention.NUM_WARPS, triton_attention.NUM_STAGES)
    print("configuration: blocks per split / blocks per tile / programs per launch / warps / stages "
          f"(zoo's now: {'/'.join(map(str, saved))})")
    print("| configuration | " + " | ".join(f"b{b} ctx{c}, us" for b, c in CASES) + " |")
    print("|---|" + "---|" * len(CASES))
    results = {}
    for config in CONFIGS:
        (triton_attention.BLOCKS_PER_SPLIT, triton_attention.BLOCKS_PER_ITER, triton_attention.LAUNCH_PROGRAMS,
         triton_attention.NUM_WARPS, triton_attention.NUM_STAGES) = config
        triton_attention.WIDE_BLOCKS_PER_SPLIT = config[0]  # one split size for every case
        try:
            row = [time_kernel(batch, context) for batch, context in CASES]
        except Exception as exc:  # noqa: BLE001 - a configuration the compiler refuses: report, go on
            print(f"| {'/'.join(map(str, config))} | failed: {type(exc).__name__}: {str(exc)[:120]} |", flush=True)
            continue
        results[config] = row
        print(f"| {'/'.join(map(str, config))} | " + " | ".join(f"{us:.1f}" for us in row) + " |", flush=True)
    for i, (batch, context) in enumerate(CASES):
        best = min(results, key=lambda c: results[c][i])
        print(f"best for b{batch} ctx{context}: {'/'.join(map(str, best))} {results[best][i]:.1f} us "
              f"(zoo's now {results.get(saved, [float('nan')] * len(CASES))[i]:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
