"""Speculative decoding on the GPU, end to end in one run: train a target, train its heads, measure.

1. ``zoo.pretrain`` trains the ``h200`` target (Llama-shaped, ~100M parameters, Python's standard library)
   within ``--pretrain-s`` seconds;
2. ``zoo.train`` trains Medusa and EAGLE heads for it by self-distillation;
3. ``decoding=none|medusa|eagle|lookahead`` on it side by side, greedy, at batch 1, 8 and 64: output
   tokens/s, mean accepted length, acceptance by depth, speedup over ``none``, sequences identical to ``none``
   (bf16: a different draft shape may part at a near-tie, so this is counted, not required);
4. on the Llama-3.2-1B shape (random weights, bf16), the time of one verify step with 16, 32 and 64 draft
   tokens at batch 1 against one plain decode step, and on the trained target the time EAGLE's drafting takes
   per step against the target's own step.

    python bench/speculative_gpu.py --out bench/results/gpu/speculative      # writes spec.json, spec.md
    python bench/speculative_gpu.py --plot bench/results/gpu/speculative/spec.json   # spec.png (matplotlib)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from zoo import LLM, DecodingMethod, DraftBlock, SamplingParams, hookimpl  # noqa: E402
from zoo.config import compose_config  # noqa: E402

START = time.perf_counter()
METHODS = ("none", "medusa", "eagle", "lookahead")
BATCHES = [1, 8, 64]
DTYPE = "bfloat16"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def compose(name: str, overrides: list[str]):
    return compose_config(overrides, name)


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the end of the standard library's text, the share
    ``zoo.pretrain`` holds out (2%: the last files in its sorted order)."""
    from zoo.pretrain import stdlib_texts

    texts = stdlib_texts(10**10)
    tail = "".join(texts)[-int(0.02 * sum(map(len, texts))):]
    ids = tokenizer.encode(tail)
    stride = max(length, (len(ids) - length) // count)
    return [ids[i:i + length] for i in range(0, len(ids) - length, stride)][:count]


def measure(llm, prompts, new_tokens: int, repeats: int = 2) -> tuple[float, list, object]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))  # warm-up
    best, outputs = float("inf"), None
    for _ in range(repeats):
        llm.engine.stats = type(llm.engine.stats)()
        synchronize()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return len(prompts) * new_tokens / best, [o.token_ids for o in outputs], llm.engine.stats


BF16_TIE = 0.05  # log-probability gap under which plain decoding's top two candidates count as a near-tie


def parting_gaps(plain_outputs, tokens) -> list[float | None]:
    """For each sequence that differs from plain decoding: the gap between plain decoding's top two
    log-probabilities at the first differing token (a near-tie below BF16_TIE: bf16 sums in another order
    for another batch or draft shape); None where one output is a prefix of the other."""
    gaps = []
    for reference, got in zip(plain_outputs, tokens):
        if reference.token_ids == got:
            continue
        k = next((i for i, (a, b) in enumerate(zip(reference.token_ids, got)) if a != b), None)
        if k is None:
            gaps.append(None)
            continue
        first, second = [value for _, value in reference.logprobs[k]["top"]]
        gaps.append(round(first - second, 4))
    return gaps


