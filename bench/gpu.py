"""GPU benchmark (issue 3): zoo and transformers side by side on a Llama-3.2-1B-shaped bf16 model.

Workloads, all greedy with EOS ignored:
  1. batch 1, prompt 128, 256 new tokens: decode tokens/s and fraction of the memory roofline;
  2. batch 64, same lengths: the same, and the ratio to transformers' generate with a static cache (compiled);
  3. 256 requests, prompt lengths uniform in [100, 1024], 256 new tokens: end-to-end output tokens/s,
     against transformers' continuous-batching generate_batch.
  4. prefill (issue 15): one 2,047-token prompt (the 2,048 positions hold it and the new token) and 16 prompts
     of 1,024 tokens, fresh random tokens each time; prefill tokens/s and the fraction of the bf16 matmul rate
     measured in the same run. FLOPs counted: 2 x (the layers' projection weights) per token, the LM head for
     each sequence's last token, and causal attention (2 x T^2 x hidden per layer and sequence).
Roofline: each decode step must read every weight once plus the KV cache of every sequence; the
time for those bytes at the copy bandwidth measured in the same run is the floor.
With --gpt-fast DIR (shared/anchors/gpt_fast copied into the checkout), gpt-fast's own model and recipe run in
a subprocess of the same session after zoo, and the table and plot show zoo / gpt-fast per batch size.

    python bench/gpu.py --out bench/results/gpu            # writes gpu.json, gpu.md, gpu.png
    python bench/gpu.py --skip-hf --gpt-fast .carry/gpt_fast
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=2048)


def write_checkpoint(folder: Path, layers: int) -> int:
    import transformers

    config = transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, initializer_range=0.02,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    del model
    torch.cuda.empty_cache()
    return weight_bytes


def copy_bandwidth() -> float:
    """Bytes read plus written per second of a 4 GiB device-to-device copy (median of 20)."""
    src = torch.randn(2**30, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * 2**30 / statistics.median(times[3:])


def kv_bytes_per_token(layers: int) -> int:
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    return 2 * layers * SHAPE["num_key_value_heads"] * head_dim * 2  # K and V, bf16


def matmul_rate(n: int = 8192) -> float:
    """bf16 FLOP/s of an n x n x n matrix product (median of 10): the dense compute peak prefill is held to."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del a, b
    return 2 * n ** 3 / statistics.median(times[3:])


def prefill_flops(seqs: int, length: int, layers: int) -> float:
    h, inter, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    head_dim = h // SHAPE["num_attention_heads"]
    per_layer = h * (h + 2 * kv * head_dim) + h * h + 3 * h * inter  # q,k,v, o, gate, up, down
    linear = 2 * per_layer * layers * seqs * length + 2 * h * SHAPE["vocab_size"] * seqs
    attention = 2 * length * length * h * layers * seqs  # causal: half of 4 T^2 h
    return linear + attention


def zoo_prefill(llm, seqs, length, flop_rate, layers) -> dict:
    from zoo import SamplingParams

    g = torch.Generator().manual_seed(7000 + seqs)
    times = {}
    for whole_prompt_path in (False, True):  # the masked path this release replaced, then the reported one
        llm.engine.runner.fresh_causal_path = whole_prompt_path
        for _ in range(3):  # new prompts each time: no prefix-cache hits
            prompts = torch.randint(0, SHAPE["vocab_size"], (seqs, length), generator=g).tolist()
            seconds, _ = timed(lambda: llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True)))
            times.setdefault(whole_prompt_path, []).append(seconds)
    flops, best = prefill_flops(seqs, length, layers), min(times[True])
    return {"seqs": seqs, "length": length, "seconds": best, "prefill_tok_s": seqs * length / best,
            "flops": flops, "compute_fraction": flops / best / flop_rate, "all_seconds": times[True],
            "masked_path_seconds": min(times[False])}


