"""Next-token choice: logits processors, then greedy or seeded sampling.

Each request that sets ``seed`` draws from its own ``torch.Generator``, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

import torch

from zoo.request import Request


class Sampler:
    def __init__(self, hooks, engine, seed: int, device: torch.device, eos_token_ids: list[int]):
        self.hooks = hooks
        self.engine = engine
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)

    def generator_for(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self.shared_generator
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            request.generator.manual_seed(request.params.seed)
        return request.generator

    def stop_ids(self, request: Request) -> set[int]:
        ids = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def select(self, logits: torch.Tensor, requests: list[Request], histories: list[list[int]]) -> list[int]:
        """Next token for each row of raw ``logits``; row ``i`` follows ``histories[i]``."""
        logits = self.process(logits, requests, histories)
        tokens = logits.argmax(-1).tolist()  # greedy rows: one op for the whole batch
        for i, request in enumerate(requests):
            if request.params.temperature > 0:
                probs = self.filtered_probs(logits[i], request.params)
                # Exponential race: argmax(p / E), E ~ Exp(1), draws from p with this request's generator only.
                noise = torch.empty_like(probs).exponential_(generator=self.generator_for(request))
                tokens[i] = int(torch.argmax(probs / noise))
        return tokens

    def process(self, logits: torch.Tensor, requests: list[Request], histories: list[list[int]]) -> torch.Tensor:
        """The requests' processors, then the plugins', on a copy of raw ``logits``."""
        logits = logits.clone()
        for row, request, history in zip(logits, requests, histories):
            params = request.params
            if params.repetition_penalty != 1.0 and history:
                seen = torch.tensor(sorted(set(history)), device=row.device)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            for token, bias in params.logit_bias.items():
                row[token] += bias
            if len(history) - len(request.prompt_token_ids) < params.min_new_tokens:
                stop_ids = self.stop_ids(request)
                if stop_ids:
                    row[torch.tensor(sorted(stop_ids), device=row.device)] = float("-inf")
        self.hooks.zoo_logits_process(logits=logits, requests=requests, histories=histories, engine=self.engine)
        return logits

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

    @staticmethod
    def logprobs(raw_logits: torch.Tensor, token: int, top_n: int) -> dict:
        logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        entry = {"token_id": token, "logprob": float(logprobs[token])}
        if top_n:
            values, ids = torch.topk(logprobs, top_n)
            entry["top"] = [[int(i), float(v)] for i, v in zip(ids, values)]
        return entry
