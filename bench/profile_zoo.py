"""Profile zoo's side of bench/throughput.py: cProfile (Python) and torch.profiler (ops).

Same checkpoint, prompts and settings as the benchmark (same CLI flags). After a
warm-up it profiles one full run (prefill + decode):

    python bench/profile_zoo.py                      # defaults of throughput.py
    python bench/profile_zoo.py --top 30 --cprofile-out /tmp/zoo.prof
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import throughput  # noqa: E402


def zoo_share(stats: pstats.Stats, total: float, top: int) -> str:
    """Functions defined under zoo/ or plugins/, by cumulative time, with their share of the run."""
    rows = []
    for (filename, line, name), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        if "/zoo/" in filename or "/plugins/" in filename:
            short = filename[filename.rfind("/zoo/") + 1:] if "/zoo/" in filename else \
                filename[filename.rfind("/plugins/") + 1:]
            rows.append((cumtime, tottime, ncalls, f"{short}:{line}({name})"))
    rows.sort(reverse=True)
    lines = [f"{'cum s':>8}{'cum %':>7}{'self s':>8}{'self %':>7}{'calls':>8}  function"]
    for cumtime, tottime, ncalls, where in rows[:top]:
        lines.append(f"{cumtime:>8.3f}{100 * cumtime / total:>6.1f}%{tottime:>8.3f}{100 * tottime / total:>6.1f}%"
                     f"{ncalls:>8}  {where}")
    return "\n".join(lines)


def main() -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--top", type=int, default=25)
    extra.add_argument("--cprofile-out", default=None)
    own, rest = extra.parse_known_args()
    args = throughput.parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory(prefix="zoo-prof-") as tmp:
        folder = args.model_path or str(Path(tmp) / "llama")
        if not args.model_path:
            throughput.write_random_llama(Path(folder), args)
        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        prompts = throughput.make_prompts(args.batch_size, args.prompt_len, vocab, args.seed)
        zoo = throughput.ZooRunner(folder, args.dtype, device, prompts, args.batch_size, args.prompt_len)
        zoo.generate(min(args.warmup_tokens, args.new_tokens))
        zoo.generate(args.new_tokens)

        profiler = cProfile.Profile()
        start = time.perf_counter()
        profiler.enable()
        zoo.generate(args.new_tokens)
        profiler.disable()
        total = time.perf_counter() - start
        stats = pstats.Stats(profiler, stream=io.StringIO())
        if own.cprofile_out:
            stats.dump_stats(own.cprofile_out)
        print(f"torch {torch.__version__}  threads {torch.get_num_threads()}  device {device}")
        print(f"batch {args.batch_size}  prompt_len {args.prompt_len}  new_tokens {args.new_tokens}: "
              f"profiled run {total:.3f} s (under cProfile)\n")
        print("== cProfile: zoo functions by cumulative time ==")
        print(zoo_share(stats, total, own.top))
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(own.top)
        print("\n== cProfile: all functions by self time ==")
        print(out.getvalue().split("\n\n", 2)[-1].rstrip())

        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            with record_function("zoo.generate"):
                zoo.generate(args.new_tokens)
        print("\n== torch.profiler: ops by self CPU time (grouped by input shape) ==")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=own.top, max_name_column_width=36,
            max_shapes_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