def method_rows(target: Path, heads: dict, prompts, new_tokens: int) -> list[dict]:
    rows, plain = [], {}
    for method in METHODS:
        overrides = [f"decoding.heads={heads[method]}"] if method in heads else []
        llm = LLM(str(target), decoding=method, overrides=overrides, dtype=DTYPE, enable_prefix_caching=False,
                  max_num_seqs=max(BATCHES))  # no graphs captured for batches never run
        policy = llm.engine.draft_batch_limit, llm.engine.draft_step_tokens
        unloaded = [(b, True) for b in BATCHES if b > 1] if method != "none" else []
        for batch, always in [(b, False) for b in BATCHES] + unloaded:
            # The last rows draft in full at every batch size (no disable_by_batch_size, no
            # draft_tokens_per_step): what the load policy saves.
            llm.engine.draft_batch_limit, llm.engine.draft_step_tokens = (1 << 62, 1 << 62) if always else policy
            tok_s, tokens, stats = measure(llm, prompts[:batch], new_tokens)
            accepted = stats.accepted_depth + [0] * len(stats.drafted_depth)
            row = {"method": method + (" (no load policy)" if always else ""), "batch": batch, "tok_s": round(tok_s, 1),
                   "accepted_length": round(stats.generated_tokens / max(stats.token_steps, 1), 3),
                   "acceptance_by_depth": [round(a / n, 3) for n, a in zip(stats.drafted_depth, accepted) if n]}
            if method == "none":
                plain[batch] = (tok_s, tokens, llm.generate(prompts[:batch], SamplingParams(
                    max_new_tokens=new_tokens, ignore_eos=True, logprobs=2)))
            row["speedup"] = round(tok_s / plain[batch][0], 3)
            row["identical_sequences"] = sum(a == b for a, b in zip(tokens, plain[batch][1]))
            row["parting_gaps"] = parting_gaps(plain[batch][2], tokens)
            row["ms_per_step"] = phase_profile(llm, prompts[:batch], new_tokens)
            rows.append(row)
            log(f"{row['method']:9} batch {batch:3}: {tok_s:9.1f} tok/s  x{row['speedup']:.2f}  accepted "
                f"{row['accepted_length']:.2f}  identical {row['identical_sequences']}/{batch}")
        release(llm)
        llm = None
    return rows


def release(llm) -> None:
    """Drop an engine's memory before the next one starts: its KV cache fills its share of the GPU, and an
    engine started beside it gets only what is left free."""
    llm.engine.runner.kv.release()
    gc.collect()
    torch.cuda.empty_cache()


def phase_profile(llm, prompts, new_tokens: int) -> dict:
    """Milliseconds per step in each phase of the engine's step, each timed between device synchronisations
    (so the phases' sum exceeds an unprofiled step): drafting (``propose``), laying out the step
    (``prepare``), the target's forward pass (``target``), choosing and committing tokens (``commit``), and the
    step-results hooks (``results``: EAGLE's extend pass)."""
    engine, spent = llm.engine, dict.fromkeys(("propose", "prepare", "target", "commit", "results"), 0.0)
    originals = []

    def timed(owner, attribute, name):
        function = getattr(owner, attribute)
        originals.append((owner, attribute, function))

        def wrapper(*args, **kwargs):
            synchronize()
            start = time.perf_counter()
            out = function(*args, **kwargs)
            synchronize()
            spent[name] += time.perf_counter() - start
            return out
        setattr(owner, attribute, wrapper)

    timed(engine, "_drafts", "propose")
    timed(engine.runner, "prepare", "prepare")
    timed(engine.runner, "run", "target")
    timed(engine.committer, "commit_step", "commit")
    timed(engine.hooks, "zoo_step_results", "results")
    try:
        _, _, stats = measure(llm, prompts, new_tokens, repeats=1)
    finally:
        for owner, attribute, function in originals:
            setattr(owner, attribute, function)
    steps = max(stats.steps, 1)
    return {key: round(1000 * value / steps, 3) for key, value in spent.items()} | {"steps": steps}


class FixedChain(DecodingMethod):
    """For timing only: a chain of ``n`` copies of the last token, so that every step verifies ``n`` drafts."""

    name = "fixed_chain"

    def __init__(self, n: int):
        self.max_draft_tokens = n

    def propose(self, requests):
        return {r.request_id: DraftBlock.chain([r.token_ids[-1]] * self.max_draft_tokens) for r in requests}


class RegistersFixedChain:
    name = "registers_fixed_chain"

    def __init__(self, n: int):
        self.n = n

    @hookimpl
    def zoo_decoding_methods(self):
        return {"fixed_chain": lambda engine: FixedChain(self.n)}


