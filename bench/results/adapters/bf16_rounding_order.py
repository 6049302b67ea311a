"""Where zoo's bf16 LoRA parts from peft's bf16, on CPU: 40 greedy requests on the r8 adapter (rslora, every
projection) of tests/test_adapters.py's llama family, each checked token by token against a peft peer in bf16.

    python bench/results/adapters/bf16_rounding_order.py           # from the repository root

Prints, per peer, each request's first parting (token index, the peer's log-probability gap between its best
and zoo's token) or None: peft as saved (the scale multiplies B's product, rounded after it) and peft with the
scale folded into B (zoo's and vLLM's rounding).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
import tempfile  # noqa: E402

import torch  # noqa: E402
from conftest import prompt_set  # noqa: E402
from test_adapters import Family, scale_folded_into_b  # noqa: E402

from zoo import SamplingParams  # noqa: E402


def first_parting(model, prompt, tokens):
    ids = list(prompt)
    for k, token in enumerate(tokens):
        with torch.no_grad():
            t = torch.tensor([ids])
            lp = torch.log_softmax(model(input_ids=t, attention_mask=torch.ones_like(t)).logits[0, -1].float(), -1)
        best = int(lp.argmax())
        if best != token:
            return k, round(float(lp[best] - lp[token]), 4)
        ids.append(token)
    return None


family = Family("llama", Path(tempfile.mkdtemp()))
requests = [{"prompt_ids": p, "adapter": "r8"} for seed in range(8) for p in prompt_set(seed=seed)[:5]]
outputs = family.llm(device="cpu", dtype="bfloat16").generate(requests, SamplingParams(max_new_tokens=12,
                                                                                       ignore_eos=True))
peer = family.peers["r8"]
for name, model in (("peft as saved", peer), ("peft, scale folded into B", scale_folded_into_b(peer))):
    model = model.to(torch.bfloat16)
    partings = [first_parting(model, r["prompt_ids"], o.token_ids) for r, o in zip(requests, outputs)]
    gaps = [p[1] for p in partings if p]
    print(f"{name}: {partings.count(None)} of {len(partings)} match; partings {partings}; largest gap "
          f"{max(gaps) if gaps else 0}; above 0.05: {sum(g > 0.05 for g in gaps)}")
