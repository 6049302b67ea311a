"""Diagnostic: 1 x 2047 prefill on the Llama-1B shape, per-token lists against the device layout, taking turns."""
import statistics, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu as G
import zoo.model_runner as mr
from zoo import LLM, SamplingParams

folder = Path(tempfile.mkdtemp())
G.write_checkpoint(folder, 16)
llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=2048,
          gpu_memory_utilization=0.85, overlap_steps=True)
runner = llm.engine.runner
real = mr.device_lays_out
ways = {"lists": lambda e: False, "runs": real}
print("prompt graph sizes", getattr(runner.graphs, "prompt_sizes", None), "mixed", getattr(runner.graphs, "mixed_sizes", None))
g = torch.Generator().manual_seed(1)
sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
def one(seqs, length):
    prompts = torch.randint(0, 128256, (seqs, length), generator=g).tolist()
    torch.cuda.synchronize(); t = time.perf_counter(); llm.generate(prompts, sp); return time.perf_counter() - t
# which path each step takes
orig_prepare = runner.prepare
log = []
def prep(scheduled):
    b = orig_prepare(scheduled)
    log.append((b.graph, None if b.attention is None else (b.attention.fresh_causal, b.attention.mask is not None, b.attention.split is not None)))
    return b
runner.prepare = prep
for fresh in (True, False):
    runner.fresh_causal_path = fresh
    for seqs, length in ((1, 2047), (16, 1024), (1, 1000)):
        times = {k: [] for k in ways}
        for r in range(5):
            for k, rule in (ways.items() if r % 2 == 0 else reversed(ways.items())):
                mr.device_lays_out = rule
                log.clear()
                times[k].append(one(seqs, length))
                if r == 4:
                    print(f"  fresh={fresh} {seqs}x{length} {k}: steps {log[:3]}")
        print(f"fresh={fresh} {seqs}x{length}: " + "  ".join(f"{k} min {1000*min(v):.2f} med {1000*statistics.median(v):.2f} ms" for k, v in times.items()), flush=True)
runner.fresh_causal_path = True
# profile one each
from torch.profiler import profile, ProfilerActivity
for k, rule in ways.items():
    mr.device_lays_out = rule
    one(1, 2047)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one(1, 2047)
    print(f"==== profile {k}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