def run_gpt_fast(folder: str, batches, timeout: int) -> dict:
    """gpt-fast's anchor runner in a subprocess (its own torch.compile state); one JSON line per batch size."""
    result = {}
    try:
        done = subprocess.run([sys.executable, str(Path(folder) / "anchor.py"), *map(str, batches)],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        result = {"error": f"timed out after {timeout} s"}
        for line in (exc.stdout or b"").decode(errors="replace").splitlines():  # the batch sizes it finished
            if line.startswith("{"):
                row = json.loads(line)
                result[row["batch"]] = row
        return result
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            result[row["batch"]] = row
    if done.returncode or not result:
        result["error"] = (done.stderr or done.stdout)[-800:]
    return result


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def zoo_fixed_batch(llm, batch, prompt_len, new_tokens, vocab, weight_bytes, bandwidth, layers):
    from zoo import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=g).tolist()
    llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    # Best of three: a first use of some path (the prompt now hits the prefix cache) must not count as decode.
    t_prefill = min(timed(lambda: llm.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True)))[0]
                    for _ in range(3))
    t_full, outs = min((timed(lambda: llm.generate(prompts, SamplingParams(max_new_tokens=new_tokens,
                                                                            ignore_eos=True))) for _ in range(2)),
                       key=lambda run: run[0])
    assert all(len(o.token_ids) == new_tokens for o in outs), [o.error for o in outs][:3]
    steps = new_tokens - 1
    decode_s = t_full - t_prefill
    mean_context = prompt_len + new_tokens / 2
    step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token(layers)
    floor_s = steps * step_bytes / bandwidth
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "prefill_s": t_prefill,
            "full_s": t_full, "decode_tok_s": batch * steps / decode_s, "e2e_tok_s": batch * new_tokens / t_full,
            "step_ms": 1000 * decode_s / steps, "roofline_step_ms": 1000 * floor_s / steps,
            "roofline_fraction": floor_s / decode_s}, [o.token_ids for o in outs], prompts


def offline_requests(vocab, n=256, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(100, 1024))] for _ in range(n)]


def switch_owner(name: str):
    """(zoo module, attribute) of a switch named ``module.NAME``; exits naming it where the module lacks it."""
    import importlib

    module_name, attr = name.rsplit(".", 1)
    module = importlib.import_module(f"zoo.{module_name}")
    if not hasattr(module, attr):
        raise SystemExit(f"{name}: zoo.{module_name} has no {attr}")
    return module, attr


def compare_switch(name: str, run, result: dict, tokens) -> dict:
    """``run()`` again with the zoo module switch ``name`` (``module.NAME``) flipped, then the run before again with
    it as it was, so that drift over the two falls on both: the two timings with it as it was, and the flipped one."""
    module, attr = switch_owner(name)
    value = getattr(module, attr)
    setattr(module, attr, not value)
    try:
        other, other_tokens, _ = run()
    finally:
        setattr(module, attr, value)
    again, _, _ = run()
    entry = {"as_is_tok_s": [result["decode_tok_s"], again["decode_tok_s"]], "flipped_tok_s": other["decode_tok_s"],
             "flipped_value": not value, "tokens_equal": other_tokens == tokens}
    print(f"  {name}={not value}: {other['decode_tok_s']:.0f} tok/s decode (as is: {result['decode_tok_s']:.0f}, "
          f"{again['decode_tok_s']:.0f}), tokens equal {entry['tokens_equal']}", flush=True)
    return entry


