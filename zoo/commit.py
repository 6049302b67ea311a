"""After the forward pass: choose each request's tokens, commit them, and stop requests that are done."""

from __future__ import annotations

import torch

from zoo.decoding import verify
from zoo.request import Request, TokenHistories
from zoo.sampler import Sampler
from zoo.scheduler import ScheduledRequest
from zoo.step import SequenceResult, StepBatch, StepOutput


class Committer:
    def __init__(self, engine):
        self.engine = engine
        self.hooks = engine.hooks
        self.sampler: Sampler = engine.sampler
        self.token_hooks = bool(self.hooks.zoo_token_generated.get_hookimpls())  # skip a per-token no-op call

    def commit_step(self, batch: StepBatch, output: StepOutput,
                    tokens: list[int] | None = None) -> list[SequenceResult]:
        """Sample the plain rows together, verify the drafted ones, and commit every request's tokens.

        ``tokens``: the plain rows' tokens, already chosen (an overlapped step's argmax, copied to the host), for
        a step of plain decodes. A request that finished since the step was launched gets nothing from it.
        """
        if tokens is not None:
            results = [self._advance_decode(entry, offset, token)
                       for entry, offset, token in zip(batch.scheduled, batch.token_offsets, tokens)
                       if not entry.request.is_finished]
            self._drop_outside_windows(batch)
            return results
        beams = self.engine.beam_search
        beam_rows = {i for i, e in enumerate(batch.scheduled) if e.samples and e.draft is None and beams.wants(e.request)}
        plain = [i for i, e in enumerate(batch.scheduled) if e.samples and e.draft is None and i not in beam_rows]
        self._register_filled_blocks(batch, beam_rows)
        chosen = {}
        if plain:
            requests = [batch.scheduled[i].request for i in plain]
            row_ids = [batch.logits_rows[i][0] for i in plain]
            argmax = output.argmax
            if row_ids == list(range(row_ids[0], row_ids[0] + len(row_ids))):
                rows = output.logits[row_ids[0]:row_ids[0] + len(row_ids)]  # a view: no gather (all decode steps)
                argmax = None if argmax is None else argmax[row_ids[0]:row_ids[0] + len(row_ids)]
            else:
                rows, argmax = output.logits[row_ids], None
            chosen = dict(zip(plain, self.sampler.select(rows, requests, TokenHistories(requests), argmax)))
        if any(batch.prompt_logits_rows):
            for entry, rows in zip(batch.scheduled, batch.prompt_logits_rows):
                if rows:
                    self._record_prompt_logits(entry, output.logits, rows)
        self.greedy = self._greedy_draft_rows(batch, output)
        self.moves = ([], [])  # accepted drafts' K/V, (from, to) cache slots: one copy for the whole step
        results = [self._advance(entry, offset, output.logits, rows, chosen.get(i))
                   for i, (entry, offset, rows) in enumerate(zip(batch.scheduled, batch.token_offsets,
                                                                  batch.logits_rows)) if i not in beam_rows]
        self.engine.runner.kv.move_slots(*self.moves)
        self._drop_outside_windows(batch)
        if beam_rows:
            results += beams.commit([(batch.scheduled[i], batch.token_offsets[i], batch.logits_rows[i])
                                     for i in sorted(beam_rows)], output.logits)
        return results

    def _register_filled_blocks(self, batch: StepBatch, beam_rows: set[int]) -> None:
        """The prefix cache's entries for the blocks this step's prompt tokens fill, made before the sampler waits
        for the GPU rather than after: their hashes need only the tokens, and a later step reads their K/V after
        this one wrote it. A 2,040-token prompt's 127 blocks took 0.11 ms on this project's CPU."""
        for i, entry in enumerate(batch.scheduled):
            if entry.num_tokens > 1 and entry.draft is None and i not in beam_rows:
                entry.request.num_computed_tokens = entry.start + entry.num_tokens  # as _advance sets it
                self.engine.blocks.register_full_blocks(entry.request)

    def _drop_outside_windows(self, batch: StepBatch) -> None:
        """Under a sliding window, the blocks no later query can see go back to the pool."""
        description = self.engine.description
        if description.sliding_window:
            for entry in batch.scheduled:
                if not entry.request.is_finished:
                    self.engine.blocks.drop_outside_window(entry.request, description.sliding_window,
                                                           description.attention_sinks)

    def _record_prompt_logits(self, entry: ScheduledRequest, logits: torch.Tensor, rows: list[int]) -> None:
        """The logits at prompt positions ``entry.start ...``: each gives the log-prob of the next prompt token
        (kept by position, so a prompt computed again after preemption writes the same entries)."""
        request, params = entry.request, entry.request.params
        prompt = request.prompt_token_ids
        values = logits[torch.tensor(rows, device=logits.device)].float()
        if params.return_logits:
            if request.context_logits is None:
                request.context_logits = torch.zeros(len(prompt), values.shape[1])
            request.context_logits[entry.start:entry.start + len(rows)] = values.cpu()
        if params.prompt_logprobs is not None:
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None] * len(prompt)
            vocab = values.shape[1]
            for k, row in enumerate(values):
                position = entry.start + k + 1  # the prompt token these logits predict
                if position < len(prompt) and prompt[position] < vocab:  # not a plugin's virtual token
                    request.prompt_logprobs[position] = Sampler.logprobs(row, prompt[position],
                                                                         params.prompt_logprobs)

    def _greedy_draft_rows(self, batch: StepBatch, output: StepOutput) -> dict[int, list[int]]:
        """The argmax of every logits row of each drafted plain-greedy request, in one op and one copy."""
        drafted = [(e.request.request_id, rows) for e, rows in zip(batch.scheduled, batch.logits_rows)
                   if e.samples and e.draft is not None and self.sampler.plain_greedy(e.request)]
        if not drafted:
            return {}
        flat = [r for _, rows in drafted for r in rows]
        picked = torch.tensor(flat, device=output.logits.device)
        tokens = (output.logits[picked].argmax(-1) if output.argmax is None else output.argmax[picked]).tolist()
        greedy, k = {}, 0
        for request_id, rows in drafted:
            greedy[request_id], k = tokens[k:k + len(rows)], k + len(rows)
        return greedy

    def _advance(self, entry: ScheduledRequest, offset: int, logits: torch.Tensor, rows: list[int],
                 token: int | None) -> SequenceResult:
        """Commit what one request got from this step; ``token`` is already chosen unless it drafted."""
        engine, request = self.engine, entry.request
        request.num_computed_tokens = entry.start + entry.num_tokens
        token_rows = list(range(offset, offset + entry.num_tokens))
        if not entry.samples:
            engine.blocks.register_full_blocks(request)
            return SequenceResult(request, [], token_rows, entry.start)
        if entry.draft is None:
            tokens, logits_rows = [token], [rows[0]]
        else:
            greedy = self.greedy.get(request.request_id)
            accepted, token = verify(request, entry.draft, None if greedy else logits[rows], self.sampler,
                                     engine.decoding, greedy)
            engine.stats.record_draft(max(entry.draft.depths), len(accepted))
            tokens = [entry.draft.tokens[i] for i in accepted] + [token]
            logits_rows = [rows[0]] + [rows[1 + i] for i in accepted]
            first = entry.start + entry.num_tokens
            kv = engine.runner.kv
            self.moves[0].extend(kv.slots(request.block_ids, [first + i for i in accepted]))
            self.moves[1].extend(kv.slots(request.block_ids, [first + m for m in range(len(accepted))]))
            request.num_computed_tokens = first + len(accepted)
            token_rows += [offset + entry.num_tokens + i for i in accepted]
        committed = []
        request.num_steps += 1
        engine.stats.token_steps += 1
        stop_ids = self.sampler.stop_ids(request)
        for token, row in zip(tokens, logits_rows):
            self._commit(request, token, logits, row, stop_ids)
            committed.append(token)
            if request.is_finished:
                break
        # A draft token kept after a stop was never part of the output: forget its K/V too.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        token_rows = token_rows[:len(token_rows) - (len(tokens) - len(committed))]
        if not request.is_finished:
            engine.blocks.trim(request, request.num_tokens)
        engine.blocks.register_full_blocks(request)  # a finished request's blocks stay cached once freed
        if request.is_finished:
            engine.finish(request)
        if entry.draft is None:
            return SequenceResult(request, committed, token_rows, entry.start)
        return SequenceResult(request, committed, token_rows, entry.start, entry.draft, rows[1:])

    def _advance_decode(self, entry: ScheduledRequest, offset: int, token: int) -> SequenceResult:
        """:meth:`_advance` for a request of an overlapped step: one decode token whose next token is chosen.
        Such a step has no drafts, log-probs or logits to keep (``Engine._overlappable``), so this is that
        method's common case unrolled: at batch 64 and more, commits were a third of a serving engine's host
        time per step (bench/engine_loop_host.py)."""
        engine, request = self.engine, entry.request
        request.num_computed_tokens = entry.start + 1
        request.num_steps += 1
        engine.stats.token_steps += 1
        self._commit(request, token, None, 0, self.sampler.stop_ids(request))
        if not request.is_finished:
            engine.blocks.trim(request, request.num_tokens)
        engine.blocks.register_full_blocks(request)
        if request.is_finished:
            engine.finish(request)
        return SequenceResult(request, [token], [offset], entry.start)

    def _commit(self, request: Request, token: int, logits: torch.Tensor | None, row: int,
                stop_ids: set[int]) -> None:
        stats = self.engine.stats
        request.output_token_ids.append(token)
        stats.generated_tokens += 1
        stats.record_first_token(request)
        if request.params.logprobs is not None:
            request.output_logprobs.append(Sampler.logprobs(logits[row], token, request.params.logprobs))
        if request.params.return_logits:
            request.generation_logits.append(logits[row].float().cpu())
        params = request.params
        generated = len(request.output_token_ids)
        if token in stop_ids and generated >= params.min_new_tokens:
            request.finish("stop")
        elif self.token_hooks and any(self.hooks.zoo_token_generated(request=request, token_id=token)):
            request.finish("stop")
        elif params.stop_token_sequences and any(
                request.output_token_ids[-len(seq):] == list(seq) for seq in params.stop_token_sequences):
            request.finish("stop")
        elif params.stop and self._cut_at_stop_string(request):
            request.finish("stop")
        elif generated >= params.max_new_tokens or request.num_tokens >= self.engine.max_model_len:
            request.finish("length")

    def _cut_at_stop_string(self, request: Request) -> bool:
        text = stop_string_cut(self.engine.tokenizer, request.output_token_ids, request.params.stop)
        if text is None:
            return False
        request.output_text = text
        return True


# Characters at the start of a window of tokens that may decode differently from the same place in the whole
# output (a dropped leading space, the rest of a character cut in two, a continuation marker).
WINDOW_START_SLACK = 8


def stop_string_cut(tokenizer, ids: list[int], stops) -> str | None:
    """The text of ``ids`` cut before its first stop string, or None when it holds none.

    Called after each new token of an output that held none before, so a new stop string ends in the newest
    token's text. A window of the last tokens is decoded first, doubling until its text before the newest
    token is longer than any stop string (plus the slack of a window's start): only when that window holds a
    stop string is the whole output decoded. Decoding the whole output at every token made a request with
    stop strings quadratic in its length."""
    need = max(len(stop) for stop in stops) + WINDOW_START_SLACK + len(tokenizer.decode(ids[-1:]))
    width = 8
    while width < len(ids):
        window = tokenizer.decode(ids[-width:])
        if len(window) >= need:
            if not any(stop in window for stop in stops):
                return None
            break
        width *= 2
    text = tokenizer.decode(ids)
    hits = [text.find(stop) for stop in stops if stop in text]
    return text[:min(hits)] if hits else None
