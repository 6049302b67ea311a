"""`runtime.cpu_keep_freed_memory` on CPU: `LLM.generate` of `bench/serve.py`'s widest level (256 requests of 64
greedy tokens, at most 64 at once, the embedded model), with and without it, at one and two compute threads.

Each run is a fresh process (the setting is for the process, and cannot be taken back within it), the variants
taking turns round by round, so that a machine whose speed drifts falls on each alike. Prints output tokens/s,
the minor page faults and the system CPU time of the timed run, and the medians.

    python bench/cpu_memory.py --rounds 3 --out bench/results/cpu_keep_freed_memory.json
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

VARIANTS = [(keep, threads) for keep in (False, True) for threads in (1, 2)]


def one_run(keep: bool, threads: int, requests: int, max_tokens: int) -> dict:
    import torch

    from serve import WORDS
    from zoo import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(requests)]
    torch.set_num_threads(threads)
    llm = LLM(max_num_seqs=64, cpu_keep_freed_memory=keep)
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:64], params)  # warm-up: the step shapes and the prefix cache, as bench/serve.py's
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outs = llm.generate(prompts, params)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"keep": keep, "threads": threads, "output_tok_s": sum(len(o.token_ids) for o in outs) / wall,
            "minor_faults": after.ru_minflt - before.ru_minflt, "system_s": after.ru_stime - before.ru_stime,
            "seconds": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="write the runs as JSON here")
    p.add_argument("--child", nargs=2, metavar=("KEEP", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one_run(args.child[0] == "1", int(args.child[1]), args.requests, args.max_tokens)))
        return 0
    runs = []
    for r in range(args.rounds):
        for keep, threads in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            done = subprocess.run([sys.executable, __file__, "--child", str(int(keep)), str(threads), "--requests",
                                   str(args.requests), "--max-tokens", str(args.max_tokens)],
                                  capture_output=True, text=True, check=True)
            run = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append(run)
            print(f"round {r + 1}: keep freed memory {str(keep):5}, {threads} thread(s): {run['output_tok_s']:6.0f} "
                  f"output tok/s, {run['minor_faults']:7d} minor faults, {run['system_s']:.2f} s system", flush=True)
    for keep, threads in VARIANTS:
        mine = [run["output_tok_s"] for run in runs if run["keep"] == keep and run["threads"] == threads]
        print(f"keep freed memory {str(keep):5}, {threads} thread(s): median {statistics.median(mine):.0f} output "
              f"tok/s of " + ", ".join(f"{x:.0f}" for x in mine))
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
