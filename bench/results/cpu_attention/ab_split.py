"""Interleaved A/B: mixed and whole-prompt steps kind by kind (fresh_causal_path) against the dense mask, on
staggered arrivals like a server's (a new request whenever one finishes)."""
import random, time, statistics, sys, torch
from zoo import LLM
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
WORDS = ["def", "class", "import", "return", "for", "while", "if", "self", "print", "yield", "lambda", "(", ")"]
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(512)]
llm = LLM(max_num_seqs=64)
eng = llm.engine
def go(n_total, stagger=True):
    it = iter(prompts[:n_total]); live = 0; tokens = 0; outs = []
    for i, p in enumerate(it):
        outs.append(llm._add({"prompt": p}, {"max_new_tokens": 64 - (i % 16 if stagger else 0), "ignore_eos": True}, i)); live += 1
        if live == 64: break
    t = time.perf_counter()
    while eng.has_work():
        for req, toks in eng.step():
            tokens += len(toks)
            if req.is_finished:
                nxt = next(it, None)
                if nxt is not None:
                    outs.append(llm._add({"prompt": nxt}, {"max_new_tokens": 64, "ignore_eos": True}, 0))
    return tokens / (time.perf_counter() - t), [r.output_token_ids for r in outs]
go(64)
res = {False: [], True: []}; toks = {}
for r in range(int(sys.argv[2]) if len(sys.argv) > 2 else 6):
    for flag in (False, True) if r % 2 == 0 else (True, False):
        eng.runner.fresh_causal_path = flag
        rate, toks[flag] = go(256)
        res[flag].append(rate)
print("same tokens:", toks[False] == toks[True])
for k, v in res.items():
    print("kind by kind" if k else "dense mask  ", "median %.0f" % statistics.median(v), [round(x) for x in v])