def verify_step_cost(folder: Path, drafts=(16, 32, 64), new_tokens: int = 64) -> dict:
    """Milliseconds per step at batch 1 on the 1B shape: plain decode, then verify steps of n draft tokens."""
    costs, phases = {}, {}
    for n in (0, *drafts):
        llm = LLM(str(folder), plugins=[RegistersFixedChain(n)] if n else [], dtype=DTYPE, max_num_seqs=1,
                  enable_prefix_caching=False, overrides=["decoding.name=fixed_chain"] if n else [])
        _, _, stats = measure(llm, [[1] * 128], new_tokens)
        decode_steps = max(stats.steps - 1, 1)  # the first step is the prompt's
        costs[n] = round(1000 * stats.decode_seconds / decode_steps, 3)
        phases[n] = phase_profile(llm, [[1] * 128], new_tokens)
        log(f"1B shape, batch 1: {'plain' if n == 0 else f'verify {n}':>10}: {costs[n]:.3f} ms per step; graphs "
            f"{dict(llm.engine.runner.graphs.replays)}; phases {phases[n]}")
        release(llm)
    return {"ms_per_step": costs, "ratio_to_plain": {n: round(costs[n] / costs[0], 3) for n in drafts},
            "phases": phases}


def write_markdown(record: dict, path: Path) -> None:
    lines = ["| method | batch | tok/s | speedup | accepted length | identical (+ parted at a near-tie) | "
             "acceptance by depth | ms per step: propose / prepare / target / commit / results |",
             "|---|---|---|---|---|---|---|---|"]
    for row in record["methods"]:
        if "batch" in row:
            depths = " ".join(f"{a:.2f}" for a in row["acceptance_by_depth"][:5]) or "-"
            ties = sum(gap is not None and gap < BF16_TIE for gap in row.get("parting_gaps", []))
            phases = " / ".join(f"{row['ms_per_step'][k]:.2f}" for k in ("propose", "prepare", "target", "commit",
                                                                           "results")) if "ms_per_step" in row else "-"
            lines.append(f"| {row['method']} | {row['batch']} | {row['tok_s']:.0f} | {row['speedup']:.2f}x | "
                         f"{row['accepted_length']:.2f} | {row['identical_sequences']} (+{ties}) of {row['batch']} | "
                         f"{depths} | {phases} |")
    verify = record.get("verify_1b")
    if verify:
        lines += ["", "| 1B shape, batch 1 | ms per step | x plain |", "|---|---|---|",
                  f"| plain decode | {verify['ms_per_step']['0']:.3f} | 1.00 |"]
        lines += [f"| verify {n} drafts | {verify['ms_per_step'][n]:.3f} | {ratio:.2f} |"
                  for n, ratio in verify["ratio_to_plain"].items()]
        lines += ["", "Phases (ms per step, each between synchronisations): " + "; ".join(
            f"{'plain' if n == '0' else 'verify ' + n}: " + ", ".join(f"{k} {v:.2f}" for k, v in p.items() if k != "steps")
            for n, p in verify.get("phases", {}).items())]
    path.write_text("\n".join(lines) + "\n")


