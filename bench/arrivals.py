"""The engine under a server's arrivals, without HTTP: ``--concurrency`` requests in flight, the next one added as
soon as one finishes (as `bench/serve.py`'s clients send them), stepped by `Engine.step` in this process.

What it shows that neither neighbour does: `bench/serve.py` times the engine with the HTTP process and the clients
beside it (on a small machine they share its cores), and `LLM.generate` adds every request at once, so its requests
finish together and few steps mix decodes with prompts. Here most steps after the first wave do, as in a server.

Variants run interleaved in one process, so that a machine whose speed drifts between runs compares them fairly;
greedy tokens must be the same in all. A variant is ``KEY=VALUE[,KEY=VALUE...]``: runtime settings of its own
`LLM` (``mixed_graph_tokens=512``), or ``runner.ATTR=VALUE`` set on its model runner after start-up, for code paths
without a setting (``runner.fresh_causal_path=false``: the dense mask over every step, as CPU did before).

    python bench/arrivals.py --threads 1 --variants runner.fresh_causal_path=false default
    python bench/arrivals.py --llama-1b --variants default mixed_graph_tokens=512     # on CUDA
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve import WORDS, json_or_text  # noqa: E402 - bench/serve.py's prompt words and value parsing


def parse_variant(spec: str) -> tuple[dict, dict]:
    """``KEY=VALUE,...`` -> (runtime settings, runner attributes); ``default`` is neither, and ``offline`` (alone
    or as an item) sets the runner attribute ``offline``, read by `main`: every request at once."""
    runtime, runner = {}, {}
    for item in [] if spec == "default" else spec.split(","):
        key, _, value = item.partition("=")
        if key == "offline":
            runner["offline"] = True
        elif key.startswith("runner."):
            runner[key[len("runner."):]] = json_or_text(value)
        else:
            runtime[key] = json_or_text(value)
    return runtime, runner


class StepClock:
    """Time of `ModelRunner.run` by kind of step: decodes only, or decodes beside prompts and chunks."""

    def __init__(self, runner):
        self.spent = defaultdict(lambda: [0, 0.0])
        original = runner.run

        def timed(batch, *args, **kwargs):
            start = time.perf_counter()
            out = original(batch, *args, **kwargs)
            kind = "decode" if batch.num_tokens == len(batch.scheduled) else "mixed"
            self.spent[kind][0] += 1
            self.spent[kind][1] += time.perf_counter() - start
            return out

        runner.run = timed


def arrivals(llm, prompts, concurrency: int, max_tokens: int, offline: bool = False) -> tuple[float, list[list[int]]]:
    """Output tok/s of the engine with ``concurrency`` requests in flight, and every request's tokens.

    The first wave's lengths are staggered (max_tokens less 0-15), so that its requests do not finish together.
    ``offline``: every request added at once, all of ``max_tokens``, as `LLM.generate` adds them (the scheduler
    then runs ``max_num_seqs`` at a time)."""
    engine, queue, requests, tokens = llm.engine, iter(enumerate(prompts)), [], 0
    if offline:
        concurrency = len(prompts)

    def add(i, ids, max_new):
        requests.append(llm._add({"prompt_ids": ids}, {"max_new_tokens": max_new, "temperature": 0.0,
                                                          "ignore_eos": True}, i))

    for i, ids in queue:
        add(i, ids, max_tokens if offline else max_tokens - i % 16)
        if len(requests) == concurrency:
            break
    start = time.perf_counter()
    while engine.has_work():
        for request, new in engine.step():
            tokens += len(new)
            if request.is_finished:
                following = next(queue, None)
                if following is not None:
                    add(*following, max_tokens)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - start), [r.output_token_ids for r in requests]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--llama-1b", action="store_true",
                   help="write bench/gpu.py's random-init Llama-3.2-1B-shaped bf16 checkpoint (CUDA) and use it")
    p.add_argument("--variants", nargs="+", default=["default"], metavar="SPEC")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=6, help="runs of each variant, interleaved (order alternating)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--memory-share", type=float, default=None,
                   help="CUDA: each variant's gpu_memory_utilization (default: 0.85 over the variants)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.llama_1b:
        import tempfile

        from gpu import write_checkpoint  # noqa: E402 - bench/gpu.py

        args.model = tempfile.mkdtemp(prefix="zoo_arrivals_1b_")
        write_checkpoint(Path(args.model), 16)
    from zoo import LLM

    engines = {}
    for spec in args.variants:
        runtime, runner = parse_variant(spec)
        if torch.cuda.is_available():
            runtime.setdefault("gpu_memory_utilization", args.memory_share or 0.85 / len(args.variants))
        llm = LLM(args.model, max_num_seqs=args.concurrency, **runtime)
        offline = runner.pop("offline", False)
        for name, value in runner.items():
            setattr(llm.engine.runner, name, value)
        engines[spec] = (llm, StepClock(llm.engine.runner), offline)
    vocab = engines[args.variants[0]][0].engine.description.vocab_size
    rng = random.Random(0)
    tokenizer = engines[args.variants[0]][0].tokenizer
    if tokenizer is not None and args.model is None:  # the embedded model: bench/serve.py's prompts
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(args.requests)]
        prompts = [tokenizer.encode(t) for t in texts]
    else:
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(4, 60))] for _ in range(args.requests)]
    for llm, _, offline in engines.values():  # warm-up: every step shape of a full run
        arrivals(llm, prompts, args.concurrency, args.max_tokens, offline)
    rates, outputs = defaultdict(list), {}
    for r in range(args.rounds):
        for spec in args.variants if r % 2 == 0 else args.variants[::-1]:
            llm, clock, offline = engines[spec]
            clock.spent.clear()
            rate, outputs[spec] = arrivals(llm, prompts, args.concurrency, args.max_tokens, offline)
            rates[spec].append(rate)
            steps = ", ".join(f"{kind} {n} steps {s:.2f} s" for kind, (n, s) in sorted(clock.spent.items()))
            print(f"round {r + 1} {spec}: {rate:.0f} output tok/s ({steps})", flush=True)
    first = outputs[args.variants[0]]
    print(f"{args.requests} requests, {args.concurrency} in flight, {args.max_tokens} tokens each, "
          f"{torch.get_num_threads()} threads, {engines[args.variants[0]][0].engine.runner.device}")
    for spec in args.variants:
        # in bf16 a different step shape may flip a near-tie: counted, for the tests to judge
        # (the staggered first wave's requests are shorter: compared over the shorter of the two)
        differ = sum(a[:len(b)] != b[:len(a)] for a, b in zip(outputs[spec], first))
        print(f"  {spec}: median {statistics.median(rates[spec]):.0f} output tok/s "
              f"({', '.join(f'{x:.0f}' for x in rates[spec])}); "
              + (f"{differ} requests' tokens differ from the first variant's" if differ else "same tokens"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
