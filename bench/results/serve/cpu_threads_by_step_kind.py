# LLM.generate of bench/serve.py's concurrency-64 workload, one and two compute threads taking turns in one process,
# with the time in steps that carry prompt tokens and in decode-only steps (EngineStats). Run from the repository root:
#   python bench/results/serve/cpu_threads_by_step_kind.py
import random, time, torch, sys, dataclasses
sys.path.insert(0, "bench")
from serve import WORDS
from zoo import LLM, SamplingParams
rng = random.Random(0)
prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(256)]
llm = LLM(max_num_seqs=64, device="cpu")
p = SamplingParams(max_new_tokens=64, ignore_eos=True)
llm.generate(prompts[:64], p)
for r in range(3):
    for th in (1, 2):
        torch.set_num_threads(th)
        st = llm.engine.stats
        before = dataclasses.replace(st)
        t = time.perf_counter(); outs = llm.generate(prompts, p); dt = time.perf_counter() - t
        st = llm.engine.stats
        print(th, "threads", round(sum(len(o.token_ids) for o in outs) / dt), "tok/s; prefill steps s",
              round(st.prefill_seconds - before.prefill_seconds, 3), "decode-only s", round(st.decode_seconds - before.decode_seconds, 3),
              "steps", st.steps - before.steps, "total", round(dt, 3))
