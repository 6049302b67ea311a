"""Host time of laying a step out: the per-token lists against the device layout (`StepLayout.runs`), in one process.

    python bench/step_layout.py [--device cuda] [--repeats 15]

A small random-init Llama (the forward pass is not what is timed) runs workloads of prompts; each step's
`ModelRunner.prepare` is timed both ways, taking turns, REPEATS times (medians), before the step runs as the engine
chose. Then the host's share of a one-prompt `generate` of 2,040 tokens (its wall time less the forward pass's),
the two ways taking turns. On CUDA the times include launching the device layout's operations, not their run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import zoo.model_runner as model_runner

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
    runner, device_lays_out = llm.engine.runner, model_runner.device_lays_out
    prepare, run = runner.prepare, runner.run
    ways = (("lists", lambda entry: False), ("device layout", device_lays_out))

    def drain():
        if args.device == "cuda":
            torch.cuda.synchronize()

    steps = {}

    def timed_prepare(scheduled):
        times = {label: [] for label, _ in ways}
        for _ in range(args.repeats):
            for label, rule in ways:
                model_runner.device_lays_out = rule
                drain()
                start = time.perf_counter()
                prepare(scheduled)
                times[label].append(time.perf_counter() - start)
        model_runner.device_lays_out = device_lays_out
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
    print("| step: sequences, tokens | steps | lists, ms | device layout, ms |")
    print("|---|---|---|---|")
    for (seqs, tokens), seen in steps.items():
        lists, device = (1000 * statistics.median(s[label] for s in seen) for label, _ in ways)
        print(f"| {seqs}, {tokens} | {len(seen)} | {lists:.3f} | {device:.3f} |")

    forward = [0.0]

    def timed_run(*a, **k):
        start = time.perf_counter()
        out = run(*a, **k)
        drain()
        forward[0] += time.perf_counter() - start
        return out

    runner.run = timed_run
    host = {label: [] for label, _ in ways}
    for _ in range(args.generates):
        for label, rule in ways:
            model_runner.device_lays_out = rule
            prompt = torch.randint(0, 1000, (1, 2040), generator=g).tolist()
            forward[0] = 0.0
            start = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
            host[label].append(time.perf_counter() - start - forward[0])
    model_runner.device_lays_out, runner.run = device_lays_out, run
    print(f"the host's share of a 1 x 2,040 generate (all but the forward pass), medians of {args.generates - 2} "
          "taking turns: " + ", ".join(f"{label} {1000 * statistics.median(t[2:]):.2f} ms" for label, t in host.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