def plot(json_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    record = json.loads(json_path.read_text())
    rows = [r for r in record["methods"] if "batch" in r]
    figure, axes = pyplot.subplots(figsize=(7, 3.8))
    width = 0.2
    for i, method in enumerate(METHODS):
        values = [next((r["speedup"] for r in rows if r["method"] == method and r["batch"] == b), 0) for b in BATCHES]
        axes.bar([x + (i - 1.5) * width for x in range(len(BATCHES))], values, width, label=method)
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set(xticks=range(len(BATCHES)), xticklabels=[f"batch {b}" for b in BATCHES], ylabel="speedup over none",
             title=f"zoo speculative decoding, H200, {record['target']['parameters'] / 1e6:.0f}M target")
    axes.legend()
    figure.tight_layout()
    figure.savefig(json_path.with_suffix(".png"), dpi=110)


def smoke(args) -> int:
    global DTYPE
    import zoo
    from zoo.tokenizer import load_tokenizer

    DTYPE, BATCHES[:] = "float32", [1, 2]
    target = Path(zoo.__file__).parent / "default_model"
    heads = {m: target / "zoo_heads" / m for m in ("medusa", "eagle")}
    prompts = held_out_prompts(load_tokenizer(target), 2, 16)
    record = {"target": {"parameters": 0}, "methods": method_rows(target, heads, prompts, args.new_tokens)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec.json").write_text(json.dumps(record, indent=1))
    write_markdown(record, args.out / "spec.md")
    print((args.out / "spec.md").read_text())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu/speculative"))
    p.add_argument("--pretrain-s", type=float, default=130)
    p.add_argument("--train-steps", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip-1b", action="store_true")
    p.add_argument("--plot", type=Path, default=None, help="only draw the PNG of an earlier run's JSON")
    p.add_argument("--smoke", action="store_true",
                   help="CPU check of the measuring code: the shipped default model and heads, no training")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot)
        return 0
    if args.smoke:
        return smoke(args)
    from zoo.pretrain import pretrain
    from zoo.tokenizer import load_tokenizer
    from zoo.train import train

    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zoo_spec_"))
    target = work / "target"
    corpus_chars = 12_000_000
    pretrain(compose("pretrain", [f"out={target}", "target_size=h200", "device=cuda",
                                  f"target_size.time_limit_s={args.pretrain_s}", f"max_corpus_chars={corpus_chars}"]))
    pretrain_log = json.loads((target / "pretrain_log.json").read_text())
    log(f"target: {pretrain_log['parameters'] / 1e6:.1f}M parameters, {pretrain_log['steps']} steps, held-out loss "
        f"{pretrain_log['held_out_loss']}")
    heads, reports = {}, {}
    for method in ("medusa", "eagle"):
        heads[method] = work / method
        report = train(compose("train", [f"model.path={target}", f"decoding={method}", f"train.out={heads[method]}",
                                         "runtime.dtype=bfloat16", "train.num_prompts=1024", "train.batch_size=32",
                                         f"train.steps={args.train_steps}", "train.max_new_tokens=192",
                                         "train.lr=2e-3"]))
        reports[method] = {k: report.get(k) for k in ("steps", "sequences", "held_out")}
        log(f"{method} heads: {reports[method]}")
    prompts = held_out_prompts(load_tokenizer(target), 64, 64)
    record = {"target": {k: pretrain_log[k] for k in ("parameters", "steps", "seconds", "held_out_loss", "config")},
              "heads": reports, "new_tokens": args.new_tokens, "prompt_tokens": 64,
              "device": torch.cuda.get_device_name()}
    record["methods"] = method_rows(target, heads, prompts, args.new_tokens)
    (args.out / "spec.json").write_text(json.dumps(record, indent=1))
    write_markdown(record, args.out / "spec.md")
    if not args.skip_1b:
        sys.path.insert(0, str(Path(__file__).parent))
        from gpu import write_checkpoint

        folder = work / "llama1b"
        write_checkpoint(folder, 16)
        record["verify_1b"] = verify_step_cost(folder)
        record["verify_1b"]["ms_per_step"] = {str(k): v for k, v in record["verify_1b"]["ms_per_step"].items()}
        record["verify_1b"]["ratio_to_plain"] = {str(k): v for k, v in record["verify_1b"]["ratio_to_plain"].items()}
        record["verify_1b"]["phases"] = {str(k): v for k, v in record["verify_1b"]["phases"].items()}
    (args.out / "spec.json").write_text(json.dumps(record, indent=1))
    write_markdown(record, args.out / "spec.md")
    print((args.out / "spec.md").read_text())
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
