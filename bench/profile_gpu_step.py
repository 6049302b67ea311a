"""Where a decode step's time goes on the GPU (issue 15): host work, the graph replay, and its kernels.

    python bench/profile_gpu_step.py --batch 1 64 --variants main all --out OUT

For each variant (a set of kernel switches, below) and batch size, on the Llama-3.2-1B shape of bench/gpu.py:
  * the engine's decode step (wall), split into prepare / run / commit (sampling and its sync) / the rest,
    timed on the host without extra synchronisation;
  * the decode graph replayed back to back, timed with CUDA events: the GPU's own time per step;
  * torch.profiler over graph replays: per kernel name, launches per step, time per step, and the idle gap
    before it (from the end of the previous kernel), and the total gap per step;
  * a whole-prompt prefill: one 2,048-token prompt and a batch of 16 prompts of 1,024 tokens.
Writes OUT/profile.json and OUT/profile.txt (the tables as printed).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernel import replay_ms  # noqa: E402
from gpu import SHAPE, write_checkpoint  # noqa: E402

# The switches of issue 15's changes: the decode kernel launches lanes that loop over splits instead of a
# program per possible split (lanes); the LM head's weight-streaming kernel (gemv_rows); whole prompts without
# the mask (fresh); the graph's argmax as two Triton launches instead of torch's (argmax); programmatic dependent
# launch of the Triton kernels (pdl); the layers' projections through the weight-streaming kernel up to
# proj_rows rows; rotary with the cache write and SiLU-and-mul in the epilogues of those products (fold); an
# overlapped step's inputs advanced by one kernel (advance); tiles of one row (one_row). (Round 9 also had the
# RMSNorms folded into those products, since dropped: 3.92 against 1.03 ms per batch-1 replay,
# bench/results/gpu/round9/profile_fold_norms_advance.txt; round 11's second fold, where each product computed its
# rows' norm tile by tile, was 1.052 against 0.938 ms in round 12 and was dropped too, as were deep one-row tiles
# for gate/up (0.946) and the down product's whole 8192-deep rows (0.981): round12/profile_switches.txt.)
# (Round 6 also tried an L2 prefetch of the GEMVs' weights before their PDL wait, since dropped:
# bench/results/gpu/round6/profile_pdl_ab.txt.)
BASE = dict(lanes=True, gemv_rows=32, fresh=True, argmax=False, pdl=False, proj_rows=0, fold=False, advance=False,
            one_row={}, weights_first=False, cached_first=False, step_inputs=False, split_k=False)
# fused_ops.GEMV_ONE_ROW_CONFIGS candidates from `bench/gemv_kernel.py --sweep` on the H200: the o and q/k/v
# products' best narrow tile, and the down product's (both 2048 wide, so one table holds one of them)
NARROW_O = {(4096, 1 << 62): (8, 1024, 3, 2)}
NARROW_DOWN = {(2048, 1 << 62): (4, 1024, 2, 2), (4096, 1 << 62): (8, 1024, 3, 2)}
# round 11: whole 2048-deep rows per tile (`bench/gemv_kernel.py --one-row-sweep --cold` on the H200)
DEEP_ROWS = {(4096, 2048): (8, 2048, 3, 2), (4096, 1 << 62): (4, 2048, 3, 4)}
VARIANTS = {
    "main": dict(BASE, lanes=False, gemv_rows=0, fresh=False),
    "round5": BASE,
    "argmax": dict(BASE, argmax=True),
    "pdl": dict(BASE, argmax=True, pdl=True),
    "proj": dict(BASE, argmax=True, proj_rows=16),
    "pdl_proj": dict(BASE, argmax=True, pdl=True, proj_rows=16),
    "new": dict(BASE, argmax=True, pdl=True, proj_rows=1),
    "fold": dict(BASE, argmax=True, pdl=True, proj_rows=1, fold=True),
    "fold_advance": dict(BASE, argmax=True, pdl=True, proj_rows=1, fold=True, advance=True),
    "narrow_o": dict(BASE, argmax=True, pdl=True, proj_rows=1, fold=True, one_row=NARROW_O),
    "narrow_down": dict(BASE, argmax=True, pdl=True, proj_rows=1, fold=True, one_row=NARROW_DOWN),
    # zoo's defaults (fused_ops, triton_attention), and the same without programmatic dependent launch: under PDL
    # a kernel starts before the one it waits for has finished, so the profiler's time for it includes that wait
    # (round 9's batch-1 kernels added up to 1.77 ms for a 0.95-ms replay); without it each kernel's time is its own
    "current": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, advance=True, one_row=DEEP_ROWS,
                    weights_first=True, cached_first=True, step_inputs=True, split_k=True),
    "current_no_pdl": dict(BASE, argmax=True, pdl=False, proj_rows=4, fold=True, advance=True, one_row=DEEP_ROWS,
                           weights_first=True, cached_first=True, step_inputs=True, split_k=True),
    # round 11, before round 12 turned on the decode kernel's first tile of cached keys and values read before its
    # wait (triton_attention.CACHED_FIRST)
    "round11": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, one_row=DEEP_ROWS, weights_first=True),
    # Round 11: the products' first weight tile loaded before the PDL wait (fused_ops.WEIGHTS_FIRST); the down
    # product (8192 deep) on GEMV_CONFIGS' tile at one row (`bench/gemv_kernel.py --cold` on the H100: 14.9 against
    # 16.3 us); and whole 2048-deep rows as one tile, all loaded before the wait
    "round10": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, one_row=NARROW_O),
    "weights_first": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, one_row=NARROW_O, weights_first=True),
    "wf_down_wide": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, weights_first=True,
                         one_row={(4096, 4096): (8, 1024, 3, 2)}),
    "wf_whole_rows": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, weights_first=True,
                          one_row={(4096, 4096): (8, 2048, 1, 4)}),
    # the best one-row tiles of `bench/gemv_kernel.py --one-row-sweep --cold` on the H200 (round 11)
    "deep_rows": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, weights_first=True,
                      one_row={(4096, 2048): (8, 2048, 1, 2), (4096, 1 << 62): (4, 2048, 1, 4)}),
    "deep_rows_staged": dict(BASE, argmax=True, pdl=True, proj_rows=4, fold=True, weights_first=True,
                             one_row=DEEP_ROWS),
}
# Round 13 asked L2 for each layer's first gate/up (and down) weight bytes from its q/k/v kernel, with the products'
# weights loaded evict-first; round 14 put the RMSNorm after the o and down products in their kernel, normalised by
# the program that finished last. Both were dropped: on the H200 the prefetch gave 0.979-0.997x and the norm fold
# 0.926x (bench/results/gpu/round14/profile_norm_fold_prefetch_ablations_h200.txt).
# Round 12's decode kernel without its first cached tile read before the PDL wait (triton_attention.CACHED_FIRST)
VARIANTS["no_cached_first"] = dict(VARIANTS["current"], cached_first=False)
# Round 16: the step's token embedding and rotary tables as nine PyTorch kernels, as before fused_ops.STEP_INPUT_KERNELS
VARIANTS["no_step_inputs"] = dict(VARIANTS["current"], step_inputs=False)
# One-row tiles inside the decode graph, where round 11 chose them from standalone calls on cold weights. Triton
# streams these narrow tiles through registers (no shared-memory stages: num_stages changes nothing), so what sets
# the programs an SM holds is registers: `bench/compile_sm90.py --occupancy --tiles ...` prints them, and the grid
# in waves. The down product (4 columns by 2048, 4 warps: 72 registers, 512 programs, 0.55 waves) with 8 columns
# (188 registers, 0.97 waves) or 8 warps; q/k/v and o (8 columns by 2048, 2 warps: 254 registers) with 4 columns
# on 2 warps (170) or on 4 warps (72 registers, 0.55 waves for o), all under one wave and all loaded before the wait
for _name, _tile in (("down_8col", (8, 2048, 3, 4)), ("down_8warps", (4, 2048, 3, 8))):
    VARIANTS[_name] = dict(VARIANTS["current"], one_row={**DEEP_ROWS, (4096, 1 << 62): _tile})
for _name, _tile in (("narrow_4col", (4, 2048, 3, 2)), ("narrow_4col_4warps", (4, 2048, 3, 4))):
    VARIANTS[_name] = dict(VARIANTS["current"], one_row={**DEEP_ROWS, (4096, 2048): _tile})
# Round 19 turned on the MLP as one split-K launch (fused_ops.MLP_SPLIT_K): the step without it (round 18's), and
# with two other splits of the intermediate columns than the default tile's (PAIR 16 and 32)
VARIANTS["no_split_k"] = dict(VARIANTS["current"], split_k=False)
for _pair in (16, 32):
    VARIANTS[f"split_k_p{_pair}"] = dict(VARIANTS["current"], split_k_pair=_pair)
# Ablations, for timing only (their tokens are wrong): the current kernels with one kind of short kernel left out of
# the step, so that its replay bounds what folding that kind into its neighbours could save: every RMSNorm with its
# residual add (no_norms), the merge of the decode kernel's splits (no_merge), or the decode attention and its merge
# (no_attention)
for _part in ("norms", "merge", "attention"):
    VARIANTS[f"no_{_part}"] = dict(VARIANTS["current"], ablate=_part)
TRITON_ARGMAX = None
SPLIT_K_CONFIG = None  # fused_ops.MLP_SPLIT_K_CONFIG as imported


class _NoLaunch:
    """Stands in for a Triton kernel that an ablation leaves out: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


