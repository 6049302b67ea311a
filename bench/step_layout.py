"""Host time of laying a step out: the per-token lists against the device layout (`StepLayout.runs`), in one process.

    python bench/step_layout.py [--device cuda] [--repeats 15]

A small random-init Llama (the forward pass is not what is timed) runs workloads of prompts; each step's
`ModelRunner.prepare` is timed both ways, taking turns, REPEATS times (medians), before the step runs as the engine
chose. Then the host's share of a one-prompt `generate` of 2,040 tokens (its wall time less the forward pass's),
the ways taking turns. On CUDA the times include launching the device layout's operations, not their run, and a
third way joins in: the device layout as one kernel (`fused_ops.lay_out_runs`, where fused ops run) instead of the
PyTorch ops.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import zoo.model_runner as model_runner
from zoo import fused_ops

WORKLOADS = ((1, 2040, 1), (8, 1024, 1), (64, 50, 6), (16, 300, 4))  # prompts, tokens each, new tokens


def main() -> int:
    import transformers

    from zoo import LLM, SamplingParams

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--generates", type=int, default=30)
    args = p.parse_args()
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    llm = LLM(folder, dtype="float32", device=args.device, max_num_seqs=256, max_num_batched_tokens=8192,
              max_model_len=2048, num_kv_blocks=4096)
    runner, device_lays_out, runs_kernel = llm.engine.runner, model_runner.device_lays_out, fused_ops.RUNS_KERNEL
    prepare, run = runner.prepare, runner.run
    # (label, which entries the device lays out, whether one kernel does it)
    ways = [("lists", lambda entry: False, False), ("device layout", device_lays_out, False)]
    if runner.model.fused:
        ways.append(("device layout, one kernel", device_lays_out, True))

    def use(way):
        model_runner.device_lays_out, fused_ops.RUNS_KERNEL = way[1], way[2]

    def drain():
        if args.device == "cuda":
            torch.cuda.synchronize()

    steps = {}

    def timed_prepare(scheduled):
        times = {way[0]: [] for way in ways}
        for _ in range(args.repeats):
            for way in ways:
                use(way)
                drain()
                start = time.perf_counter()
                prepare(scheduled)
                times[way[0]].append(time.perf_counter() - start)
        use(("", device_lays_out, runs_kernel))
        key = (len(scheduled), sum(e.num_tokens for e in scheduled))
        steps.setdefault(key, []).append({label: statistics.median(t) for label, t in times.items()})
        return prepare(scheduled)

    runner.prepare = timed_prepare
    g = torch.Generator().manual_seed(1)
    for prompts, length, new in WORKLOADS:
        llm.generate(torch.randint(0, 1000, (prompts, length), generator=g).tolist(),
                     SamplingParams(max_new_tokens=new, ignore_eos=True))
    runner.prepare = prepare
    print(f"{args.device}, torch {torch.__version__}: ModelRunner.prepare, medians of {args.repeats} taking turns "
          "(a kind of step seen more than once: the median of its medians)")
    print("| step: sequences, tokens | steps | " + " | ".join(f"{way[0]}, ms" for way in ways) + " |")
    print("|---|---|" + "---|" * len(ways))
    for (seqs, tokens), seen in steps.items():
        medians = (1000 * statistics.median(s[way[0]] for s in seen) for way in ways)
        print(f"| {seqs}, {tokens} | {len(seen)} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")

    forward = [0.0]

    def timed_run(*a, **k):
        start = time.perf_counter()
        out = run(*a, **k)
        drain()
        forward[0] += time.perf_counter() - start
        return out

    runner.run = timed_run
    host = {way[0]: [] for way in ways}
    for _ in range(args.generates):
        for way in ways:
            use(way)
            prompt = torch.randint(0, 1000, (1, 2040), generator=g).tolist()
            forward[0] = 0.0
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
            host[way[0]].append(time.perf_counter() - start - forward[0])
    use(("", device_lays_out, runs_kernel))
    runner.run = run
    print(f"the host's share of a 1 x 2,040 generate (all but the forward pass), medians of {args.generates - 2} "
          "taking turns: " + ", ".join(f"{label} {1000 * statistics.median(times[2:]):.2f} ms"
                                       for label, times in host.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
