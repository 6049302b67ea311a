"""Engine stepping like a server at c64: a new request joins whenever one finishes; time steps by kind."""
import random, time, sys, torch
from collections import defaultdict
from zoo import LLM, SamplingParams
from zoo.model_runner import ModelRunner
torch.set_num_threads(1)
llm = LLM(max_num_seqs=64, **({"attention_backend": sys.argv[1]} if len(sys.argv) > 1 and sys.argv[1] != "-" else {}))
WORDS = ["def", "class", "import", "return", "for", "while", "if", "self", "print", "yield", "lambda", "(", ")"]
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(512)]
times = defaultdict(lambda: [0, 0.0])
orig = ModelRunner.run
def run(self, batch, *a, **k):
    t = time.perf_counter(); out = orig(self, batch, *a, **k)
    kind = "decode" if batch.num_tokens == len(batch.scheduled) else "mixed"
    times[kind][0] += 1; times[kind][1] += time.perf_counter() - t
    return out
ModelRunner.run = run
params = SamplingParams(max_new_tokens=64, ignore_eos=True)
eng = llm.engine
def go(n_total, stagger):
    it = iter(prompts[:n_total]); live = 0; tokens = 0
    for i, p in enumerate(it):
        llm._add({"prompt": p}, {"max_new_tokens": 64 - (i % 16 if stagger else 0), "ignore_eos": True}, i); live += 1
        if live == 64: break
    t = time.perf_counter()
    while eng.has_work():
        for req, toks in eng.step():
            tokens += len(toks)
            if req.is_finished:
                nxt = next(it, None)
                if nxt is not None:
                    llm._add({"prompt": nxt}, {"max_new_tokens": 64, "ignore_eos": True}, 0)
    return tokens / (time.perf_counter() - t)
go(64, False)
for stagger in (False, True, False, True):
    times.clear()
    r = go(256, stagger)
    print(f"stagger={stagger}: {r:.0f} tok/s", {k: (v[0], round(v[1], 2)) for k, v in times.items()})