ABLATED = {}  # (module, name) -> the original, restored by apply() for the next variant


def ablate(part: str | None) -> None:
    from zoo import model, triton_attention, fused_ops

    for (module, name), original in ABLATED.items():
        setattr(module, name, original)
    patches = {"norms": [(fused_ops, "add_rms_norm", lambda x, residual, weight, eps, **_: (x, x))],
               "merge": [(triton_attention, "_merge_splits_kernel", _NoLaunch())],
               "attention": [(model, "paged_attention", lambda q, kv_cache, meta, scale: q)]}.get(part, [])
    for module, name, stand_in in patches:
        ABLATED.setdefault((module, name), getattr(module, name))
        setattr(module, name, stand_in)


def apply(variant: dict) -> None:
    global TRITON_ARGMAX, SPLIT_K_CONFIG
    from zoo import fused_ops, triton_attention

    SPLIT_K_CONFIG = SPLIT_K_CONFIG or fused_ops.MLP_SPLIT_K_CONFIG

    triton_attention.LAUNCH_PROGRAMS = 2048 if variant["lanes"] else 1 << 40
    fused_ops.GEMV_MAX_ROWS = variant["gemv_rows"]
    TRITON_ARGMAX = TRITON_ARGMAX or fused_ops.argmax
    fused_ops.argmax = TRITON_ARGMAX if variant["argmax"] else (lambda logits: logits.argmax(-1))
    triton_attention.PDL = variant["pdl"]
    fused_ops.PROJECTION_GEMV_MAX_ROWS = variant["proj_rows"]
    fused_ops.FOLD_INTO_PROJECTIONS = variant["fold"]
    fused_ops.ADVANCE_KERNEL = variant["advance"]
    fused_ops.GEMV_ONE_ROW_CONFIGS = variant["one_row"]
    fused_ops.WEIGHTS_FIRST = variant["weights_first"]
    triton_attention.CACHED_FIRST = variant["cached_first"]
    fused_ops.STEP_INPUT_KERNELS = variant["step_inputs"]
    fused_ops.MLP_SPLIT_K = variant["split_k"]
    fused_ops.MLP_SPLIT_K_CONFIG = (variant.get("split_k_pair", SPLIT_K_CONFIG[0]), *SPLIT_K_CONFIG[1:])
    ablate(variant.get("ablate"))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--variants", nargs="+", default=["new"], choices=list(VARIANTS))
    p.add_argument("--table-rows", type=int, default=16)
    p.add_argument("--no-prefill", action="store_true")
    p.add_argument("--num-kv-blocks", type=int, nargs="+", default=[0],
                   help="one engine per value, in turn (0: the cache fills gpu_memory_utilization)")
    p.add_argument("--ab-rounds", type=int, default=0,
                   help="keep every variant's engine and time their decode graphs in this many interleaved "
                        "rounds (needs --num-kv-blocks N, so that they fit side by side)")
    p.add_argument("--host-profile", action="store_true",
                   help="also profile the host side of a 1 x 2,040 prefill: cProfile's top functions, and the "
                        "calls that synchronise with the GPU (torch.cuda.set_sync_debug_mode)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.ab_rounds and 0 in args.num_kv_blocks:
        p.error("--ab-rounds needs --num-kv-blocks with a size: every engine stays alive")
    from zoo import LLM

    report, lines = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "variants": {}}, []

    def say(text=""):
        print(text, flush=True)
        lines.append(text)

    kept = []
    with tempfile.TemporaryDirectory() as tmp:
        weight_bytes = write_checkpoint(Path(tmp), args.layers)
        if args.ab_rounds:
            check_engines_fit(p, len(args.variants) * len(args.num_kv_blocks), weight_bytes,
                              max(args.num_kv_blocks), args.layers)
        for name, blocks in [(n, b) for n in args.variants for b in args.num_kv_blocks]:
            apply(VARIANTS[name])
            llm = LLM(tmp, dtype="bfloat16", max_num_seqs=max(64, *args.batch), max_model_len=2048,
                      max_num_batched_tokens=8192, gpu_memory_utilization=0.85, num_kv_blocks=blocks or None)
            llm.engine.runner.fresh_causal_path = VARIANTS[name]["fresh"]
            key = f"{name} kv_blocks={llm.engine.num_blocks}"
            switches = {k: repr(v) if isinstance(v, dict) else v for k, v in VARIANTS[name].items()}  # JSON keys
            entry = report["variants"][key] = {"switches": switches, "decode": {}}
            say(f"=== variant {key}: {VARIANTS[name]}")
            for batch in args.batch:
                entry["decode"][batch] = profile_decode(llm, batch, args.steps, args.table_rows, say)
            if not args.no_prefill:
                entry["prefill"] = profile_prefill(llm, say)
            if args.host_profile:
                entry["prefill_host"] = profile_prefill_host(llm, say)
            if args.ab_rounds:
                kept.append((key, llm, VARIANTS[name]))
            del llm
            gc.collect()  # an engine's KV cache fills its share: free it before the next engine starts
            torch.cuda.empty_cache()
        if kept:
            report["interleaved"] = interleaved_graph_times(kept, args.batch, args.ab_rounds, say)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "profile.json").write_text(json.dumps(report, indent=1))
        (out / "profile.txt").write_text("\n".join(lines) + "\n")
    return 0


