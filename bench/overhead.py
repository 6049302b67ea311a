"""Per-step CPU overhead of the engine: the embedded 1.3M-parameter model, so much of the time is scheduling,
buffers and bookkeeping.

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
    torch.set_num_threads(1)
    p.add_argument("--overlap-steps", action="store_true")
    p.add_argument("--stand-in-model", action="store_true",
                   help="ModelRunner.run returns logits prepared once: the engine's host work alone")
    args = p.parse_args()
    extra = {"overlap_steps": True} if args.overlap_steps else {}
    llm = LLM(max_num_seqs=args.batch, **extra)  # the embedded 1.3M-parameter model
    if args.stand_in_model:
        from zoo.step import StepOutput

        rows, engine = llm.engine.runner.limits.max_num_tokens, llm.engine
        logits = torch.randn(rows, engine.description.vocab_size)
        argmax, hidden = logits.argmax(-1), torch.zeros(rows, engine.description.hidden_size)
        engine.runner.run = lambda batch: StepOutput(logits[:len(batch.logits_indices)], hidden, {},
                                                     argmax[:len(batch.logits_indices)])
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
    print(f"batch {args.batch}: {1000 * seconds / args.steps:.3f} ms per step " + (
        "(a stand-in for the model: the engine's host work)" if args.stand_in_model else
        "(the embedded 1.3M-parameter model: engine overhead and a small forward pass)"))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
