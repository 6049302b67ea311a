"""Decode speed with LoRA adapters on the Llama-3.2-1B shape (H200, bf16, CUDA graphs).

    python bench/lora_gpu.py --out bench/results/gpu/lora      # on the device (bench/gpu_session.sh lora)

Random-weight 1B-shape checkpoint (bench/gpu.py's shape) and eight rank-16 LoRA
adapters on all seven projections, written in PEFT's layout. Decode tokens/s at
batch 1 and 64 for: the base model on an engine without adapters; base requests
on an engine that serves adapters; every request on one adapter; 64 requests
over 8 adapters (8 each). The ratio to the base engine is what the issue's
target reads (8 adapters at batch 64: at least 0.75). A torch.profiler table of
the 8-adapter case says where the time goes.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from gpu import SHAPE, write_checkpoint  # noqa: E402
from zoo import LLM, SamplingParams  # noqa: E402

PROJECTIONS = {"self_attn.q_proj": ("h", "q"), "self_attn.k_proj": ("h", "kv"), "self_attn.v_proj": ("h", "kv"),
               "self_attn.o_proj": ("q", "h"), "mlp.gate_proj": ("h", "i"), "mlp.up_proj": ("h", "i"),
               "mlp.down_proj": ("i", "h")}


def write_lora(folder: Path, layers: int, rank: int, seed: int) -> None:
    """A PEFT-layout LoRA folder with random A and B on every projection."""
    from safetensors.torch import save_file

    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    size = {"h": SHAPE["hidden_size"], "q": SHAPE["hidden_size"], "kv": SHAPE["num_key_value_heads"] * head_dim,
            "i": SHAPE["intermediate_size"]}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for path, (fan_in, fan_out) in PROJECTIONS.items():
            key = f"base_model.model.model.layers.{layer}.{path}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, size[fan_in], generator=g) * 0.01).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(size[fan_out], rank, generator=g) * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [p.split(".")[1] for p in PROJECTIONS],
        "task_type": "CAUSAL_LM"}))


def decode_rate(llm, requests, new_tokens: int, rounds: int = 3) -> float:
    """Decode tokens/s, the best of ``rounds``: a full run minus a prefill-only run of the same requests.
    The best, because the first engine of a process otherwise measures the GPU still warming up."""
    def timed(n):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(requests, SamplingParams(max_new_tokens=n, ignore_eos=True))
        torch.cuda.synchronize()
        assert all(o.error is None for o in outs), [o.error for o in outs][:2]
        return time.perf_counter() - start
    timed(4)  # warm-up
    return max(len(requests) * (new_tokens - 1) / (timed(new_tokens) - timed(1)) for _ in range(rounds))


def profile_table(llm, requests, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm.generate(requests, SamplingParams(max_new_tokens=4, ignore_eos=True))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(requests, SamplingParams(max_new_tokens=16, ignore_eos=True))
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu/lora"))
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="zoo_lora_"))
    write_checkpoint(work / "base", args.layers)
    adapters = {}
    for i in range(8):
        write_lora(work / f"a{i}", args.layers, args.rank, seed=i)
        adapters[f"a{i}"] = str(work / f"a{i}")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, SHAPE["vocab_size"], (64, args.prompt_len), generator=g).tolist()
    common = dict(dtype="bfloat16", max_num_seqs=64, enable_prefix_caching=False)
    rows = []

    def record(case, batch, rate, base=None):
        row = {"case": case, "batch": batch, "decode_tok_s": round(rate, 1)}
        if base:
            row["vs_base"] = round(rate / base, 3)
        rows.append(row)
        print(f"{case:34} batch {batch:3}: {rate:9.1f} tok/s" + (f"  x{row['vs_base']:.3f}" if base else ""), flush=True)

    llm = LLM(str(work / "base"), **common)
    base = {b: decode_rate(llm, [{"prompt_ids": p} for p in prompts[:b]], args.new_tokens) for b in (1, 64)}
    for b in (1, 64):
        record("base, engine without adapters", b, base[b])
    del llm
    gc.collect()  # an engine's KV cache fills its share: free it before the next engine starts
    torch.cuda.empty_cache()
    llm = LLM(str(work / "base"), adapters=adapters, max_loras=8, max_lora_rank=args.rank, **common)
    for b in (1, 64):
        record("base requests, engine with adapters", b,
               decode_rate(llm, [{"prompt_ids": p} for p in prompts[:b]], args.new_tokens), base[b])
        record("one rank-16 adapter", b,
               decode_rate(llm, [{"prompt_ids": p, "adapter": "a0"} for p in prompts[:b]], args.new_tokens), base[b])
    eight = [{"prompt_ids": p, "adapter": f"a{i % 8}"} for i, p in enumerate(prompts)]
    record("8 rank-16 adapters, 8 requests each", 64, decode_rate(llm, eight, args.new_tokens), base[64])
    profile_table(llm, eight, args.out / "profile_8_adapters.txt")
    record_json = {"shape": {**SHAPE, "num_hidden_layers": args.layers}, "rank": args.rank, "new_tokens": args.new_tokens,
                   "prompt_len": args.prompt_len, "device": torch.cuda.get_device_name(), "rows": rows,
                   "graph_replays": dict(llm.engine.runner.graphs.replays)}
    (args.out / "lora.json").write_text(json.dumps(record_json, indent=1))
    lines = ["| case | batch | decode tok/s | × base engine |", "|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['batch']} | {r['decode_tok_s']:.0f} | {r.get('vs_base', 1.0):.2f} |" for r in rows]
    (args.out / "lora.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
