"""Where the offline workload's time goes on the GPU (issue 15): bench/gpu.py's 256 requests under torch.profiler.

    python bench/profile_offline.py --out OUT

Runs the workload once to warm up (prompts of their own), then once more with the host timing every engine
step by kind (steps carrying prompt tokens, decode-only steps), then a third time under torch.profiler.
Prints, and writes to OUT/profile_offline.txt:
  * wall time per kind of step and the number of steps;
  * per CUDA kernel: launches, total time, share of all kernel time (the top 30);
  * per host operator: self CPU time (the top 20);
  * total kernel time against wall time: how long the GPU sat idle.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu import SHAPE, offline_requests, write_checkpoint  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from zoo import LLM, SamplingParams

    lines = []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), args.layers)
        llm = LLM(tmp, dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
                  gpu_memory_utilization=0.85, overlap_steps=True)
        engine, vocab = llm.engine, SHAPE["vocab_size"]
        params = SamplingParams(max_new_tokens=256, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(offline_requests(vocab, args.requests, seed=4), params)
        say(f"warm-up: {time.perf_counter() - start:.2f} s")

        spent, counts = defaultdict(float), defaultdict(int)
        step = engine.step

        def timed_step():
            waiting_prompts = any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running) or bool(
                engine.scheduler.waiting)
            t0 = time.perf_counter()
            out = step()
            kind = "steps with prompt tokens" if waiting_prompts else "decode-only steps"
            spent[kind] += time.perf_counter() - t0
            counts[kind] += 1
            return out

        engine.step = timed_step
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(offline_requests(vocab, args.requests, seed=2), params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        del engine.step
        generated = sum(len(o.token_ids) for o in outs)
        say(f"timed run: {generated / wall:.0f} output tok/s ({wall:.2f} s)")
        for kind in spent:
            say(f"  {kind}: {counts[kind]} steps, {spent[kind]:.2f} s")

        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(offline_requests(vocab, args.requests, seed=3), params)
            torch.cuda.synchronize()
            profiled_wall = time.perf_counter() - start
        events = prof.key_averages()
        kernels = [e for e in events if e.device_time_total > 0 and e.self_device_time_total > 0
                   and not e.key.startswith(("aten::", "cuda", "Memcpy", "Memset"))]
        copies = [e for e in events if e.key.startswith(("Memcpy", "Memset"))]
        total_kernel = sum(e.self_device_time_total for e in kernels + copies) / 1e6
        say(f"profiled run: {profiled_wall:.2f} s wall, {total_kernel:.2f} s of kernels and copies on the GPU")
        say("| kernel | launches | s | share |")
        say("|---|---|---|---|")
        for e in sorted(kernels + copies, key=lambda e: -e.self_device_time_total)[:30]:
            say(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1e6:.3f} | "
                f"{100 * e.self_device_time_total / 1e6 / total_kernel:.1f}% |")
        say("")
        say("| host operator | calls | self CPU s |")
        say("|---|---|---|")
        for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]:
            say(f"| {e.key[:90]} | {e.count} | {e.self_cpu_time_total / 1e6:.3f} |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile_offline.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
