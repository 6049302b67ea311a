"""Interleaved: the engine under arrivals (bench/arrivals.py) alone, and beside a busy pure-Python process."""
import random, statistics, subprocess, sys, time
sys.path.insert(0, "bench")  # run from the repository root: python bench/results/serve/cpu_contention.py
import torch
from arrivals import arrivals
from serve import WORDS
from zoo import LLM
torch.set_num_threads(1)
llm = LLM(max_num_seqs=64)
rng = random.Random(0)
prompts = [llm.tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))) for _ in range(256)]
arrivals(llm, prompts, 64, 64)
rates = {"alone": [], "beside a busy process": []}
for r in range(8):
    for side in (("alone", "beside a busy process") if r % 2 == 0 else ("beside a busy process", "alone")):
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if side != "alone" else None
        time.sleep(0.3)
        rates[side].append(arrivals(llm, prompts, 64, 64)[0])
        if busy:
            busy.kill(); busy.wait()
for side, v in rates.items():
    print(f"{side}: median {statistics.median(v):.0f} output tok/s ({', '.join(f'{x:.0f}' for x in v)})")
