"""Throughput: zoo against transformers, in one process, on the same checkpoint.

Both engines get the same batch of random prompts (token ids, fixed seed),
decode greedily and produce exactly ``--new-tokens`` tokens per prompt (EOS
is ignored). For each engine:

* prefill time  = a run with ``max_new_tokens=1``;
* full time     = a run with ``max_new_tokens=new_tokens``;
* decode tok/s  = batch * (new_tokens - 1) / (full - prefill);
* end-to-end    = batch * new_tokens / full.

Each measurement is repeated ``--repeats`` times after a small warm-up; the
fastest run is kept. zoo runs with prefix caching off, so no run reuses the
KV cache of an earlier one. The greedy tokens of the two engines are
compared and the result is reported (a mismatch does not fail the run).

    python bench/throughput.py                      # random-init Llama, CPU, float32
    python bench/throughput.py --model-path CKPT --device cuda --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from zoo.engine_setup import DTYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="HF checkpoint folder; omitted: write a random-init LlamaForCausalLM to a temp dir")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", metavar="OUT", default=None, help="write the results as JSON to OUT")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the fastest is kept")
    p.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the warm-up run")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: leave as is)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of the random-init weights)")
    g = p.add_argument_group("random-init checkpoint (only without --model-path)")
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=8)
    g.add_argument("--num-kv-heads", type=int, default=4)
    g.add_argument("--intermediate-size", type=int, default=688)
    g.add_argument("--vocab-size", type=int, default=32000)
    g.add_argument("--max-position", type=int, default=2048)
    g.add_argument("--init-range", type=float, default=0.1,
                   help="initializer_range of the random weights (as in tests/conftest.py: larger than HF's "
                        "0.02 so greedy picks are not near-ties)")
    args = p.parse_args(argv)
    for name in ("batch_size", "prompt_len", "new_tokens", "repeats", "warmup_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# --------------------------------------------------------------------------- checkpoint

def write_random_llama(folder: Path, args) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads, max_position_embeddings=args.max_position,
        initializer_range=args.init_range, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(args.seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, safe_serialization=True)


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=g).tolist()


# --------------------------------------------------------------------------- engines

def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HFRunner:
    name = "transformers"

    def __init__(self, folder: str, dtype: torch.dtype, device: torch.device, prompts):
        import transformers

        self.device = device
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.input_ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
        self.attention_mask = torch.ones_like(self.input_ids)

    def generate(self, new_tokens: int) -> list[list[int]]:
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=self.input_ids, attention_mask=self.attention_mask, do_sample=False, num_beams=1,
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True, pad_token_id=0,
                eos_token_id=None)
        sync(self.device)
        return out[:, self.input_ids.shape[1]:].tolist()


class ZooRunner:
    name = "zoo"

    def __init__(self, folder: str, dtype_name: str, device: torch.device, prompts, batch: int, prompt_len: int):
        from zoo import LLM, SamplingParams

        self.device = device
        self.prompts = prompts
        self.SamplingParams = SamplingParams
        self.runtime = dict(max_num_seqs=batch, max_num_batched_tokens=max(batch * prompt_len, 512),
                            enable_prefix_caching=False, dtype=dtype_name, device=str(device))
        self.llm = LLM(folder, model="llama", **self.runtime)

    def generate(self, new_tokens: int) -> list[list[int]]:
        params = self.SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        outputs = self.llm.generate(self.prompts, params)
        sync(self.device)
        errors = [o.error for o in outputs if o.error]
        if errors:
            raise RuntimeError(f"zoo rejected a request: {errors[0]}")
        return [o.token_ids for o in outputs]


def timed(fn, *a):
    start = time.perf_counter()
    result = fn(*a)
    return time.perf_counter() - start, result


def measure(runners, args) -> dict:
    """Warm up each engine, then time prefill-only and full runs, engines interleaved per repeat.

    Interleaving makes both engines see the same background load; the fastest run of each kind is kept.
    """
    for runner in runners:
        print(f"warm-up {runner.name} ...", flush=True)
        runner.generate(min(args.warmup_tokens, args.new_tokens))
    runs = {r.name: {"prefill": [], "full": [], "tokens": None} for r in runners}
    for repeat in range(args.repeats):
        for runner in runners:
            print(f"repeat {repeat + 1}/{args.repeats}: {runner.name} ...", flush=True)
            runs[runner.name]["prefill"].append(timed(runner.generate, 1)[0])
            t_full, tokens = timed(runner.generate, args.new_tokens)
            runs[runner.name]["full"].append(t_full)
            runs[runner.name]["tokens"] = tokens
    batch, n = args.batch_size, args.new_tokens
    results = {}
    for name, run in runs.items():
        t_prefill, t_full = min(run["prefill"]), min(run["full"])
        decode_time = t_full - t_prefill
        generated = sum(len(t) for t in run["tokens"])
        if generated != batch * n:
            print(f"warning: {name} generated {generated} tokens, expected {batch * n}", file=sys.stderr)
        results[name] = {
            "prefill_s": t_prefill,
            "full_s": t_full,
            "decode_s": decode_time,
            "prefill_tok_s": batch * args.prompt_len / t_prefill,
            "decode_tok_s": batch * (n - 1) / decode_time if n > 1 and decode_time > 0 else None,
            "e2e_tok_s": batch * n / t_full,
            "prefill_median_s": statistics.median(run["prefill"]),
            "full_median_s": statistics.median(run["full"]),
            "prefill_runs_s": run["prefill"],
            "full_runs_s": run["full"],
            "tokens": run["tokens"],
        }
    return results


def compare(zoo_tokens, hf_tokens) -> dict:
    matching = sum(a == b for a, b in zip(zoo_tokens, hf_tokens))
    first = []
    for i, (a, b) in enumerate(zip(zoo_tokens, hf_tokens)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            first.append({"sequence": i, "position": pos})
    return {"match": matching == len(hf_tokens) and len(zoo_tokens) == len(hf_tokens),
            "matching_sequences": matching, "sequences": len(hf_tokens), "first_mismatches": first[:8]}


# --------------------------------------------------------------------------- report

def fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def table(results: dict) -> str:
    lines = [f"{'engine':<14}{'prefill s':>11}{'full s':>10}{'prefill tok/s':>15}{'decode tok/s':>14}"
             f"{'e2e tok/s':>11}{'full s max/min':>16}"]
    for name, r in results.items():
        lines.append(f"{name:<14}{r['prefill_s']:>11.3f}{r['full_s']:>10.3f}{r['prefill_tok_s']:>15.1f}"
                     f"{fmt(r['decode_tok_s'], '.1f'):>14}{r['e2e_tok_s']:>11.1f}"
                     f"{max(r['full_runs_s']) / min(r['full_runs_s']):>16.2f}")
    return "\n".join(lines)


def ratio(a, b):
    return a / b if a is not None and b else None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    command = " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]) if argv is None \
        else "throughput.py " + " ".join(map(shlex.quote, argv))

    import transformers

    env = {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
        "device": str(device), "dtype": args.dtype, "cpu_count": os.cpu_count(), "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    print(f"command: {command}")
    print(f"torch {env['torch']}  transformers {env['transformers']}  python {env['python']}")
    print(f"device {env['device']}{' (' + env['gpu'] + ')' if 'gpu' in env else ''}  dtype {args.dtype}  "
          f"threads {env['threads']} (interop {env['interop_threads']}, cpu_count {env['cpu_count']})")

    with tempfile.TemporaryDirectory(prefix="zoo-bench-") as tmp:
        if args.model_path:
            folder = args.model_path
            checkpoint = folder
        else:
            folder = str(Path(tmp) / "llama")
            write_random_llama(Path(folder), args)
            checkpoint = (f"random-init LlamaForCausalLM (hidden {args.hidden_size}, layers {args.num_layers}, "
                          f"heads {args.num_heads}/{args.num_kv_heads} kv, intermediate {args.intermediate_size}, "
                          f"vocab {args.vocab_size}, init_range {args.init_range}, seed {args.seed})")
        print(f"checkpoint: {checkpoint}")
        print(f"batch {args.batch_size}  prompt_len {args.prompt_len}  new_tokens {args.new_tokens}  "
              f"repeats {args.repeats} (best kept)  greedy, EOS ignored")

        vocab_size = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(args.batch_size, args.prompt_len, vocab_size, args.seed)
        hf = HFRunner(folder, dtype, device, prompts)
        zoo = ZooRunner(folder, args.dtype, device, prompts, args.batch_size, args.prompt_len)

        results = measure([hf, zoo], args)
        stats = zoo.llm.engine.stats
        zoo_stats = {"steps": stats.steps, "engine_step_s": stats.prefill_seconds + stats.decode_seconds,
                     "engine_prefill_s": stats.prefill_seconds, "engine_decode_s": stats.decode_seconds,
                     "generated_tokens": stats.generated_tokens,
                     "prefix_hit_tokens": zoo.llm.engine.blocks.prefix_hit_tokens}

    env["loadavg_end"] = os.getloadavg()
    check = compare(results["zoo"]["tokens"], results["transformers"]["tokens"])
    ratios = {
        "prefill_s": ratio(results["zoo"]["prefill_s"], results["transformers"]["prefill_s"]),
        "decode_tok_s": ratio(results["zoo"]["decode_tok_s"], results["transformers"]["decode_tok_s"]),
        "e2e_tok_s": ratio(results["zoo"]["e2e_tok_s"], results["transformers"]["e2e_tok_s"]),
    }
    print()
    print(table(results))
    print()
    print(f"zoo/transformers: decode tok/s x{fmt(ratios['decode_tok_s'], '.2f')}   "
          f"end-to-end tok/s x{fmt(ratios['e2e_tok_s'], '.2f')}   prefill time x{fmt(ratios['prefill_s'], '.2f')}")
    verdict = "yes" if check["match"] else "NO"
    print(f"greedy tokens match: {verdict} ({check['matching_sequences']}/{check['sequences']} sequences identical)"
          + ("" if check["match"] else "; first mismatches (sequence, position): "
             + ", ".join(f"({m['sequence']}, {m['position']})" for m in check["first_mismatches"])))
    print(f"zoo engine.stats (warm-up + all runs): {zoo_stats['steps']} steps, {zoo_stats['engine_step_s']:.3f} s "
          f"in Engine.step's timed part (prefill steps {zoo_stats['engine_prefill_s']:.3f} s, decode steps "
          f"{zoo_stats['engine_decode_s']:.3f} s), {zoo_stats['generated_tokens']} tokens generated, "
          f"prefix-cache hits {zoo_stats['prefix_hit_tokens']}")
    spread = max(max(r["full_runs_s"]) / min(r["full_runs_s"]) for r in results.values())
    print(f"load average (1 min) at start {env['loadavg_start'][0]:.2f}, at end {env['loadavg_end'][0]:.2f}"
          + (f"; WARNING: full-run times vary up to x{spread:.1f} between repeats: other processes are "
             "competing for the CPU, the ratios are unreliable (try --threads 1 or more --repeats)"
             if spread > 1.5 else ""))

    if args.json:
        record = {
            "command": command, "env": env, "checkpoint": checkpoint,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
            "results": {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()},
            "ratios_zoo_over_transformers": ratios, "tokens_match": check, "zoo_engine_stats": zoo_stats,
        }
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
