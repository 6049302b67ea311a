"""Next-token choice: logits processors, then greedy or seeded sampling.

Each request that sets ``seed`` draws from its own ``torch.Generator``, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from zoo.request import Request


class Sampler:
    def __init__(self, hooks, engine, seed: int, device: torch.device):
        self.hooks = hooks
        self.engine = engine
        self.device = device
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)

    def generator_for(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self.shared_generator
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.params.seed)
        return request.generator

    def process(self, logits: torch.Tensor, request: Request, history: list[int], num_generated: int,
                stop_ids: set[int]) -> torch.Tensor:
        """Apply the request's processors to one row of raw logits (returns a new row)."""
        params = request.params
        logits = logits.clone()
        if params.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), device=logits.device)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                       values * params.repetition_penalty)
        for token, bias in params.logit_bias.items():
            logits[token] += bias
        if num_generated < params.min_new_tokens and stop_ids:
            logits[torch.tensor(sorted(stop_ids), device=logits.device)] = float("-inf")
        rows = logits[None]
        self.hooks.zoo_logits_process(logits=rows, requests=[request], histories=[history], engine=self.engine)
        return rows[0]

    @staticmethod
    def filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p applied to one row (temperature > 0)."""
        logits = logits / params.temperature
        if params.top_k and params.top_k < logits.shape[-1]:
            kth = torch.topk(logits, params.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = sorted_logits.softmax(-1)
            # Keep the smallest set whose mass reaches top_p (the token crossing it included).
            drop = probs.cumsum(-1) - probs >= params.top_p
            logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = logits.softmax(-1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        return probs

    def choose(self, logits: torch.Tensor, request: Request) -> int:
        """Pick a token from one processed row."""
        if request.params.temperature == 0:
            return int(torch.argmax(logits))
        probs = self.filtered_probs(logits, request.params)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, using only this request's generator.
        noise = torch.empty_like(probs).exponential_(generator=self.generator_for(request))
        return int(torch.argmax(probs / noise))

    @staticmethod
    def logprobs(raw_logits: torch.Tensor, token: int, top_n: int) -> dict:
        logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        entry = {"token_id": token, "logprob": float(logprobs[token])}
        if top_n:
            values, ids = torch.topk(logprobs, top_n)
            entry["top"] = [[int(i), float(v)] for i, v in zip(ids, values)]
        return entry