STEP_PEAK_BYTES = 4 << 30  # an engine's own step buffers and graphs, above its weights and cache (3.2 GiB measured)


def kv_block_bytes(layers: int, block_size: int = 16) -> int:
    """One block of the benchmark shape's bf16 KV cache: keys and values of every layer."""
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    return layers * 2 * block_size * SHAPE["num_key_value_heads"] * head_dim * 2


def check_engines_fit(parser, engines: int, weight_bytes: int, kv_blocks: int, layers: int,
                      free_bytes: int | None = None) -> None:
    """--ab-rounds keeps every engine alive: refuse at once, naming the cache size that fits, where their weights,
    caches and step buffers would not fit the GPU's free memory (round 13's nine variants of 16,384 blocks ran an
    H100 out of memory after 46 s)."""
    free = torch.cuda.mem_get_info()[0] if free_bytes is None else free_bytes
    per_engine = weight_bytes + STEP_PEAK_BYTES + kv_blocks * kv_block_bytes(layers)
    if engines * per_engine > 0.95 * free:
        fits = int((0.95 * free / engines - weight_bytes - STEP_PEAK_BYTES) // kv_block_bytes(layers))
        parser.error(f"{engines} engines of {per_engine / 2**30:.1f} GiB each do not fit the GPU's "
                     f"{free / 2**30:.1f} GiB free; --num-kv-blocks {max(fits, 0)} or fewer would"
                     + ("" if fits > 0 else " not fit either: fewer variants"))


def graph_time_ms(llm, batch: int, replays: int = 20) -> float:
    graph, _ = llm.engine.runner.graphs.graphs[("decode", llm.engine.runner.graphs.size_for("decode", batch))]
    graph.replay()
    return replay_ms(graph, replays)


def prefill_time_ms(llm, length: int, seed: int) -> float:
    """One prompt of ``length`` fresh random tokens (no prefix cache hit), prefilled and one token sampled."""
    from zoo import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, llm.engine.description.vocab_size, (length,), generator=g).tolist()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - start)


