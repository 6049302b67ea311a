"""Host time per step of `zoo.serve`'s engine loop under load, the forward pass left out.

At 64 concurrent clients on the H200 the server's engine process was busy 0.97-1.00 cores: its Python, not the
GPU, set the pace (bench/results/serve/h200_round4/). This runs that loop (`zoo.engine_process.EngineLoop`) in this
process on the embedded model's engine, on CPU, with the two things that are not the engine's host work
replaced:
  * the model: `ModelRunner.run` returns logits prepared once (every request gets the same tokens), so a step
    costs its scheduling, layout, commit and the loop's messages only;
  * the HTTP process: a stand-in pipe that keeps `--concurrency` streaming requests in flight, sending the next
    one when one finishes, as `bench/serve.py`'s clients do, and counts what the loop sends back.
Steps take the paths they take on a GPU with CUDA graphs: the runner is told the decode graphs (and, with
`--mixed-graph-tokens`, mixed-step graphs) exist, so a step pads its rows for a replay instead of building
eager attention metadata, and admissions wait `--admission-interval` steps as `conf/serve.yaml` sets. What it
cannot show: the CUDA launches of the buffer updates a GPU step makes.

    python bench/engine_loop_host.py --concurrency 64 [--steps 2000] [--profile 30]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from serve import WORDS  # noqa: E402 - bench/serve.py's prompt words


class LoadPipe:
    """The HTTP process's end of the pipe: ``concurrency`` streaming submissions in flight at all times."""

    def __init__(self, prompts, max_tokens: int, concurrency: int):
        self.prompts, self.max_tokens = prompts, max_tokens  # (text, its token ids), as the HTTP process sends them
        self.inbox = [self._submission(i) for i in range(concurrency)]
        self.next_ident = concurrency
        self.finished = self.deltas = 0

    def _submission(self, ident: int) -> tuple:
        text, ids = self.prompts[ident % len(self.prompts)]
        return ("add", ident, [({"prompt": text, "prompt_ids": ids},
                                {"max_new_tokens": self.max_tokens, "ignore_eos": True})], True)

    def poll(self, timeout=None) -> bool:
        return bool(self.inbox)

    def recv(self):
        return self.inbox.pop(0)

    def send(self, message) -> None:
        for _, event in message[1]:
            if event[0] == "delta":
                self.deltas += 1
            elif event[0] == "finished":
                self.finished += 1
                self.inbox.append(self._submission(self.next_ident))
                self.next_ident += 1
            elif event[0] == "error":
                raise SystemExit(f"a request failed: {event[1]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000, help="steps per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--admission-interval", type=int, default=8)
    p.add_argument("--mixed-graph-tokens", type=int, default=512,
                   help="steps mixing prompts with decodes take a mixed graph's path up to this many tokens (0: eager)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="then one more round under cProfile: top N")
    args = p.parse_args()
    torch.set_num_threads(1)
    from zoo import LLM
    from zoo.cuda_graphs import token_buckets
    from zoo.engine_process import EngineLoop
    from zoo.step import StepOutput

    llm = LLM(max_num_seqs=args.concurrency, max_num_batched_tokens=2048, enable_prefix_caching=False)
    engine, runner = llm.engine, llm.engine.runner
    graphs = runner.graphs
    for size in graphs.batch_sizes():  # as if captured: steps of plain decodes pad their rows for a replay
        graphs.graphs[("decode", size)] = None
    graphs.mixed_sizes = token_buckets(min(args.mixed_graph_tokens, runner.limits.max_num_tokens))
    engine.scheduler.admission_interval = args.admission_interval
    vocab, rows = engine.description.vocab_size, runner.limits.max_num_tokens
    logits = torch.randn(rows, vocab)
    argmax, hidden = logits.argmax(-1), torch.zeros(rows, engine.description.hidden_size)
    runner.run = lambda batch: StepOutput(logits[:len(batch.logits_indices)], hidden, {},
                                          argmax[:len(batch.logits_indices)])
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(256)]
    prompts = [(text, llm.tokenizer.encode(text)) for text in texts]

    def run_round(steps: int) -> tuple[float, LoadPipe]:
        pipe = LoadPipe(prompts, args.max_tokens, args.concurrency)
        loop = EngineLoop(llm, [pipe])
        start = time.perf_counter()
        for _ in range(steps):
            for message in loop._messages():
                loop._handle(message)
            if engine.has_work():
                loop._step()
            loop._send()
        seconds = time.perf_counter() - start
        for ident in list(loop.requests_of):  # leave the engine empty for the next round
            loop._abort(ident)
        while engine.has_work():
            engine.step()
        return seconds, pipe

    run_round(200)  # warm-up
    times = []
    for _ in range(args.rounds):
        seconds, pipe = run_round(args.steps)
        times.append(seconds)
        print(f"{args.steps} steps: {1e6 * seconds / args.steps:.1f} us per step, {pipe.finished} requests "
              f"finished, {pipe.deltas} stream deltas", flush=True)
    # the fastest round is the least disturbed by the rest of the machine; the median for its spread
    print(f"engine loop host time at concurrency {args.concurrency}: {1e6 * min(times) / args.steps:.1f} us per step "
          f"in the fastest of {args.rounds} rounds, median {1e6 * statistics.median(times) / args.steps:.1f} "
          f"(admission_interval {args.admission_interval}, mixed graphs up to {args.mixed_graph_tokens} tokens)")
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run_round(args.steps)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
