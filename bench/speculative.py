"""Speculative decoding side by side: transformers, zoo plain decoding and each zoo method, in one process.

Every engine decodes the same prompts greedily for ``--new-tokens`` tokens (EOS
ignored). Printed per engine: output tokens/s (best of ``--repeats``), and for
zoo's methods the mean accepted length (generated tokens per step), the
acceptance at draft depths 1-4, the speedup over zoo's plain decoding and
whether every token equals plain decoding's. Without trained heads
(``--heads METHOD=DIR``) Medusa and EAGLE start fresh and accept little: the
table then shows what drafting costs, not what it gains.

    python bench/speculative.py                                   # random-init Llama on CPU
    python bench/speculative.py --model-path CKPT --device cuda --dtype bfloat16 \\
        --heads medusa=CKPT/medusa --heads eagle=CKPT/eagle --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from zoo.engine_setup import DTYPES  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF checkpoint folder; omitted: a random-init Llama")
    p.add_argument("--methods", default="medusa,lookahead,eagle", help="comma-separated zoo decoding methods")
    p.add_argument("--heads", action="append", default=[], metavar="METHOD=DIR", help="decoding.heads per method")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--skip-hf", action="store_true", help="leave transformers out")
    p.add_argument("--json", metavar="OUT", default=None)
    g = p.add_argument_group("random-init checkpoint (only without --model-path)")
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--vocab-size", type=int, default=1000)
    return p.parse_args(argv)


def random_checkpoint(args, folder: str) -> None:
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                                      intermediate_size=2 * args.hidden_size, num_hidden_layers=args.num_layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def best_time(run, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, result


def zoo_row(args, folder: str, method: str, prompts, plain_tokens) -> dict:
    from zoo import LLM, SamplingParams

    heads = dict(h.split("=", 1) for h in args.heads)
    overrides = [f"decoding.heads={heads[method]}"] if method in heads else []
    llm = LLM(folder, decoding=method, overrides=overrides, device=args.device, dtype=args.dtype,
              enable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    llm.engine.stats = type(llm.engine.stats)()
    seconds, outputs = best_time(lambda: llm.generate(prompts, params), args.repeats)
    stats = llm.engine.stats
    tokens = [o.token_ids for o in outputs]
    return {"engine": f"zoo {method}", "tok_s": len(prompts) * args.new_tokens / seconds,
            "accepted_length": stats.generated_tokens / max(stats.token_steps, 1),
            "acceptance": [a / n for n, a in zip(stats.drafted_depth[:4], stats.accepted_depth + [0] * 4)],
            "tokens_equal_plain": plain_tokens is None or tokens == plain_tokens, "tokens": tokens}


def hf_row(args, folder: str, prompts) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(args.device).eval()
    ids = torch.tensor(prompts, device=args.device)

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                  min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)

    seconds, _ = best_time(run, args.repeats)
    return {"engine": "transformers generate", "tok_s": len(prompts) * args.new_tokens / seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model_path or tmp
        if args.model_path is None:
            random_checkpoint(args, tmp)
        g = torch.Generator().manual_seed(0)
        vocab = args.vocab_size if args.model_path is None else 1000
        prompts = torch.randint(0, vocab, (args.batch_size, args.prompt_len), generator=g).tolist()
        rows = [] if args.skip_hf else [hf_row(args, folder, prompts)]
        plain = zoo_row(args, folder, "none", prompts, None)
        rows.append(plain)
        for method in [m for m in args.methods.split(",") if m]:
            rows.append(zoo_row(args, folder, method, prompts, plain["tokens"]))
    print(f"{'engine':24} {'tok/s':>10} {'x plain':>8} {'accepted':>9}  acceptance by depth   tokens = plain")
    for row in rows:
        extra = ""
        if "accepted_length" in row:
            depths = " ".join(f"{a:.2f}" for a in row["acceptance"]) or "-"
            extra = f"{row['accepted_length']:9.2f}  {depths:20} {'yes' if row['tokens_equal_plain'] else 'NO'}"
        print(f"{row['engine']:24} {row['tok_s']:10.1f} {row['tok_s'] / plain['tok_s']:8.2f} {extra}")
    if args.json:
        record = {"args": vars(args), "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if all(r.get("tokens_equal_plain", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
