"""The Triton decode kernel alone, for each tile width (``BLOCKS_PER_ITER``), on Llama-3.2-1B attention shapes.

    python bench/decode_kernel.py            # prints a table, then "best N" (fastest over batch 64 and 256)

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


def graph_time(fn, calls: int = 20, replays: int = 10) -> float:
    """Microseconds per ``fn()`` call: a CUDA graph of ``calls`` calls replayed ``replays`` times (best of 3)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    best = None
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = 1000 * start.elapsed_time(end) / (replays * calls)
        best = us if best is None else min(best, us)
    return best


def main() -> int:
    cases = [(1, 256), (64, 256), (64, 1024), (256, 700)]
    choices = [n for n in (1, 2, 4) if triton_attention.BLOCKS_PER_SPLIT % n == 0]
    totals = {}
    print("| batch | context | " + " | ".join(f"{n} block(s) per tile, us" for n in choices) + " |")
    print("|---|---|" + "---|" * len(choices))
    for batch, context in cases:
        row = []
        for n in choices:
            triton_attention.BLOCKS_PER_ITER = n
            us = time_kernel(batch, context)
            row.append(us)
            if batch >= 64:
                totals[n] = totals.get(n, 0.0) + us
        print(f"| {batch} | {context} | " + " | ".join(f"{us:.1f}" for us in row) + " |", flush=True)
    print(f"best {min(totals, key=totals.get)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
