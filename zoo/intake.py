"""A request's way into the engine: fields, tokens, prompt transform, checks, admission.

Every step may reject the request; a rejected request comes back finished
with ``finish_reason: error`` and its message, ``zoo_request_finished`` runs
for it like for any other, and the rest of the batch never sees it.
"""

from __future__ import annotations

import time

from zoo.errors import RequestError, ZooError
from zoo.request import Request
from zoo.sampling_params import SamplingParams


class RequestIntake:
    def __init__(self, engine):
        self.engine = engine
        self.hooks = engine.hooks
        self.fields = {f for fields in self.hooks.zoo_request_fields() for f in fields or []}
        # Fields only plugins that sit this run out read: worth naming in the error.
        self.inactive_readers = {f: status for status in engine.plugins if not status.active
                                 for f in status.request_fields}
        self.next_id = 0  # sequences: every sample of n and every beam is a request of its own
        self.requests = 0  # the callers' requests, refused ones included

    def _new(self, params: SamplingParams, **kwargs) -> Request:
        request = Request(self.next_id, [], params, **kwargs)
        self.next_id += 1
        return request

    def reject(self, message: str, output_id=None, request: Request | None = None) -> Request:
        """Finish ``request`` (or a new empty one) with an error; plugins hear of it."""
        if request is None:  # refused before it became a request
            self.requests += 1
            request = self._new(SamplingParams(), output_id=output_id)
        request.finish("error", message)
        self.hooks.zoo_request_finished(request=request)
        return request

    def add(self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams,
            extras: dict, source_dir=None) -> Request:
        """The request, queued; with ``params.n`` > 1 the first of its samples, which lists them all. The
        others go through every check and hook as requests of their own, but wait until the first has computed
        the prompt: they then take its blocks from the prefix cache instead of computing them again."""
        self.requests += 1
        request = self._add_one(prompt, prompt_token_ids, params, extras, source_dir, queue=True)
        if params.n == 1 or request.is_finished:
            return request
        request.samples = [request]
        for index in range(1, params.n):
            sample = self._add_one(prompt, prompt_token_ids, params, extras, source_dir, queue=False)
            sample.first_sample, sample.sample_index = request, index
            request.samples.append(sample)
            if not sample.is_finished:
                self.engine.held_samples.setdefault(request.request_id, []).append(sample)
        return request

    def admit_copy(self, request: Request) -> Request:
        """Another request for ``request``'s prompt, through every check and hook, not queued (a beam)."""
        copy = self._add_one(request.prompt, request.input_token_ids, request.params, request.extras,
                             request.source_dir, queue=False)
        if copy.is_finished:
            raise RuntimeError(f"a copy of request {request.request_id} was refused ({copy.error}); this is a bug")
        return copy

    def release_samples(self, request: Request) -> None:
        """Queue the samples held for ``request``, once its prompt's blocks are computed (or it ended)."""
        for sample in self.engine.held_samples.pop(request.request_id, []):
            sample.arrival_time = time.perf_counter()
            self.engine.scheduler.add(sample)

    def _add_one(self, prompt, prompt_token_ids, params, extras, source_dir, queue: bool) -> Request:
        request = self._new(params, prompt=prompt, extras=dict(extras), source_dir=source_dir)
        try:
            self._check_fields(request)
            request.input_token_ids = self._tokens(prompt, prompt_token_ids)
            request.prompt_token_ids = list(request.input_token_ids)
            self.engine.adapters.check(request)
            self.hooks.zoo_prompt_transform(request=request, description=self.engine.description)
            self._check(request)
            self._admit(request)
        except ZooError as exc:
            return self.reject(str(exc), request=request)
        if request.is_finished:  # a plugin rejected it while admitting
            self.hooks.zoo_request_finished(request=request)
            return request
        request.arrival_time = time.perf_counter()
        self.engine.stats.prompt_tokens += len(request.prompt_token_ids)
        if queue:
            self.engine.scheduler.add(request)
        return request

    def _check_fields(self, request: Request) -> None:
        unknown = sorted(set(request.extras) - self.fields)
        if unknown:
            known = sorted(self.fields)
            why = [f"{f} is read by plugin {s.name}, which does not take part in this run ({s.reason})"
                   for f, s in ((f, self.inactive_readers.get(f)) for f in unknown) if s is not None]
            raise RequestError(f"unknown request field(s): {', '.join(unknown)}"
                               + (f" (plugins read: {', '.join(known)})" if known else "")
                               + (f"; {'; '.join(why)}" if why else ""))

    def _tokens(self, prompt, prompt_token_ids) -> list[int]:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise RequestError("a request needs `prompt` (text) or `prompt_ids` (list of token ids)")
            prompt_token_ids = self.engine.tokenizer.encode(prompt)
        # the set of types first: one C-level pass for the usual list of plain ints (a long prompt's per-token
        # isinstance calls were most of its intake)
        if not isinstance(prompt_token_ids, (list, tuple)) or not (set(map(type, prompt_token_ids)) <= {int} or all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids)):
            raise RequestError("prompt_ids must be a list of integers")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        return list(prompt_token_ids)

    def _check(self, request: Request) -> None:
        engine, prompt = self.engine, request.prompt_token_ids
        vocab = engine.description.vocab_size
        table = self.hooks.zoo_request_table_size(request=request) or 0
        if prompt and (min(prompt) < 0 or max(prompt) >= vocab + table):
            bad = [t for t in prompt if not 0 <= t < vocab + table]
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})"
                               + (f" and the request's prompt table [{vocab}, {vocab + table})" if table else ""))
        if len(prompt) >= engine.max_model_len:
            added = len(prompt) - len(request.input_token_ids)
            raise RequestError(f"the prompt has {len(prompt)} tokens" + (f" ({added} added by plugins)" if added else "")
                               + f"; the model's limit is {engine.max_model_len} tokens including at least one "
                               "generated")
        request.params.validate(vocab)
        width = request.params.beam_width
        needed = engine.blocks.blocks_needed(min(len(prompt) + request.params.max_new_tokens, engine.max_model_len))
        window = engine.description.sliding_window
        if window:  # blocks outside the window go back as it moves: the sinks, the window and one step's chunk
            bs = engine.block_size
            needed = min(needed, -(-engine.description.attention_sinks // bs)
                         + -(-(window + engine.scheduler.max_num_batched_tokens) // bs) + 1)
        if needed * width > engine.num_blocks:
            raise RequestError(f"the request needs {needed * width} KV blocks of {engine.block_size} tokens"
                               + (f" ({width} beams of {needed})" if width > 1 else "")
                               + f", the cache has {engine.num_blocks}; raise runtime.num_kv_blocks or lower "
                               "max_new_tokens")
        if width > engine.scheduler.max_num_seqs:
            raise RequestError(f"beam_width={width} is more beams than runtime.max_num_seqs="
                               f"{engine.scheduler.max_num_seqs} sequences can run")
        request.seats = width
        if width > 1 and engine.decoding is not None:
            raise RequestError(f"beam_width={width} (beam search) does not combine with decoding="
                               f"{engine.decoding.name}")
        errors = [e for e in self.hooks.zoo_request_validate(request=request, description=engine.description) if e]
        if errors:
            raise RequestError("; ".join(errors))

    def _admit(self, request: Request) -> None:
        prefix = self.hooks.zoo_request_bidirectional_prefix(request=request) or 0
        budget = self.engine.scheduler.max_num_batched_tokens
        if prefix > budget:
            raise RequestError(f"the prompt's bidirectional context has {prefix} tokens, more than one step "
                               f"computes (runtime.max_num_batched_tokens={budget}); raise it")
        request.bidirectional_prefix = prefix
        parts = [p for p in self.hooks.zoo_request_cache_key(request=request) + [self.engine.adapters.cache_key(request)]
                 if p is not None]
        if prefix:
            parts.append(("bidirectional", tuple(request.prompt_token_ids[:prefix])))
        request.cache_key = tuple(sorted(parts, key=repr))
        self.hooks.zoo_request_admit(request=request, engine=self.engine)