def interleaved_graph_times(kept, batches, rounds, say, prefill_length: int = 2040) -> dict:
    """Each variant's decode graph replay time and a whole-prompt prefill, variants interleaved round by round,
    in turn forwards and backwards (A B C, C B A, ...), so that a drift of the machine over the run, and whatever
    favours a place in the order, fall on all of them alike; medians, and ratios to the first variant. (Round 16's
    prefills, always in one order, gave the second of two variants 0.05-0.9 ms less in every round, also
    where the two differed only in decode tiles.) A prompt's prefill replays a prompt graph where
    runtime.prompt_graph_tokens covers it, else runs eagerly; its time includes the host's, and it runs with its
    variant's switches set again, since the module switches are read as it launches."""
    times = {(key, batch): [] for key, _, _ in kept for batch in [*batches, "prefill"]}
    for r in range(rounds):
        order = kept if r % 2 == 0 else kept[::-1]
        for batch in batches:
            for key, llm, _ in order:
                times[(key, batch)].append(graph_time_ms(llm, batch))
        for key, llm, variant in order:
            apply(variant)
            times[(key, "prefill")].append(prefill_time_ms(llm, prefill_length, seed=r))
    say(f"=== interleaved, {rounds} rounds, median ms (ratio to {kept[0][0]}): decode graph replays (20 a round) "
        f"at each batch, and a 1 x {prefill_length} prefill")
    result = {}
    for batch in [*batches, "prefill"]:
        base = statistics.median(times[(kept[0][0], batch)])
        for key, _, _ in kept:
            ms = statistics.median(times[(key, batch)])
            spread = max(times[(key, batch)]) - min(times[(key, batch)])
            label = f"batch {batch:3d}" if batch != "prefill" else "prefill  "
            say(f"  {label} {key:40s} {ms:.4f} ms (spread {spread:.4f})  {base / ms:.3f}x")
            result[f"{key} {label.strip()}"] = {"median_ms": ms, "all_ms": times[(key, batch)]}
    return result


