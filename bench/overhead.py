"""Per-step CPU overhead of the engine: a tiny model, so the time is scheduling, buffers and bookkeeping.

    python bench/overhead.py --batch 64 --steps 64 [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from zoo import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    llm = LLM(overrides=["model.embedded.hidden_size=16", "model.embedded.intermediate_size=16",
                         "model.embedded.num_hidden_layers=1", "model.embedded.num_attention_heads=1",
                         "model.embedded.num_key_value_heads=1"], max_num_seqs=args.batch)
    prompts = [[1 + (i % 200)] * 32 for i in range(args.batch)]
    params = SamplingParams(max_new_tokens=args.steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    llm.engine.blocks.enable_prefix_caching = False
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(prompts, params)
    if profiler:
        profiler.disable()
    seconds = time.perf_counter() - start
    print(f"batch {args.batch}: {1000 * seconds / args.steps:.3f} ms per step (tiny model: mostly engine overhead)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