def set_switches(assignments: list[str]) -> dict:
    """``module.NAME=VALUE`` settings applied to zoo's modules (VALUE in JSON); returns them as set."""
    applied = {}
    for assignment in assignments:
        name, value = assignment.split("=", 1)
        module, attr = switch_owner(name)
        applied[name] = json.loads(value)
        setattr(module, attr, applied[name])
    return applied


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench/results/gpu", help="folder for gpu.json, gpu.md, gpu.png")
    p.add_argument("--skip-hf", action="store_true", help="measure zoo only")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--offline-requests", type=int, default=256)
    p.add_argument("--blocks-per-iter", type=int, default=None,
                   help="the decode kernel's tile width in cache blocks (default: zoo's; see bench/decode_kernel.py)")
    p.add_argument("--gpt-fast", default=None, help="folder of shared/anchors/gpt_fast: run it beside zoo")
    p.add_argument("--gpt-fast-batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--gpt-fast-timeout", type=int, default=400)
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64],
                   help="decode batch sizes (transformers runs only with 64 among them and the offline workload)")
    p.add_argument("--skip-offline", action="store_true",
                   help="leave out the offline workload: with --skip-prefill --batches 1, a batch-1 figure in a short "
                        "device window")
    p.add_argument("--runtime", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more runtime settings for zoo's engine (VALUE in JSON), e.g. "
                        "mixed_graph_tokens=512")
    p.add_argument("--compare-overlap", action="store_true",
                   help="also time each decode batch and the offline run with runtime.overlap_steps flipped, in "
                        "the same process (host speed varies between processes)")
    p.add_argument("--compare-switch", default=None, metavar="MODULE.NAME",
                   help="also time each decode batch with a boolean zoo module switch flipped, in the same process, "
                        "e.g. fused_ops.ADVANCE_KERNEL (only switches read at every step, not captured in graphs)")
    p.add_argument("--set", nargs="*", default=[], metavar="MODULE.NAME=VALUE",
                   help="zoo module switches to set before the engine starts (VALUE in JSON), e.g. "
                        "triton_attention.CACHED_FIRST=false: an A/B of switches that graphs capture")
    args = p.parse_args(argv)
    from zoo import triton_attention

    switches = set_switches(args.set)
    if args.blocks_per_iter:
        triton_attention.BLOCKS_PER_ITER = args.blocks_per_iter
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE,
              "layers": args.layers, "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
              "decode_kernel_blocks_per_iter": triton_attention.BLOCKS_PER_ITER, "switches_set": switches}
    from zoo import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        weight_bytes = write_checkpoint(folder, args.layers)
        bandwidth = copy_bandwidth()
        record.update(weight_bytes=weight_bytes, copy_bandwidth_TBps=bandwidth / 1e12)
        print(f"weights {weight_bytes / 1e9:.2f} GB, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
        runtime = {key: json.loads(value) for key, value in (kv.split("=", 1) for kv in args.runtime)}
        record["zoo_runtime_overrides"] = runtime
        t_load, llm = timed(lambda: LLM(str(folder), dtype="bfloat16", max_num_seqs=256,
                                        max_num_batched_tokens=8192, max_model_len=2048,
                                        gpu_memory_utilization=0.85, overlap_steps=True, **runtime))
        engine = llm.engine
        record["zoo_startup_s"] = t_load
        record["zoo_kv_blocks"] = engine.num_blocks
        record["zoo_profile_peak_GiB"] = (engine.profile_peak_bytes or 0) / 2**30
        record["zoo_cuda_graphs"] = engine.uses_cuda_graphs
        record["zoo_fused_ops"] = engine.uses_fused_ops
        default_overlap = True  # conf/runtime/default.yaml's runtime.overlap_steps (built on: its pinned buffers)
        record["zoo_overlap_steps"] = default_overlap
        print(f"zoo ready in {t_load:.1f} s: {engine.num_blocks} KV blocks, step peak "
              f"{record['zoo_profile_peak_GiB']:.2f} GiB, graphs {engine.uses_cuda_graphs}", flush=True)
        vocab = SHAPE["vocab_size"]
        sweep, flipped, switched = {}, {}, {}
        for batch in args.batches:
            result, tokens, prompts = zoo_fixed_batch(llm, batch, 128, 256, vocab, weight_bytes, bandwidth,
                                                      args.layers)
            sweep[batch] = result
            if batch == 64:
                zoo64_tokens, prompts64 = tokens, prompts
            print(f"zoo batch {batch}: {result['decode_tok_s']:.0f} tok/s decode, step {result['step_ms']:.2f} ms "
                  f"(roofline {result['roofline_step_ms']:.2f} ms, {100 * result['roofline_fraction']:.0f}%)",
                  flush=True)
            if args.compare_overlap:
                engine.overlap_steps = not default_overlap
                other, other_tokens, _ = zoo_fixed_batch(llm, batch, 128, 256, vocab, weight_bytes, bandwidth,
                                                         args.layers)
                engine.overlap_steps = default_overlap
                other["tokens_equal"] = other_tokens == tokens
                flipped[batch] = other
                print(f"  overlap_steps={not default_overlap}: {other['decode_tok_s']:.0f} tok/s decode, step "
                      f"{other['step_ms']:.2f} ms, tokens equal {other['tokens_equal']}", flush=True)
            if args.compare_switch:
                switched[batch] = compare_switch(args.compare_switch, lambda: zoo_fixed_batch(
                    llm, batch, 128, 256, vocab, weight_bytes, bandwidth, args.layers), result, tokens)
        record["zoo_sweep"] = sweep
        if switched:
            record["zoo_sweep_switch_flipped"] = {"switch": args.compare_switch, "batches": switched}
        if flipped:
            record["zoo_sweep_overlap_flipped"] = flipped
        if not args.skip_prefill:
            rate = matmul_rate()
            record["matmul_TFLOPs"] = rate / 1e12
            record["zoo_prefill"] = {}
            for seqs, length in ((1, 2047), (16, 1024)):
                r = record["zoo_prefill"][f"{seqs}x{length}"] = zoo_prefill(llm, seqs, length, rate, args.layers)
                print(f"zoo prefill {seqs} x {length}: {r['prefill_tok_s']:.0f} tok/s, "
                      f"{100 * r['compute_fraction']:.0f}% of {rate / 1e12:.0f} TFLOP/s", flush=True)
        requests = None
        if not args.skip_offline:
            params = SamplingParams(max_new_tokens=256, ignore_eos=True)
            # Warm-up of the workload's step shapes (mixed steps compile Triton kernel variants the decode graphs
            # did not need), with prompts of its own, so nothing later comes from the prefix cache.
            t_warm, _ = timed(lambda: llm.generate(offline_requests(vocab, args.offline_requests, seed=4), params))
            record["zoo_offline_warmup_s"] = t_warm
            print(f"zoo offline warm-up: {t_warm:.1f} s", flush=True)
            # The same workload with whole prompts through the masked path, which this release replaced, and a
            # different seed so that nothing comes from the prefix cache; then the reported run.
            engine.runner.fresh_causal_path = False
            other = offline_requests(vocab, args.offline_requests, seed=1)
            t_masked, outs = timed(lambda: llm.generate(other, params))
            record["zoo_offline_masked_prompts"] = {"output_tok_s": sum(len(o.token_ids) for o in outs) / t_masked}
            engine.runner.fresh_causal_path = True
            print(f"zoo offline, whole prompts through the mask: "
                  f"{record['zoo_offline_masked_prompts']['output_tok_s']:.0f} output tok/s", flush=True)
            requests = offline_requests(vocab, args.offline_requests, seed=2)
            before = dict(vars(engine.stats), overlapped=engine.overlapped_steps, advanced=engine.advanced_in_place)
            t_offline, outs = timed(lambda: llm.generate(requests, params))
            after = dict(vars(engine.stats), overlapped=engine.overlapped_steps, advanced=engine.advanced_in_place)
            record["zoo_offline_steps"] = {key: after[key] - before[key] for key in
                                           ("steps", "prefill_seconds", "decode_seconds", "prefill_tokens",
                                            "decode_tokens", "overlapped", "advanced")}
            print(f"zoo offline steps: {record['zoo_offline_steps']}", flush=True)
            generated = sum(len(o.token_ids) for o in outs)
            record["zoo_offline"] = {"requests": len(requests), "output_tokens": generated, "seconds": t_offline,
                                     "output_tok_s": generated / t_offline,
                                     "preemptions": engine.scheduler.num_preemptions}
            print(f"zoo offline: {generated / t_offline:.0f} output tok/s ({generated} tokens, {t_offline:.1f} s)",
                  flush=True)
            if args.compare_overlap:
                # Other prompts of the same lengths' distribution: the reported ones would now hit the prefix cache.
                engine.overlap_steps = not default_overlap
                t_other, other_outs = timed(lambda: llm.generate(offline_requests(vocab, args.offline_requests, seed=3),
                                                                 params))
                engine.overlap_steps = default_overlap
                record["zoo_offline_overlap_flipped"] = {
                    "output_tok_s": sum(len(o.token_ids) for o in other_outs) / t_other,
                    "all_lengths": all(len(o.token_ids) == 256 for o in other_outs)}
                print(f"  overlap_steps={not default_overlap}: "
                      f"{record['zoo_offline_overlap_flipped']['output_tok_s']:.0f} output tok/s", flush=True)
        free, total = torch.cuda.mem_get_info()
        record["memory"] = {"peak_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30,
                            "kv_cache_GiB": engine.num_blocks * engine.runner.kv.bytes_per_block() / 2**30,
                            "device_GiB": total / 2**30, "free_GiB": free / 2**30,
                            "gpu_memory_utilization": 0.85}
        llm = engine = None  # free the KV cache before transformers loads
        gc.collect()
        torch.cuda.empty_cache()
        write_reports(record, out)  # each stage's figures are kept even if a later one runs out of time
        if args.gpt_fast:
            record["gpt_fast"] = run_gpt_fast(args.gpt_fast, args.gpt_fast_batches, args.gpt_fast_timeout)
            print(f"gpt-fast: {json.dumps(record['gpt_fast'])[:600]}", flush=True)
            write_reports(record, out)

        if not args.skip_hf and 64 in sweep and requests is not None:
            record["hf"] = run_transformers(folder, prompts64, zoo64_tokens, requests)
        elif not args.skip_hf:
            print("transformers left out: it runs beside batch 64 and the offline workload", flush=True)
    write_reports(record, out)
    return 0


def run_transformers(folder, prompts64, zoo64_tokens, requests) -> dict:
    import transformers

    result = {"version": transformers.__version__}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts64, device="cuda")
    try:  # workload 1 for scale: eager generate, batch 1
        one = ids[:1]
        with torch.inference_mode():
            model.generate(one, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)
            t_one, _ = timed(lambda: model.generate(one, attention_mask=torch.ones_like(one), do_sample=False,
                                                    max_new_tokens=256, min_new_tokens=256, pad_token_id=0))
        result["eager_b1"] = {"full_s": t_one, "e2e_tok_s": 256 / t_one}
        print(f"transformers eager b1: {256 / t_one:.1f} tok/s end-to-end", flush=True)
    except Exception as exc:  # noqa: BLE001 - report, keep the rest
        result["eager_b1"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}

    def static(new_tokens):
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, cache_implementation="static", pad_token_id=0)
    try:
        t_compile, _ = timed(lambda: static(256))  # first call compiles
        t_full, seq = timed(lambda: static(256))
        tokens = seq[:, ids.shape[1]:].tolist()
        result["static_b64"] = {"first_call_s": t_compile, "full_s": t_full, "e2e_tok_s": 64 * 256 / t_full,
                                "greedy_match_with_zoo": sum(a == b for a, b in zip(tokens, zoo64_tokens))}
        print(f"transformers static b64: {64 * 256 / t_full:.0f} tok/s end-to-end (first call {t_compile:.0f} s)",
              flush=True)
    except Exception as exc:  # noqa: BLE001 - report, keep the rest
        result["static_b64"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    try:
        config = transformers.GenerationConfig(max_new_tokens=256, min_new_tokens=256, do_sample=False,
                                               eos_token_id=None, pad_token_id=0)
        t_batch, outs = timed(lambda: model.generate_batch(inputs=requests, generation_config=config))
        generated = sum(len(v.generated_tokens) for v in outs.values())
        result["generate_batch"] = {"seconds": t_batch, "output_tokens": generated, "output_tok_s": generated / t_batch}
        print(f"transformers generate_batch: {generated / t_batch:.0f} output tok/s", flush=True)
    except Exception as exc:  # noqa: BLE001
        result["generate_batch"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    return result


def write_reports(record: dict, out: Path) -> None:
    (out / "gpu.json").write_text(json.dumps(record, indent=2))
    sweep = record["zoo_sweep"]
    lines = [f"# zoo on {record['device']} (torch {record['torch']})", "",
             f"Command: `python bench/{record['command']}`; copy bandwidth {record['copy_bandwidth_TBps']:.2f} TB/s; "
             f"weights {record['weight_bytes'] / 1e9:.2f} GB bf16.", "",
             "| batch | decode tok/s | step ms | roofline step ms | roofline fraction | gpt-fast tok/s "
             "| gpt-fast roofline fraction | zoo / gpt-fast |", "|---|---|---|---|---|---|---|---|"]
    anchor = {int(k): v for k, v in record.get("gpt_fast", {}).items() if k != "error"}
    for batch, r in sweep.items():
        other = anchor.get(int(batch))
        versus = (f"{other['decode_tok_s']:.0f} | {100 * other['roofline_frac']:.0f}% | "
                  f"{r['decode_tok_s'] / other['decode_tok_s']:.2f}x") if other else "- | - | -"
        lines.append(f"| {batch} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | {r['roofline_step_ms']:.2f} | "
                     f"{100 * r['roofline_fraction']:.0f}% | {versus} |")
    switched = record.get("zoo_sweep_switch_flipped")
    if switched:
        lines += ["", f"The same batches in the same process with {switched['switch']} flipped (as is, flipped, as is "
                      "again):", "", "| batch | as is tok/s | flipped tok/s | as is again | tokens equal |",
                  "|---|---|---|---|---|"]
        for batch, r in switched["batches"].items():
            lines.append(f"| {batch} | {r['as_is_tok_s'][0]:.0f} | {r['flipped_tok_s']:.0f} | "
                         f"{r['as_is_tok_s'][1]:.0f} | {r['tokens_equal']} |")
    flipped = record.get("zoo_sweep_overlap_flipped")
    if flipped:
        lines += ["", f"The same batches in the same process with runtime.overlap_steps="
                      f"{not record['zoo_overlap_steps']}:", "",
                  "| batch | decode tok/s | step ms | roofline fraction | tokens equal |", "|---|---|---|---|---|"]
        for batch, r in flipped.items():
            lines.append(f"| {batch} | {r['decode_tok_s']:.0f} | {r['step_ms']:.2f} | "
                         f"{100 * r['roofline_fraction']:.0f}% | {r['tokens_equal']} |")
    if "error" in record.get("gpt_fast", {}):
        lines.append(f"gpt-fast failed: {record['gpt_fast']['error'][-300:]}")
    prefill = record.get("zoo_prefill", {})
    if prefill:
        lines += ["", f"Prefill (bf16 matmul rate measured here: {record['matmul_TFLOPs']:.0f} TFLOP/s):", "",
                  "| prompts | prefill ms | prefill tok/s | fraction of the matmul rate | ms through the mask |",
                  "|---|---|---|---|---|"]
        for r in prefill.values():
            lines.append(f"| {r['seqs']} x {r['length']} | {1000 * r['seconds']:.1f} | {r['prefill_tok_s']:.0f} | "
                         f"{100 * r['compute_fraction']:.0f}% | {1000 * r.get('masked_path_seconds', 0):.1f} |")
    memory = record.get("memory")
    if memory:
        lines += ["", f"Memory: KV cache {memory['kv_cache_GiB']:.1f} GiB in {record['zoo_kv_blocks']} blocks, peak "
                      f"allocated {memory['peak_allocated_GiB']:.1f} GiB of {memory['device_GiB']:.0f} GiB "
                      f"(gpu_memory_utilization {memory['gpu_memory_utilization']}); the profile step's peak "
                      f"{record['zoo_profile_peak_GiB']:.2f} GiB."]
    off = record.get("zoo_offline")
    if off:
        lines += ["", f"Offline, {off['requests']} requests: {off['output_tok_s']:.0f} output tok/s "
                      f"({off['seconds']:.1f} s, {off['preemptions']} preemptions; a warm-up run of other prompts "
                      f"took {record.get('zoo_offline_warmup_s', float('nan')):.1f} s)."]
    steps = record.get("zoo_offline_steps")
    if steps:
        lines.append(f"Its {steps['steps']} steps: {steps['prefill_seconds']:.2f} s in steps with prompt tokens "
                     f"({steps['prefill_tokens']} of them), {steps['decode_seconds']:.2f} s in decode-only steps "
                     f"({steps['decode_tokens']} tokens; {steps['overlapped']} overlapped, {steps['advanced']} "
                     f"advanced on the device).")
    if "zoo_offline_masked_prompts" in record:
        lines.append(f"The same workload (other prompts) with whole prompts through the mask: "
                     f"{record['zoo_offline_masked_prompts']['output_tok_s']:.0f} output tok/s.")
    if "zoo_offline_overlap_flipped" in record:
        r = record["zoo_offline_overlap_flipped"]
        lines.append(f"With runtime.overlap_steps={not record['zoo_overlap_steps']}: {r['output_tok_s']:.0f} output "
                     f"tok/s (other prompts from the same length distribution).")
    hf = record.get("hf")
    if hf:
        static = hf.get("static_b64", {})
        batch = hf.get("generate_batch", {})
        eager = hf.get("eager_b1", {})
        if "e2e_tok_s" in eager and 1 in sweep:
            lines.append(f"transformers {hf['version']} eager generate, batch 1: {eager['e2e_tok_s']:.1f} tok/s "
                         f"end-to-end; zoo/transformers {sweep[1]['e2e_tok_s'] / eager['e2e_tok_s']:.1f}x.")
        if "e2e_tok_s" in static:
            lines.append(f"transformers {hf['version']} static-cache compiled generate, batch 64: "
                         f"{static['e2e_tok_s']:.0f} tok/s end-to-end; zoo/transformers "
                         f"{sweep[64]['e2e_tok_s'] / static['e2e_tok_s']:.2f}x.")
        if "output_tok_s" in batch:
            lines.append(f"transformers generate_batch: {batch['output_tok_s']:.0f} output tok/s; zoo/transformers "
                         f"{off['output_tok_s'] / batch['output_tok_s']:.2f}x.")
        for name, r in (("eager batch 1", eager), ("static", static), ("generate_batch", batch)):
            if "error" in r:
                lines.append(f"transformers {name} failed: {r['error']}")
    (out / "gpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        batches = list(sweep)
        ax.plot(batches, [sweep[b]["decode_tok_s"] for b in batches], "o-", label="zoo decode")
        ax.plot(batches, [b * 1000 / sweep[b]["roofline_step_ms"] for b in batches], "k--", label="memory roofline")
        if anchor:
            ax.plot(sorted(anchor), [anchor[b]["decode_tok_s"] for b in sorted(anchor)], "^-",
                    label="gpt-fast (compiled, same session)")
        if hf and "e2e_tok_s" in hf.get("static_b64", {}):
            ax.plot([64], [hf["static_b64"]["e2e_tok_s"]], "s", label="transformers static (compiled)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("tokens/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gpu.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