def host_split(engine):
    """``(spent, unwrap)``: seconds of host time per part of Engine.step, gathered in ``spent`` until unwrap()."""
    spent, wrapped = defaultdict(float), []

    def timed(owner, attr, label):
        fn = getattr(owner, attr)
        wrapped.append((owner, attr))

        def wrapper(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            spent[label] += time.perf_counter() - start
            return out
        setattr(owner, attr, wrapper)

    timed(engine.runner, "prepare", "prepare (host)")
    timed(engine.runner, "run", "run (graph launch)")
    timed(engine.committer, "commit_step", "commit (argmax, sync, commit)")
    timed(engine.scheduler, "schedule", "schedule (host)")

    def unwrap():
        for owner, attr in wrapped:
            owner.__dict__.pop(attr, None)
    return spent, unwrap


def profile_decode(llm, batch, steps, table_rows, say) -> dict:
    from zoo import SamplingParams

    engine, runner = llm.engine, llm.engine.runner
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, engine.description.vocab_size, (batch, 128), generator=g).tolist()
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    spent, unwrap = host_split(engine)
    runs = {}
    # The difference of two runs: decode steps only, no prefill or ramp. Each run is the faster of two, the lengths
    # interleaved: round 16's single runs put a batch-1 step at 0.826 ms against a 1.09-ms graph replay, the short
    # run's host parts (prepare) longer than the long run's.
    for _ in range(2):
        for new_tokens in (33, 33 + steps):
            spent.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            if new_tokens not in runs or seconds < runs[new_tokens][0]:
                runs[new_tokens] = (seconds, dict(spent))
    unwrap()
    (short_s, short), (long_s, long) = runs[33], runs[33 + steps]
    step_ms = 1000 * (long_s - short_s) / steps
    split = {label: 1000 * (long[label] - short.get(label, 0.0)) / steps for label in long}
    split["rest of Engine.step and generate"] = step_ms - sum(split.values())

    size = runner.graphs.size_for("decode", batch)
    graph, outputs = runner.graphs.graphs[("decode", size)]
    for _ in range(5):
        graph.replay()
    graph_ms = min(replay_ms(graph, 20) for _ in range(5))
    logits = outputs[0][:batch]
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        logits.argmax(-1)
    b.record()
    torch.cuda.synchronize()
    argmax_ms = a.elapsed_time(b) / 20

    replays = 10
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            logits.argmax(-1)
        torch.cuda.synchronize()
    kernels, rows, busy_total, gap_total = kernel_table(prof, replays)
    say(f"batch {batch}: engine step {step_ms:.3f} ms; graph replay {graph_ms:.3f} ms; argmax {1000 * argmax_ms:.1f} us")
    for label, ms in split.items():
        say(f"  {label:32s} {ms:.3f} ms per step")
    say(f"  kernels per step {len(kernels) / replays:.0f}: busy {busy_total / replays:.1f} us, "
        f"gaps {gap_total / replays:.1f} us (under the profiler)")
    print_table(rows, replays, table_rows, say)
    return {"step_ms": step_ms, "graph_ms": graph_ms, "argmax_us": 1000 * argmax_ms, "split_ms": split,
            "kernels_per_step": len(kernels) / replays, "busy_us": busy_total / replays,
            "gap_us": gap_total / replays,
            "kernels": [{"name": n, "per_step": c / replays, "us": b / replays, "gap_us": gp / replays}
                        for n, (c, b, gp) in rows]}


