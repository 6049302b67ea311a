"""Where a decode step's time goes on the GPU machine: prepare, forward (graph replay), sampling and commit.

    python bench/profile_gpu_step.py --batch 1 64 --steps 64 --fused-ops on off
Writes, per configuration and batch size, the split per step and torch.profiler's top operators to stdout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import write_checkpoint  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--fused-ops", nargs="+", choices=["on", "off"], default=["on"])
    p.add_argument("--table-rows", type=int, default=25)
    args = p.parse_args()
    from zoo import LLM

    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args.layers)
        for fused in args.fused_ops:
            llm = LLM(tmp, dtype="bfloat16", max_num_seqs=max(64, *args.batch), max_model_len=2048,
                      fused_ops=fused == "on", gpu_memory_utilization=0.5)
            for batch in args.batch:
                print(f"=== fused_ops {fused}", flush=True)
                profile(llm, batch, args.steps, args.table_rows)
            del llm
            torch.cuda.empty_cache()
    return 0


def profile(llm, batch, steps, table_rows):
    from zoo import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    spent = {"prepare": 0.0, "run (synchronized)": 0.0, "sampler.select": 0.0}

    def timed(name, fn, sync=False):
        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            if sync:
                torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            return out
        return wrapper

    prompts = [[1] * 128 for _ in range(batch)]
    params = SamplingParams(max_new_tokens=steps, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    runner.prepare = timed("prepare", runner.prepare)
    runner.run = timed("run (synchronized)", runner.run, sync=True)
    engine.sampler.select = timed("sampler.select", engine.sampler.select)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    for name in ("prepare", "run", "select"):  # unwrap for the next batch size
        for owner in (runner, engine.sampler):
            owner.__dict__.pop(name, None)
    print(f"batch {batch}, {steps} steps: {1000 * total / steps:.3f} ms per step")
    for name, seconds in spent.items():
        print(f"  {name:22s} {1000 * seconds / steps:.3f} ms per step")
    print(f"  {'rest of Engine.step':22s} {1000 * (total - sum(spent.values())) / steps:.3f} ms per step")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=table_rows))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=table_rows), flush=True)


if __name__ == "__main__":
    sys.exit(main())
