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
        self.logits_hooks = bool(hooks.zoo_logits_process.get_hookimpls())

    def plain_greedy(self, request: Request) -> bool:
        """Greedy with nothing to apply to the logits: the raw argmax is the token, for every row of a step."""
        return (request.params.temperature == 0 and request.params.beam_width == 1
                and not self.has_processors(request) and not self.logits_hooks)

    @staticmethod
    def has_processors(request: Request) -> bool:
        """Whether :meth:`process` changes this request's logits now (the plugins' processors aside)."""
        params = request.params
        return (params.repetition_penalty != 1.0 or bool(params.logit_bias) or bool(params.bad_words_ids)
                or bool(params.presence_penalty) or bool(params.frequency_penalty)
                or request.num_tokens - len(request.prompt_token_ids) < params.min_new_tokens)

    def generator_for(self, request: Request) -> torch.Generator:
        if request.params.seed is None:
            return self.shared_generator
        if request.generator is None:
            request.generator = torch.Generator(device=self.device)
            # Sample k of a request with n > 1 draws its own stream, fixed by (seed, k) alone.
            request.generator.manual_seed(request.params.seed if not request.sample_index
                                          else hash((request.params.seed, request.sample_index)) % 2**63)
        return request.generator

    def stop_ids(self, request: Request) -> set[int]:
        """The token ids that end ``request``: its own stop ids, and EOS unless it ignores it."""
        if request.stop_token_set is None:  # the params are fixed once a request is admitted
            ids = set(request.params.stop_token_ids)
            if not request.params.ignore_eos:
                ids.update(self.eos_token_ids)
            request.stop_token_set = ids
        return request.stop_token_set

    def select(self, logits: torch.Tensor, requests: list[Request], histories: list[list[int]],
               argmax: torch.Tensor | None = None) -> list[int]:
        """Next token for each row of raw ``logits``; row ``i`` follows ``histories[i]``. ``argmax``: the rows'
        argmax where the step already has it (a replayed graph's)."""
        if all(self.plain_greedy(r) for r in requests):  # the common decode step: no copy of the logits
            return (logits.argmax(-1) if argmax is None else argmax).tolist()
        logits = self.process(logits, requests, histories)
        tokens = logits.argmax(-1).tolist()  # greedy rows: one op for the whole batch
        sampled = [i for i, r in enumerate(requests) if r.params.temperature > 0]
        if sampled:
            probs = self.filtered_probs_batch(logits[sampled], [requests[i].params for i in sampled])
            # Inverse-CDF draw: one uniform number per row from the request's own generator, so a
            # seeded request's tokens do not depend on the rest of the batch.
            uniform = torch.cat([torch.rand(1, generator=self.generator_for(requests[i]), device=self.device)
                                 for i in sampled])
            for i, token in zip(sampled, self._inverse_cdf(probs, uniform).tolist()):
                tokens[i] = token
        return tokens

    def probs(self, logits: torch.Tensor, requests: list[Request], histories: list[list[int]]) -> torch.Tensor:
        """The distribution each row's token is drawn from (sampled requests: processed and filtered)."""
        return self.filtered_probs_batch(self.process(logits, requests, histories), [r.params for r in requests])

    def uniform(self, request: Request) -> float:
        """One uniform number from the request's generator (rejection sampling of drafts)."""
        return float(torch.rand(1, generator=self.generator_for(request), device=self.device))

    def draw(self, probs: torch.Tensor, request: Request) -> int:
        """A token from one distribution ``[vocab]``, with the request's generator."""
        uniform = torch.rand(1, generator=self.generator_for(request), device=self.device)
        return int(self._inverse_cdf(probs[None], uniform)[0])

    @staticmethod
    def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
        cdf = probs.cumsum(-1)
        chosen = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True)[:, 0]
        # Never land on a zero-probability token through rounding at the top of the CDF.
        return torch.where(probs.gather(1, chosen.clamp(max=probs.shape[1] - 1)[:, None])[:, 0] > 0,
                           chosen, probs.argmax(-1)).clamp(max=probs.shape[1] - 1)

    def process(self, logits: torch.Tensor, requests: list[Request], histories: list[list[int]]) -> torch.Tensor:
        """The requests' processors, then the plugins', on a copy of raw ``logits``."""
        logits = logits.clone()
        for i, request in enumerate(requests):
            params = request.params
            if not self.has_processors(request):  # counted before this row's drafts
                continue  # nothing to apply: skip reading the history
            row, history = logits[i], histories[i]
            if params.repetition_penalty != 1.0 and history:
                # Ids past the vocabulary (a prompt table's rows) are not tokens the model can repeat.
                seen = torch.tensor(sorted(t for t in set(history) if t < row.shape[0]), device=row.device,
                                    dtype=torch.long)
                values = row[seen]
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            for token, bias in params.logit_bias.items():
                row[token] += bias
            if params.presence_penalty or params.frequency_penalty:
                output = [t for t in history[len(request.prompt_token_ids):] if t < row.shape[0]]
                if output:
                    ids, counts = torch.tensor(output, device=row.device).unique(return_counts=True)
                    row[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(row.dtype)
            banned = [seq[-1] for seq in params.bad_words_ids  # the history (prompt included) ends with the rest
                      if len(seq) == 1 or (len(history) >= len(seq) - 1
                                           and list(history[len(history) - len(seq) + 1:]) == list(seq[:-1]))]
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
            if len(history) - len(request.prompt_token_ids) < params.min_new_tokens:
                stop_ids = self.stop_ids(request)
                if stop_ids:
                    row[torch.tensor(sorted(stop_ids), device=row.device)] = float("-inf")
        self.hooks.zoo_logits_process(logits=logits, requests=requests, histories=histories, engine=self.engine)
        return logits

    @staticmethod
    def filtered_probs_batch(logits: torch.Tensor, params: list, candidates: int = 256) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p (in transformers' order) for many rows, each with its own settings.

        Top-p needs the tokens in order of probability; sorting a whole vocabulary per row is the
        slow part, so only the ``candidates`` most likely are sorted, and a row whose top-p mass
        is not reached within them falls back to a full sort. The result is the same either way.
        """
        rows, vocab = logits.shape
        device = logits.device

        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)[:, None]

        logits = logits / column([p.temperature for p in params])
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        if any(top_k):
            values = torch.topk(logits, max(top_k), dim=-1).values
            kth = values.gather(1, (column(top_k, torch.int64) - 1).clamp(min=0))
            kth = torch.where(column(top_k, torch.int64) > 0, kth, torch.full_like(kth, float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
        top_p = [p.top_p for p in params]
        nucleus = [r for r in range(rows) if top_p[r] < 1.0]
        if nucleus:
            part = logits[nucleus]
            probs = part.softmax(-1)
            head = torch.topk(probs, min(candidates, vocab), dim=-1).values
            limit = column([top_p[r] for r in nucleus])
            covered = head.sum(-1, keepdim=True) >= limit
            if not bool(covered.all()):
                full = torch.sort(probs, dim=-1, descending=True).values
                head = torch.where(covered, torch.nn.functional.pad(head, (0, vocab - head.shape[1])), full)
            # Keep the smallest prefix whose mass reaches top_p (the token crossing it included):
            # every token at least as likely as the last one in that prefix.
            count = (head.cumsum(-1) - head < limit).sum(-1, keepdim=True)
            threshold = head.gather(1, count - 1)
            logits[nucleus] = part.masked_fill(probs < threshold, float("-inf"))
        probs = logits.softmax(-1)
        min_p = column([p.min_p for p in params])
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        return probs / probs.sum(-1, keepdim=True)

    @staticmethod
    def logprobs(raw_logits: torch.Tensor, token: int, top_n: int) -> dict:
        logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
        entry = {"token_id": token, "logprob": float(logprobs[token])}
        if top_n:
            values, ids = torch.topk(logprobs, top_n)
            entry["top"] = [[int(i), float(v)] for i, v in zip(ids, values)]
        return entry