def kernel_table(prof, replays, max_gap_us=200.0):
    """``(kernels, rows, busy us, gap us)``: rows are (name, [launches, busy us, gap-before us]), costliest first."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start), key=lambda e: e.time_range.start)
    table = defaultdict(lambda: [0, 0.0, 0.0])
    gap_total, busy_total, previous_end = 0.0, 0.0, None
    for e in kernels:
        gap = max(0.0, e.time_range.start - previous_end) if previous_end is not None else 0.0
        gap = gap if gap < max_gap_us else 0.0  # the host's turn between replays is not a gap inside the step
        row = table[e.name]
        row[0] += 1
        row[1] += e.time_range.elapsed_us()
        row[2] += gap
        gap_total += gap
        busy_total += e.time_range.elapsed_us()
        previous_end = e.time_range.end
    rows = sorted(table.items(), key=lambda kv: -kv[1][1] - kv[1][2])
    return kernels, rows, busy_total, gap_total


def print_table(rows, replays, table_rows, say) -> None:
    say("  | kernel | per step | us per step | gap before, us per step |")
    say("  |---|---|---|---|")
    for name, (count, busy, gap) in rows[:table_rows]:
        say(f"  | {name[:60]} | {count / replays:.0f} | {busy / replays:.1f} | {gap / replays:.1f} |")


def profile_prefill(llm, say, table_rows=16) -> dict:
    from zoo import SamplingParams

    vocab = llm.engine.description.vocab_size
    results = {}
    for batch, length in ((1, 2048 - 8), (16, 1024)):
        g = torch.Generator().manual_seed(1000 + batch)
        best, best_split = None, None
        for _ in range(5):  # fresh random prompts each time: no prefix cache hits
            prompts = torch.randint(0, vocab, (batch, length), generator=g).tolist()
            spent, unwrap = host_split(llm.engine)
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            unwrap()
            if best is None or elapsed < best:
                best, best_split = elapsed, {label: 1000 * t for label, t in spent.items()}
        results[f"{batch}x{length}"] = {"seconds": best, "tok_s": batch * length / best, "split_ms": best_split}
        say(f"prefill {batch} x {length}: {1000 * best:.1f} ms, {batch * length / best:.0f} tok/s; "
            + ", ".join(f"{label} {ms:.2f} ms" for label, ms in best_split.items()))
        # Where that time goes: the kernels of one more such prefill, and the wall time around them.
        prompts = torch.randint(0, vocab, (batch, length), generator=g).tolist()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
            torch.cuda.synchronize()
            wall_ms = 1000 * (time.perf_counter() - start)
        kernels, rows, busy, gaps = kernel_table(prof, 1, max_gap_us=float("inf"))
        say(f"  under the profiler {wall_ms:.1f} ms: {len(kernels)} kernels busy {busy / 1000:.2f} ms, "
            f"gaps between them {gaps / 1000:.2f} ms, the rest (host before the first and after the last) "
            f"{wall_ms - (kernels[-1].time_range.end - kernels[0].time_range.start) / 1000:.2f} ms")
        print_table(rows, 1, table_rows, say)
        results[f"{batch}x{length}"].update(
            profiled_ms=wall_ms, kernels=len(kernels), busy_ms=busy / 1000, gap_ms=gaps / 1000,
            table=[{"name": n, "count": c, "us": b, "gap_us": gp} for n, (c, b, gp) in rows])
    return results


def profile_prefill_host(llm, say, length: int = 2040, runs: int = 3, top: int = 30) -> dict:
    """Where the host spends an eager prefill step: cProfile over ``runs`` prefills of one fresh prompt, by own
    time and by cumulative time, and every call that waits for the GPU (with the zoo frames that made it)."""
    import cProfile
    import io
    import pstats
    import traceback
    import warnings

    from zoo import SamplingParams

    vocab = llm.engine.description.vocab_size
    g = torch.Generator().manual_seed(77)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    prompts = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(runs + 1)]
    llm.generate([prompts[0]], params)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for prompt in prompts[1:]:
        llm.generate([prompt], params)
    torch.cuda.synchronize()
    profiler.disable()
    wall_ms = 1000 * (time.perf_counter() - start) / runs
    say(f"host profile of a 1 x {length} prefill ({runs} runs under cProfile): {wall_ms:.1f} ms per run")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        say(f"--- by {order}")
        for line in text.getvalue().splitlines():
            if line.strip() and "function calls" not in line and "Ordered by" not in line:
                say("  " + line.rstrip()[:160])

    def census(label, prompts, params) -> dict:
        syncs = defaultdict(int)

        def record(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/zoo/" in f.filename or "/plugins/" in f.filename]
            syncs[" < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:][::-1])] += 1

        steps = llm.engine.stats.steps
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            original, warnings.showwarning = warnings.showwarning, record
            try:
                llm.generate(prompts, params)
            finally:
                warnings.showwarning = original
                torch.cuda.set_sync_debug_mode(0)
        say(f"calls that synchronise with the GPU in {label}: {sum(syncs.values())}"
            + f" over {llm.engine.stats.steps - steps} steps")
        for where, count in sorted(syncs.items(), key=lambda kv: -kv[1]):
            say(f"  {count:5d} x {where}")
        return dict(syncs)

    one = census("one prefill", [torch.randint(0, vocab, (length,), generator=g).tolist()], params)
    # More requests than max_num_seqs, of mixed lengths: admissions join running decodes (mixed steps).
    lengths = torch.randint(16, 512, (96,), generator=g).tolist()
    mixed = census("96 requests of 16-511 prompt and 1-128 new tokens",
                   [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths],
                   [SamplingParams(max_new_tokens=1 + i % 128, ignore_eos=True) for i in range(96)])
    return {"wall_ms": wall_ms, "syncs_prefill": one, "syncs_mixed": mixed}


if __name__ == "__main__":
    sys.exit(main())
