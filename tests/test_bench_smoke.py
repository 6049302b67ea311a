"""bench/throughput.py runs end to end on a tiny model and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "throughput.py"


def bench_module(name: str):
    """A bench/ script imported as a module (they import each other by name from that folder)."""
    import importlib

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPT.parent))


def profile_switches() -> list:
    """(module, name) of every zoo switch that bench/profile_gpu_step.py's apply() sets."""
    from zoo import fused_ops, triton_attention

    return ([(fused_ops, name) for name in ("GEMV_MAX_ROWS", "argmax", "PROJECTION_GEMV_MAX_ROWS",
                                            "FOLD_INTO_PROJECTIONS", "ADVANCE_KERNEL", "GEMV_ONE_ROW_CONFIGS",
                                            "WEIGHTS_FIRST", "STEP_INPUT_KERNELS")]
            + [(triton_attention, name) for name in ("LAUNCH_PROGRAMS", "PDL", "CACHED_FIRST")])


def test_throughput_script_runs(tmp_path):
    out = tmp_path / "result.json"
    args = [sys.executable, str(SCRIPT), "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "4",
            "--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--num-kv-heads", "2",
            "--intermediate-size", "128", "--vocab-size", "300", "--max-position", "256",
            "--repeats", "1", "--warmup-tokens", "2", "--threads", "1", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "zoo/transformers" in proc.stdout
    record = json.loads(out.read_text())
    assert set(record["results"]) == {"transformers", "zoo"}
    for result in record["results"].values():
        assert result["full_s"] > 0 and result["e2e_tok_s"] > 0
    assert record["tokens_match"]["match"], record["tokens_match"]
    assert record["zoo_engine_stats"]["prefix_hit_tokens"] == 0
    assert record["ratios_zoo_over_transformers"]["e2e_tok_s"] > 0


def test_speculative_script_runs(tmp_path):
    out = tmp_path / "spec.json"
    script = SCRIPT.parent / "speculative.py"
    args = [sys.executable, str(script), "--batch-size", "2", "--prompt-len", "8", "--new-tokens", "8",
            "--hidden-size", "64", "--num-layers", "2", "--vocab-size", "300", "--repeats", "1", "--json", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["engine"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"transformers generate", "zoo none", "zoo medusa", "zoo lookahead", "zoo eagle"}
    assert all(row["tok_s"] > 0 for row in rows.values())
    assert all(row["tokens_equal_plain"] for name, row in rows.items() if name.startswith("zoo"))


def test_speculative_gpu_measuring_code_runs_on_cpu(tmp_path):
    """--smoke: the shipped default and its heads through every method, phases profiled, tables written."""
    script = SCRIPT.parent / "speculative_gpu.py"
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--new-tokens", "8", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((tmp_path / "spec.json").read_text())
    rows = [r for r in record["methods"] if "batch" in r]
    assert {r["method"] for r in rows} >= {"none", "medusa", "eagle", "lookahead"}
    for row in rows:
        assert row["tok_s"] > 0 and row["ms_per_step"]["target"] > 0
        assert row["identical_sequences"] == row["batch"]  # float32: drafting never changes a token
    assert "ms per step" in (tmp_path / "spec.md").read_text()


def test_arrivals_script_runs_variants_interleaved():
    """bench/arrivals.py: a runner attribute and the default, interleaved, with the same greedy tokens, and steps
    that mix decodes with prompts (requests arrive as others finish)."""
    script = SCRIPT.parent / "arrivals.py"
    proc = subprocess.run([sys.executable, str(script), "--requests", "12", "--concurrency", "4", "--max-tokens", "20",
                           "--rounds", "2", "--threads", "1", "--variants", "runner.fresh_causal_path=false",
                           "default", "offline",
                           # on CUDA the card is shared with the other test workers: a small share each
                           "--memory-share", "0.03"], capture_output=True, text=True, timeout=180,
                          # float32 on either device: in bf16 (CUDA's default) the variants' different step shapes
                          # may flip near-ties, which the script counts and this test would take for a failure
                          env={**os.environ, "ZOO_DTYPE": "float32"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rounds = [line for line in proc.stdout.splitlines() if line.startswith("round ")]
    assert len(rounds) == 6 and all("mixed" in line for line in rounds)
    summary = [line for line in proc.stdout.splitlines() if line.startswith("  ")]
    # `offline` adds every request at once, as LLM.generate does: the same greedy tokens
    assert len(summary) == 3 and all(line.endswith("same tokens") for line in summary), proc.stdout


def test_serve_script_pins_the_server_and_interleaves_the_offline_engine(tmp_path):
    """bench/serve.py: a server on its own core (where the machine has two), a level, then pairs of the widest
    level and LLM.generate taking turns; every request completes and the ratios are written."""
    cores = sorted(os.sched_getaffinity(0))
    out = tmp_path / "serve.json"
    args = [sys.executable, str(SCRIPT.parent / "serve.py"), "--concurrency", "4", "--rounds", "2", "--max-tokens", "8",
            "--interleave", "2", "--out", str(out),
            # under ZOO_DEVICE=cuda the server and LLM.generate share one GPU with the other test workers
            "--runtime", "gpu_memory_utilization=0.03"] + (["--server-cpus", str(cores[-1])] if len(cores) > 1 else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["levels"][0]["requests"] == 8 and record["levels"][0]["output_tok_s"] > 0
    assert len(record["interleaved_pairs"]) == 2 and all(pair["ratio"] > 0 for pair in record["interleaved_pairs"])
    if len(cores) > 1:  # LLM.generate computed on the server's one core
        assert record["server_cpus"] == [cores[-1]] and record["offline_threads"] == 1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 3,
                    reason="needs a core for the clients, the HTTP process and the engine")
def test_serve_script_pins_the_engine_and_the_offline_engine_to_the_same_cores(tmp_path):
    """bench/serve.py --engine-cpus: the engine process's threads on one core, the HTTP process on another, the
    clients on the rest; LLM.generate computes on the engine's core with one thread."""
    cores = sorted(os.sched_getaffinity(0))
    out = tmp_path / "serve.json"
    args = [sys.executable, str(SCRIPT.parent / "serve.py"), "--concurrency", "4", "--rounds", "2", "--max-tokens", "8",
            "--interleave", "1", "--out", str(out), "--runtime", "gpu_memory_utilization=0.03",
            "--server-cpus", str(cores[-2]), str(cores[-1]), "--engine-cpus", str(cores[-1])]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"pinned: the engine process on cores [{cores[-1]}], the HTTP process on [{cores[-2]}]" in proc.stdout
    record = json.loads(out.read_text())
    assert record["engine_cpus"] == [cores[-1]] and record["offline_threads"] == 1
    assert len(record["interleaved_pairs"]) == 1 and record["interleaved_pairs"][0]["ratio"] > 0


def test_the_profiles_current_variant_is_the_runtimes_defaults():
    # bench/profile_gpu_step.py's "current" variant is what its A/Bs measure new switches against: it must set
    # every switch it touches to the runtime's default, or the profile measures a configuration nobody runs.
    profile_gpu_step = bench_module("profile_gpu_step")
    switches = profile_switches()
    defaults = {(module.__name__, name): getattr(module, name) for module, name in switches}
    try:
        profile_gpu_step.apply(profile_gpu_step.VARIANTS["current"])
        applied = {(module.__name__, name): getattr(module, name) for module, name in switches}
    finally:
        for module, name in switches:
            setattr(module, name, defaults[(module.__name__, name)])
    assert applied == defaults


def test_gpu_benchmark_sets_named_switches_and_refuses_unknown_ones():
    # bench/gpu.py --set: an A/B of switches that CUDA graphs capture, which --compare-switch cannot flip mid-run.
    import pytest

    gpu = bench_module("gpu")
    from zoo import fused_ops

    default = fused_ops.PROJECTION_GEMV_MAX_ROWS
    try:
        assert gpu.set_switches(["fused_ops.PROJECTION_GEMV_MAX_ROWS=2"]) == {"fused_ops.PROJECTION_GEMV_MAX_ROWS": 2}
        assert fused_ops.PROJECTION_GEMV_MAX_ROWS == 2
    finally:
        fused_ops.PROJECTION_GEMV_MAX_ROWS = default
    with pytest.raises(SystemExit, match="has no NO_SUCH_SWITCH"):
        gpu.set_switches(["fused_ops.NO_SUCH_SWITCH=1"])


def test_gpu_benchmark_reports_a_short_run_of_batch_1_alone(tmp_path):
    # bench/gpu.py --batches 1 --skip-prefill --skip-offline --skip-hf: the batch-1 figure in a short device window;
    # its report holds what ran and nothing of what did not.
    import torch

    gpu = bench_module("gpu")
    record = {"device": "a GPU", "torch": torch.__version__, "command": "gpu.py --batches 1 --skip-offline",
              "copy_bandwidth_TBps": 4.0, "weight_bytes": int(2.47e9), "zoo_overlap_steps": True,
              "zoo_sweep": {1: {"decode_tok_s": 1100.0, "step_ms": 0.909, "roofline_step_ms": 0.6175,
                                "roofline_fraction": 0.679, "e2e_tok_s": 1000.0}}}
    gpu.write_reports(record, tmp_path)
    report = (tmp_path / "gpu.md").read_text()
    assert "| 1 | 1100 | 0.91 | 0.62 | 68% | - | - | - |" in report
    assert "Offline" not in report and "Prefill" not in report and "transformers" not in report
    assert json.loads((tmp_path / "gpu.json").read_text())["zoo_sweep"]["1"]["decode_tok_s"] == 1100.0


def test_the_profiles_interleaved_engines_are_refused_where_they_cannot_fit():
    # Round 13's A/B of nine variants with 16,384 cache blocks each ran an H100 out of memory 46 s in; the check
    # refuses at once and names the cache size that fits.
    import argparse

    import pytest

    profile_gpu_step = bench_module("profile_gpu_step")
    assert profile_gpu_step.kv_block_bytes(16) == 512 * 1024  # 16 layers x K,V x 16 tokens x 8 heads x 64 x bf16
    parser = argparse.ArgumentParser()
    gib = 1 << 30
    weights = int(2.47e9)
    profile_gpu_step.check_engines_fit(parser, 9, weights, 2048, 16, free_bytes=78 * gib)  # fits: no error
    with pytest.raises(SystemExit):
        profile_gpu_step.check_engines_fit(parser, 9, weights, 16384, 16, free_bytes=78 * gib)
    profile_gpu_step.check_engines_fit(parser, 9, weights, 16384, 16, free_bytes=139 * gib)  # an H200 holds them


def test_the_profiles_interleaved_prefills_run_on_their_own_variants_switches(monkeypatch):
    # The graphs hold the switches they were captured with; an eager prefill reads the module switches as it
    # launches, so each variant's prefill runs with its own set again (round 13's prefill rows ran all on the last),
    # and the rounds take the variants forwards and backwards in turn.
    profile_gpu_step = bench_module("profile_gpu_step")
    from zoo import fused_ops, model, triton_attention

    ablated = [(fused_ops, "add_rms_norm"), (triton_attention, "_merge_splits_kernel"), (model, "paged_attention")]
    for module, name in profile_switches() + ablated:
        monkeypatch.setattr(module, name, getattr(module, name))  # each restored after the test
    seen = []
    monkeypatch.setattr(profile_gpu_step, "graph_time_ms", lambda llm, batch: 1.0)
    monkeypatch.setattr(profile_gpu_step, "prefill_time_ms", lambda llm, length, seed: seen.append(
        (triton_attention.CACHED_FIRST, model.paged_attention.__name__)) or 2.0)
    variants = profile_gpu_step.VARIANTS
    kept = [("current", None, variants["current"]), ("no_cached_first", None, variants["no_cached_first"]),
            ("no_attention", None, variants["no_attention"])]
    result = profile_gpu_step.interleaved_graph_times(kept, [1], 2, say=lambda text: None)
    forwards = [(True, "paged_attention"), (False, "paged_attention"), (True, "<lambda>")]
    assert seen == forwards + forwards[::-1]  # the second round in the other order
    assert result["no_cached_first batch   1"]["median_ms"] == 1.0 and result["current prefill"]["median_ms"] == 2.0
    profile_gpu_step.apply(variants["current"])  # the ablation's stand-in goes before the originals come back


def test_grid_barrier_benchmark_agrees_with_its_reference(tmp_path):
    """bench/grid_barrier.py's two ways of running the phases (a launch each, or one persistent kernel with
    barriers) give the sums torch computes: on CPU in Triton's interpreter with one program, on a GPU compiled (the
    device's older Triton interpreter cannot run it)."""
    pytest.importorskip("triton")
    import torch

    interpret = not torch.cuda.is_available()
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "barrier.json"
    script = SCRIPT.parent / "grid_barrier.py"
    proc = subprocess.run([sys.executable, str(script), "--phases", "3", "--mb", "0", "0.05", "--block", "64",
                           "--out", str(out)], capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the script checks both ways' sums, and their graphs' on CUDA
    report = json.loads(out.read_text())
    assert len(report["cases"]) == 2
    if not interpret:
        assert all(case["persistent"]["us_per_phase"] > 0 for case in report["cases"])
        return
    assert proc.stdout.count("both ways give the expected sums") == 2
    assert report["programs"] == 1 and [case["per_program_bytes"] for case in report["cases"]] == [128, 52352]
    refused = subprocess.run([sys.executable, str(script), "--programs", "2"], capture_output=True, text=True,
                             timeout=180, env=env)
    assert refused.returncode == 2 and "never opens" in refused.stderr


def test_step_layout_benchmark_times_both_layouts():
    """bench/step_layout.py: each prompt workload's steps timed with the lists and the device layout, then the
    host's share of a one-prompt generate both ways."""
    proc = subprocess.run([sys.executable, str(SCRIPT.parent / "step_layout.py"), "--device", "cpu", "--repeats", "1",
                           "--generates", "3"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert any(row.startswith("| 1, 2040 |") for row in rows) and any(row.startswith("| 8, 8192 |") for row in rows)
    assert "lists" in proc.stdout.splitlines()[-1] and "device layout" in proc.stdout.splitlines()[-1]
