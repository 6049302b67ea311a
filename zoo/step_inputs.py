"""Laying a scheduled step out as flat per-token and per-sequence lists, then into the static buffers.

Tokens are ragged: a request contributes its committed tokens of this step
(a prefill chunk, or one decode token) followed by its draft tokens. Each
token gets an id, position rows, the cache slot it writes, its sequence, its
index among that sequence's queries and the last cache index it may see; a
draft token also sees exactly its ancestors among the drafts.
"""

from __future__ import annotations

from array import array

import torch

from zoo.scheduler import ScheduledRequest


def int64_tensor(values) -> torch.Tensor:
    """A CPU int64 tensor of Python ints: through ``array`` it is several times faster than ``torch.tensor``."""
    return torch.frombuffer(values if isinstance(values, array) else array("q", values), dtype=torch.int64)


def padded_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """``[len(rows), width]`` int64, each row zero-padded on the right."""
    flat, zeros = array("q"), array("q", bytes(8 * width))
    for row in rows:
        flat.extend(row)
        flat.extend(zeros[:width - len(row)])
    return int64_tensor(flat).view(len(rows), width)


def slots_of_range(block_ids: list[int], block_size: int, start: int, end: int) -> list[int]:
    """Flat cache slots of cache indices ``start .. end - 1``, a block's run at a time (a long prompt's chunk
    is thousands of indices: per index this was a tenth of a millisecond of each prefill step's layout)."""
    slots = []
    for block in range(start // block_size, -(-end // block_size)):
        first = block * block_size
        base = block_ids[block] * block_size - first
        slots.extend(range(base + max(start, first), base + min(end, first + block_size)))
    return slots


def is_decode_token(entry: ScheduledRequest) -> bool:
    """One committed token past any bidirectional prefix, without drafts or prompt logits: the common decode entry,
    attended by the decode path (``StepLayout.decode_rows``)."""
    request = entry.request
    return (entry.num_tokens == 1 and entry.draft is None and entry.start >= request.bidirectional_prefix
            and (entry.start >= len(request.prompt_token_ids) or not request.params.wants_prompt_logits))


def device_lays_out(entry: ScheduledRequest) -> bool:
    """Whether an entry's per-token inputs follow from (its first row, its first cache index, its length) alone:
    no drafts, and no bidirectional prefix among its tokens (a step without position hooks; see StepLayout.runs)."""
    return entry.draft is None and (entry.request.bidirectional_prefix <= 1 or is_decode_token(entry))


def _fill(buffer: torch.Tensor, values: list) -> None:
    if values:
        buffer[:len(values)].copy_(int64_tensor(values), non_blocking=True)


class StepLayout:
    def __init__(self, position_rows: int, block_size: int):
        self.block_size = block_size
        self.input_ids: list[int] = []
        self.positions: list[list[int]] = [[] for _ in range(position_rows)]
        self.slots: list[int] = []
        self.token_seq: list[int] = []
        self.query_index: list[int] = []
        self.logits_indices: list[int] = []
        self.offsets: list[int] = []
        self.logits_rows: list[list[int]] = []
        # per request: logits rows of its prompt positions start, start + 1, ... of this step (only requests that
        # ask for prompt log-probs or logits; the last may also be its sampling row)
        self.prompt_logits_rows: list[list[int]] = []
        self.visible_rows: list[list[int]] = []  # per sequence: the last cache index each of its tokens sees
        self.index_rows: list[list[int]] = []  # per sequence: each token's index in its sequence (drafts: by depth)
        self.context_lens: list[int] = []
        self.draft_starts: list[int] = []
        self.draft_visible: list[tuple[int, int]] = []  # (token row, draft index) pairs a draft token sees
        self.visible_blocks: list[tuple[int, tuple]] = []  # (first row, a tree's (token, ancestor) pairs)
        self.has_drafts = False
        # Every sequence's queries are its whole context so far, causal: attention needs no cache or mask.
        self.fresh_causal = True
        # Without drafts or bidirectional prefixes, attention can split by kind of sequence: one decode token
        # (its row in decode_rows), a whole prompt ((first row, length) in prompt_spans) or a chunk after cached
        # tokens ((sequence, first row, length) in chunk_spans); see zoo.model.MixedStep.
        self.splittable = True
        self.decode_rows: list[int] = []
        self.decode_seqs: list[int] = []  # each decode row's sequence
        self.prompt_spans: list[tuple[int, int]] = []
        self.chunk_spans: list[tuple[int, int, int]] = []
        # Per sequence (first row, first cache index, tokens), where every entry of the step is laid out by
        # add_run: the device derives the per-token inputs from these (write). A long prompt's layout was about
        # a millisecond of Python lists before its step could start (bench/results/gpu/round21).
        self.runs: list[tuple[int, int, int]] | None = None

    def add_decode_token(self, b: int, entry: ScheduledRequest) -> None:
        """The common case at large batch (one committed token, no drafts, default positions), unrolled."""
        request, i = entry.request, entry.start
        self.fresh_causal = self.fresh_causal and i == 0
        self.decode_rows.append(len(self.input_ids))
        self.decode_seqs.append(b)
        self.offsets.append(len(self.input_ids))
        self.logits_rows.append([len(self.logits_indices)] if entry.samples else [])
        self.prompt_logits_rows.append([])
        if entry.samples:
            self.logits_indices.append(len(self.input_ids))
        self.input_ids.append(0 if entry.token_on_device else request.token_at(i))
        self.positions[0].append(i)
        self.slots.append(request.block_ids[i // self.block_size] * self.block_size + i % self.block_size)
        self.token_seq.append(b)
        self.query_index.append(0)
        self.visible_rows.append([i])
        self.index_rows.append([i])
        self.context_lens.append(i + 1)
        self.draft_starts.append(i + 1)

    def add_entry(self, b: int, entry: ScheduledRequest, positions_of) -> None:
        """Any entry: a chunk of committed tokens, then its draft block if it has one."""
        request, draft = entry.request, entry.draft
        self.fresh_causal = (self.fresh_causal and entry.start == 0 and draft is None
                             and request.bidirectional_prefix <= 1)
        first_row, first_draft = len(self.input_ids), entry.start + entry.num_tokens
        if draft is not None or request.bidirectional_prefix > 1:
            self.splittable = False
        elif entry.start == 0:
            self.prompt_spans.append((first_row, entry.num_tokens))
        elif entry.num_tokens == 1:
            self.decode_rows.append(first_row)
            self.decode_seqs.append(b)
        else:
            self.chunk_spans.append((b, first_row, entry.num_tokens))
        self.offsets.append(first_row)
        cache_index = list(range(entry.start, first_draft))
        tokens = request.token_slice(entry.start, first_draft)
        position_index = list(cache_index)
        if draft is not None:
            self.has_drafts = True
            tokens += draft.tokens
            cache_index += range(first_draft, first_draft + len(draft.tokens))
            position_index += [request.num_tokens - 1 + draft.offset(i) for i in range(len(draft.tokens))]
            first_draft_row = first_row + entry.num_tokens
            if draft.sees is None:  # a tree: its shape's pairs, shifted to this block's rows
                self.visible_blocks.append((first_draft_row, draft.shape.visible_pairs))
            else:
                for i in range(len(draft.tokens)):
                    self.draft_visible += [(first_draft_row + i, a) for a in draft.visible(i)]
        for row, values in zip(self.positions, positions_of(request, position_index)):
            row.extend(values)
        self._add_logits_rows(entry, first_row, len(tokens))
        bs = self.block_size
        self.input_ids += tokens
        self.slots += slots_of_range(request.block_ids, bs, entry.start, entry.start + len(tokens))
        self.token_seq += [b] * len(tokens)
        self.query_index += range(len(tokens))
        # Tokens inside a bidirectional prefix (all computed in this step) see up to its end.
        last = request.bidirectional_prefix - 1
        self.visible_rows.append([max(i, last) for i in cache_index] if entry.start <= last else cache_index)
        self.index_rows.append(position_index)
        self.context_lens.append(cache_index[-1] + 1)
        self.draft_starts.append(first_draft if draft is not None else cache_index[-1] + 1)

    def _add_logits_rows(self, entry: ScheduledRequest, first_row: int, num_rows: int) -> None:
        """The entry's rows that give logits: its prompt positions where it asks for prompt logits, and where it
        samples, its last committed token and every draft token."""
        request, first_draft = entry.request, entry.start + entry.num_tokens
        prompt_rows = []
        if request.params.wants_prompt_logits and entry.start < len(request.prompt_token_ids):
            # every prompt position of the chunk but the sampling row's gets a logits row of its own
            last = min(first_draft, len(request.prompt_token_ids)) - (1 if entry.samples else 0)
            prompt_rows = list(range(len(self.logits_indices), len(self.logits_indices) + last - entry.start))
            self.logits_indices += range(first_row, first_row + last - entry.start)
        if entry.samples:
            rows = range(first_row + entry.num_tokens - 1, first_row + num_rows)
            self.logits_rows.append(list(range(len(self.logits_indices), len(self.logits_indices) + len(rows))))
            self.logits_indices += rows
            if request.params.wants_prompt_logits and first_draft == len(request.prompt_token_ids):
                prompt_rows.append(self.logits_rows[-1][0])
        else:
            self.logits_rows.append([])
        self.prompt_logits_rows.append(prompt_rows)

    def add_run(self, b: int, entry: ScheduledRequest) -> None:
        """An entry of a step the device lays out (every entry ``device_lays_out``): its tokens, logits rows and
        kind, and a run of ``self.runs``; the per-token lists stay empty."""
        request, start, n = entry.request, entry.start, entry.num_tokens
        first_row = len(self.input_ids)
        self.fresh_causal = self.fresh_causal and start == 0
        if n == 1 and (start > 0 or is_decode_token(entry)):  # a one-token prompt decodes too (add_decode_token)
            self.decode_rows.append(first_row)
            self.decode_seqs.append(b)
        elif start == 0:
            self.prompt_spans.append((first_row, n))
        else:
            self.chunk_spans.append((b, first_row, n))
        self.offsets.append(first_row)
        self._add_logits_rows(entry, first_row, n)
        self.input_ids += [0] if entry.token_on_device else request.token_slice(start, start + n)
        self.runs.append((first_row, start, n))
        self.context_lens.append(start + n)
        self.draft_starts.append(start + n)

    def pad_entry(self, stride: int, scratch_slot: int) -> None:
        """Dummy tokens after the last entry up to ``stride`` rows (a verify graph's fixed layout).

        They write to the scratch slot and no real token sees them.
        """
        first, used = self.offsets[-1], len(self.input_ids) - self.offsets[-1]
        n = stride - used
        self.fresh_causal = self.splittable = False
        self.input_ids += [0] * n
        for row in self.positions:
            row += [0] * n
        self.slots += [scratch_slot] * n
        self.token_seq += [self.token_seq[first]] * n
        self.query_index += range(used, stride)
        self.visible_rows[-1] = self.visible_rows[-1] + [0] * n
        self.index_rows[-1] = self.index_rows[-1] + [0] * n

    def every_row_gives_logits(self) -> None:
        """A graph step computes logits for all its rows: logits rows become token rows."""
        self.logits_rows = [[self.logits_indices[r] for r in rows] for rows in self.logits_rows]
        self.prompt_logits_rows = [[self.logits_indices[r] for r in rows] for rows in self.prompt_logits_rows]
        self.logits_indices = list(range(len(self.input_ids)))

    def write(self, buffers: dict[str, torch.Tensor], block_ids: list[list[int]], runs_writer=None
              ) -> tuple[int, int]:
        """Copy the lists into the static buffers; returns (longest query, widest block table). A step of runs is
        laid out by ``runs_writer`` (default: :func:`lay_out_runs`)."""
        # non_blocking: a pageable source is staged at the call, and a blocking copy would wait for the GPU to
        # drain, so that an overlapped step's layout would wait for the step before it
        for name, values in (("input_ids", self.input_ids), ("logits_indices", self.logits_indices),
                             ("context_lens", self.context_lens), ("draft_start", self.draft_starts)):
            _fill(buffers[name], values)
        num_blocks = max(len(b) for b in block_ids)
        num_seqs = len(block_ids)
        buffers["block_tables"][:num_seqs, :num_blocks].copy_(padded_rows(block_ids, num_blocks), non_blocking=True)
        if self.runs is not None:
            return self._write_runs(buffers, runs_writer or lay_out_runs), num_blocks
        for name, values in (("slot_mapping", self.slots), ("token_seq", self.token_seq),
                             ("token_query_index", self.query_index),
                             ("token_cache_index", [i for row in self.visible_rows for i in row])):
            _fill(buffers[name], values)
        for r, row in enumerate(self.positions):
            _fill(buffers["positions"][r], row)
        if self.has_drafts:
            visible = buffers["draft_visible"]
            visible[:len(self.input_ids)].zero_()
            rows = [pairs[0] + first for first, pairs in self.visible_blocks]
            columns = [pairs[1] for _, pairs in self.visible_blocks]
            if self.draft_visible:
                pair_rows, pair_columns = zip(*self.draft_visible)
                rows.append(int64_tensor(pair_rows))
                columns.append(int64_tensor(pair_columns))
            visible[torch.cat(rows).to(visible.device, non_blocking=True),
                    torch.cat(columns).to(visible.device, non_blocking=True)] = 1
        max_query = max(len(r) for r in self.visible_rows)
        tables = (("query_cache_index", self.visible_rows),)
        if "query_index_in_sequence" in buffers:  # a sliding window counts by index in the sequence
            tables += (("query_index_in_sequence", self.index_rows),)
        for name, rows in tables:
            buffers[name][:num_seqs, :max_query].copy_(padded_rows(rows, max_query), non_blocking=True)
        return max_query, num_blocks

    def _write_runs(self, buffers: dict[str, torch.Tensor], lay_out) -> int:
        """The per-token inputs of a step of runs, derived on the device by ``lay_out`` (:func:`lay_out_runs` or
        ``fused_ops.lay_out_runs``); returns the longest query."""
        device = buffers["input_ids"].device
        runs = int64_tensor([v for run in self.runs for v in run]).to(device, non_blocking=True).view(-1, 3)
        max_query = max(n for _, _, n in self.runs)
        lay_out(buffers, runs, len(self.input_ids), max_query, self.block_size)
        return max_query


def lay_out_runs(buffers: dict[str, torch.Tensor], runs: torch.Tensor, num_tokens: int, max_query: int,
                 block_size: int) -> None:
    """A step's per-token inputs from its runs (``[sequences, 3]``: first row, first cache index, tokens) in
    PyTorch ops: each token's sequence, index in it and cache index (its position too, and what it sees: its own
    sequence up to itself), its slot from the block table written before, and the zero-padded tables by sequence
    and query index. The same values as the lists of ``StepLayout.add_entry``."""
    device, num_seqs = runs.device, runs.shape[0]
    first_row, start, length = runs.unbind(1)
    seq = torch.arange(num_seqs, device=device).repeat_interleave(length, output_size=num_tokens)
    query_index = torch.arange(num_tokens, device=device) - first_row[seq]
    cache_index = start[seq] + query_index
    buffers["token_seq"][:num_tokens] = seq
    buffers["token_query_index"][:num_tokens] = query_index
    buffers["token_cache_index"][:num_tokens] = cache_index
    buffers["positions"][0, :num_tokens] = cache_index
    buffers["slot_mapping"][:num_tokens] = (buffers["block_tables"][seq, cache_index // block_size] * block_size
                                            + cache_index % block_size)
    index = torch.arange(max_query, device=device)
    by_query = torch.where(index < length[:, None], start[:, None] + index, 0)
    buffers["query_cache_index"][:num_seqs, :max_query] = by_query
    if "query_index_in_sequence" in buffers:
        buffers["query_index_in_sequence"][:num_seqs, :max_query] = by_query
