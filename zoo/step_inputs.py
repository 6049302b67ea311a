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
        self.prompt_spans: list[tuple[int, int]] = []
        self.chunk_spans: list[tuple[int, int, int]] = []

    def add_decode_token(self, b: int, entry: ScheduledRequest) -> None:
        """The common case at large batch (one committed token, no drafts, default positions), unrolled."""
        request, i = entry.request, entry.start
        self.fresh_causal = self.fresh_causal and i == 0
        self.decode_rows.append(len(self.input_ids))
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
        prompt_rows = []
        if request.params.wants_prompt_logits and entry.start < len(request.prompt_token_ids):
            # every prompt position of the chunk but the sampling row's gets a logits row of its own
            last = min(first_draft, len(request.prompt_token_ids)) - (1 if entry.samples else 0)
            prompt_rows = list(range(len(self.logits_indices), len(self.logits_indices) + last - entry.start))
            self.logits_indices += range(first_row, first_row + last - entry.start)
        if entry.samples:  # the last committed token and every draft token give logits
            rows = range(first_row + entry.num_tokens - 1, first_row + len(tokens))
            self.logits_rows.append(list(range(len(self.logits_indices), len(self.logits_indices) + len(rows))))
            self.logits_indices += rows
            if request.params.wants_prompt_logits and first_draft == len(request.prompt_token_ids):
                prompt_rows.append(self.logits_rows[-1][0])
        else:
            self.logits_rows.append([])
        self.prompt_logits_rows.append(prompt_rows)
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

    def write(self, buffers: dict[str, torch.Tensor], block_ids: list[list[int]]) -> tuple[int, int]:
        """Copy the lists into the static buffers; returns (longest query, widest block table)."""
        for name, values in (("input_ids", self.input_ids), ("slot_mapping", self.slots),
                             ("token_seq", self.token_seq), ("token_query_index", self.query_index),
                             ("logits_indices", self.logits_indices), ("context_lens", self.context_lens),
                             ("draft_start", self.draft_starts),
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
        num_blocks = max(len(b) for b in block_ids)
        num_seqs = len(block_ids)
        # non_blocking: a pageable source is staged at the call, and a blocking copy would wait for the GPU to
        # drain, so that an overlapped step's layout would wait for the step before it
        tables = (("block_tables", block_ids, num_blocks), ("query_cache_index", self.visible_rows, max_query))
        if "query_index_in_sequence" in buffers:  # a sliding window counts by index in the sequence
            tables += (("query_index_in_sequence", self.index_rows, max_query),)
        for name, rows, width in tables:
            buffers[name][:num_seqs, :width].copy_(padded_rows(rows, width), non_blocking=True)
        return max_query, num_blocks
