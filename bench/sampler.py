"""Time Sampler.select for a batch of sampled rows (temperature, top-k, top-p, min-p, own seeds).

    python bench/sampler.py --rows 64 --vocab 32000
"""

from __future__ import annotations

import argparse
import time

import torch

from zoo.request import Request
from zoo.sampler import Sampler
from zoo.sampling_params import SamplingParams


class NoHooks:
    def zoo_logits_process(self, **kwargs):
        return []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--peaked", action="store_true",
                   help="a few likely tokens per row, as trained models give (random logits are nearly flat)")
    args = p.parse_args()
    device = torch.device(args.device)
    sampler = Sampler(NoHooks(), None, 0, device, eos_token_ids=[])
    settings = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=50), dict(temperature=0.7, min_p=0.05),
                dict(temperature=1.2, top_k=40, top_p=0.95)]
    requests = [Request(i, [1, 2, 3], SamplingParams(seed=i, **settings[i % len(settings)])) for i in range(args.rows)]
    histories = [r.token_ids for r in requests]
    logits = torch.randn(args.rows, args.vocab, device=device) * 3
    if args.peaked:
        logits[:, :20] += 10
    sampler.select(logits, requests, histories)
    times = []
    for _ in range(args.iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.select(logits, requests, histories)
        times.append(time.perf_counter() - start)
    times.sort()
    kind = "peaked" if args.peaked else "flat"
    print(f"{args.rows} rows x {args.vocab} vocab ({kind} logits) on {device}: median {1000 * times[len(times) // 2]:.2f} ms per select")


if __name__ == "__main__":
    main()
