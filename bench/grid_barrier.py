"""What a kernel boundary costs against a grid-wide barrier inside one persistent kernel (issue 15).

Round 15 left batch 1 on the H200 at 64% of the roofline and named a persistent decode kernel (one launch for a
layer or the step, grid-wide barriers between its phases) as what is left. This measures the premise before
anything is built: a chain of PHASES phases, each streaming BYTES of its own cold data spread over the programs
and then reading a result of the phase before (the dependency a layer's products have), run two ways:

- ``kernels``: one launch per phase, as zoo's decode step does: programmatic dependent launch inside a CUDA graph,
  each program loading its first tile before its PDL wait (fused_ops.WEIGHTS_FIRST);
- ``persistent``: one launch for every phase, two programs per SM, a grid-wide barrier (an atomic count and a spin)
  between phases, each program loading its next phase's first tile before it waits at the barrier. The counts
  are zeroed by a memset node of the same graph, which a real one would need too.

Both write the same sums (checked). The difference per phase is what a persistent kernel could save per
boundary; a decode step of Llama-3.2-1B has about 130 of them.

    python bench/grid_barrier.py [--phases 64] [--mb 0 8 32] [--rounds 7] [--out FILE]

On CPU (Triton's interpreter, ``--programs 1``: the interpreter runs programs one after another, so a barrier
of more than one would never open) it checks that the two agree; a CPU test runs it so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zoo.triton_attention import pdl_options, triton, wait_for_previous_kernel  # noqa: E402

import triton.language as tl  # noqa: E402


@triton.jit
def _stream_sum(Src, start, n, BLOCK: tl.constexpr):
    # The sum of Src[start + BLOCK : start + n], BLOCK at a time (the first tile is loaded by the caller).
    acc = tl.zeros([BLOCK], tl.float32)
    for offset in range(BLOCK, n, BLOCK):
        acc += tl.load(Src + start + offset + tl.arange(0, BLOCK)).to(tl.float32)
    return tl.sum(acc, 0)


@triton.jit
def _phase_kernel(Src, Sums, phase, per_program, BLOCK: tl.constexpr, PDL: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    start = (phase * programs + program) * per_program
    first = tl.load(Src + start + tl.arange(0, BLOCK)).to(tl.float32)  # data no phase writes: before the wait
    wait_for_previous_kernel(PDL)
    total = tl.sum(first, 0) + _stream_sum(Src, start, per_program, BLOCK)
    if phase > 0:  # the dependency: a neighbour's result of the phase before
        total += tl.load(Sums + (phase - 1) * programs + (program + 1) % programs)
    tl.store(Sums + phase * programs + program, total)


@triton.jit
def _persistent_kernel(Src, Sums, Counts, phases, per_program, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    first = tl.load(Src + program * per_program + tl.arange(0, BLOCK)).to(tl.float32)
    for phase in range(phases):
        start = (phase * programs + program) * per_program
        total = tl.sum(first, 0) + _stream_sum(Src, start, per_program, BLOCK)
        if phase > 0:  # after the barrier; .cg: past this SM's L1, which another SM's store does not update
            total += tl.load(Sums + (phase - 1) * programs + (program + 1) % programs, cache_modifier=".cg")
        tl.store(Sums + phase * programs + program, total)
        if phase + 1 < phases:
            first = tl.load(Src + start + programs * per_program + tl.arange(0, BLOCK)).to(tl.float32)
            tl.debug_barrier()  # every thread's store issued before the release
            tl.atomic_add(Counts + phase, 1, sem="release", scope="gpu")
            while tl.atomic_add(Counts + phase, 0, sem="acquire", scope="gpu") < programs:
                pass
            tl.debug_barrier()


def run_kernels(src, sums, phases: int, programs: int, per_program: int, block: int, warps: int) -> None:
    for phase in range(phases):
        _phase_kernel[(programs,)](src, sums, phase, per_program, BLOCK=block, num_warps=warps,
                                   **pdl_options(src.device))


def run_persistent(src, sums, counts, phases: int, programs: int, per_program: int, block: int,
                   warps: int) -> None:
    counts.zero_()
    _persistent_kernel[(programs,)](src, sums, counts, phases, per_program, BLOCK=block, num_warps=warps)


def expected_sums(src, phases: int, programs: int, per_program: int) -> torch.Tensor:
    own = src[:phases * programs * per_program].float().view(phases, programs, per_program).sum(-1)
    out = torch.zeros_like(own)
    for phase in range(phases):
        out[phase] = own[phase] + (out[phase - 1].roll(-1) if phase else 0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", type=int, default=64)
    p.add_argument("--mb", type=float, nargs="+", default=[0.0, 8.0, 32.0],
                   help="MB each phase streams, at least one tile per program (0: that tile alone, about the "
                        "boundary alone); Llama-3.2-1B's o product is 8 MB, its down product 32")
    p.add_argument("--programs", type=int, default=0, help="0: --per-sm on each SM")
    p.add_argument("--per-sm", type=int, default=2,
                   help="programs per SM: all of them must be resident at once, or the barrier never opens")
    p.add_argument("--block", type=int, default=8192,
                   help="bf16 elements a program loads at a time: enough bytes in flight to keep DRAM busy")
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    device = torch.device("cuda" if cuda else "cpu")
    programs = args.programs or (args.per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                                 if cuda else 1)
    if not cuda and programs != 1:
        p.error("Triton's interpreter runs programs one after another: a barrier of more than one never opens")
    report = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "programs": programs,
              "phases": args.phases, "cases": []}
    print(f"{report['device']}: {programs} programs, {args.phases} phases", flush=True)
    for mb in args.mb:
        per_program = max(args.block, int(mb * 2**20 / 2 / programs) // args.block * args.block)
        src = torch.randn(args.phases * programs * per_program + programs * per_program, device=device).to(
            torch.bfloat16)  # one phase more: the persistent kernel's last prefetch stays in bounds
        sums = {name: torch.zeros(args.phases, programs, device=device) for name in ("kernels", "persistent")}
        counts = torch.zeros(args.phases, dtype=torch.int32, device=device)
        launch = {"kernels": lambda: run_kernels(src, sums["kernels"], args.phases, programs, per_program,
                                                 args.block, args.warps),
                  "persistent": lambda: run_persistent(src, sums["persistent"], counts, args.phases, programs,
                                                       per_program, args.block, args.warps)}
        for fn in launch.values():
            fn()
        want = expected_sums(src, args.phases, programs, per_program)
        for name, got in sums.items():
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-2, msg=f"{name} at {mb} MB")
        case = {"mb_per_phase": per_program * programs * 2 / 2**20, "per_program_bytes": 2 * per_program}
        if cuda:
            from decode_kernel import replay_ms

            graphs = {}
            for name, fn in launch.items():
                fn()
                torch.cuda.synchronize()
                graphs[name] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[name]):
                    fn()
            times = {name: [] for name in graphs}
            for _ in range(args.rounds):  # interleaved, so that drifts of clock and heat fall on both
                for name, graph in graphs.items():
                    graph.replay()
                    times[name].append(replay_ms(graph, args.replays))
            for name in graphs:
                sums[name].zero_()
                graphs[name].replay()
            torch.cuda.synchronize()
            for name in graphs:  # the graphs' own results, after the timing
                torch.testing.assert_close(sums[name], want, rtol=1e-4, atol=1e-2, msg=f"{name} graph")
            for name, values in times.items():
                ms = statistics.median(values)
                case[name] = {"ms": ms, "us_per_phase": 1000 * ms / args.phases, "spread_ms": max(values) - min(values),
                              "tb_s": case["mb_per_phase"] * 2**20 * args.phases / (ms / 1000) / 1e12}
            saved = case["kernels"]["us_per_phase"] - case["persistent"]["us_per_phase"]
            case["persistent_saves_us_per_phase"] = saved
            print(f"{case['mb_per_phase']:6.1f} MB a phase ({2 * per_program // 1024} KB a program): "
                  f"kernels {case['kernels']['us_per_phase']:.2f} us a phase ({case['kernels']['tb_s']:.2f} TB/s), "
                  f"persistent {case['persistent']['us_per_phase']:.2f} ({case['persistent']['tb_s']:.2f} TB/s); "
                  f"the barrier saves {saved:.2f} us a phase (medians of {args.rounds} interleaved rounds, "
                  f"spreads {case['kernels']['spread_ms']:.3f} and {case['persistent']['spread_ms']:.3f} ms)",
                  flush=True)
        else:
            print(f"{case['mb_per_phase']:.3f} MB a phase: both ways give the expected sums", flush=True)
        report["cases"].append(case)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
