"""Turns a scheduled step into tensors and runs the model.

Every per-step input lives in a buffer allocated once at its largest size
(core buffers and those plugins declare); a step writes the first rows of
each and hands the model views of them. Nothing on the device is allocated
per step, which is what lets decode steps replay as CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoo.description import ModelDescription
from zoo.model import AttentionMetadata, DecoderModel
from zoo.request import Request
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest


@dataclass(frozen=True)
class RunnerLimits:
    max_num_tokens: int  # query tokens per step
    max_model_len: int  # positions per sequence
    max_num_seqs: int
    max_blocks_per_seq: int
    block_size: int
    max_draft_tokens: int


@dataclass(frozen=True)
class BufferSpec:
    """A per-step tensor: ``shape`` is its largest size; dim ``step_dim`` is cut to the step."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.int64
    step_dim: int = 0  # which dimension follows the step's token (or sequence) count
    per: str = "token"  # "token" | "seq": what that dimension counts
    fill: float = 0


@dataclass
class StepBatch:
    """What one forward pass computes, as the plugins see it."""

    scheduled: list[ScheduledRequest]
    num_tokens: int
    token_offsets: list[int]  # first query token of each scheduled request
    logits_rows: list[list[int]] = field(default_factory=list)  # per request: token rows with logits


@dataclass
class StepOutput:
    logits: torch.Tensor  # [rows, vocab] float32, rows in StepBatch.logits_rows order
    extras: dict


class ModelRunner:
    def __init__(self, model: DecoderModel, description: ModelDescription, limits: RunnerLimits,
                 dtype: torch.dtype, device: torch.device, hooks):
        self.model = model
        self.description = description
        self.limits = limits
        self.device = device
        self.hooks = hooks
        self.block_size = limits.block_size
        t, s, d = limits.max_num_tokens, limits.max_num_seqs, limits.max_draft_tokens
        core = [
            BufferSpec("input_ids", (t,)),
            BufferSpec("positions", (description.position_rows, t), step_dim=1),
            BufferSpec("slot_mapping", (t,)),
            BufferSpec("token_seq", (t,)),
            BufferSpec("token_query_index", (t,)),
            BufferSpec("logits_indices", (t,)),
            BufferSpec("block_tables", (s, limits.max_blocks_per_seq), per="seq"),
            BufferSpec("query_cache_index", (s, t), per="seq"),
            BufferSpec("context_lens", (s,), per="seq"),
            BufferSpec("draft_start", (s,), per="seq"),
            BufferSpec("draft_ancestors", (s, max(d, 1), max(d, 1)), dtype=torch.bool, per="seq"),
        ]
        self.core_names = {spec.name for spec in core}
        specs = core + [spec for specs in hooks.zoo_buffers_declare(description=description, limits=limits)
                        for spec in specs or []]
        self.specs = {}
        for spec in specs:
            if spec.name in self.specs:
                raise ValueError(f"buffer {spec.name!r} is declared twice")
            self.specs[spec.name] = spec
        self.buffers = {spec.name: torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=device)
                        for spec in specs}
        self.dtype = dtype
        self.kv_cache: torch.Tensor | None = None

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_cache = None  # let the old cache go before the new one is made
        desc = self.description
        self.kv_cache = torch.zeros(desc.num_layers, 2, num_blocks, self.block_size, desc.num_kv_heads,
                                    desc.head_dim, dtype=self.dtype, device=self.device)
        for i, attention in enumerate(self.model.attention_layers()):
            attention.kv_cache = self.kv_cache[i]

    def run_full_step(self) -> None:
        """One forward pass as big as the limits allow: the most tokens, split over dummy requests."""
        limits = self.limits
        longest = min(limits.max_num_tokens, limits.max_model_len)
        lengths = [longest] * (limits.max_num_tokens // longest)
        if limits.max_num_tokens % longest:
            lengths.append(limits.max_num_tokens % longest)
        lengths = lengths[:limits.max_num_seqs]
        blocks_per_seq = -(-longest // self.block_size)
        self.allocate_kv_cache(len(lengths) * blocks_per_seq)
        scheduled = []
        for i, length in enumerate(lengths):
            dummy = Request(-1 - i, [0] * length, SamplingParams(max_new_tokens=1))
            dummy.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            scheduled.append(ScheduledRequest(dummy, 0, length))
        self.run(self.prepare(scheduled))

    def profile_peak_memory(self) -> int:
        """Peak CUDA bytes of the largest step (weights included), before the KV cache exists."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_full_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_cache = None
        for attention in self.model.attention_layers():
            attention.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    @staticmethod
    def kv_bytes_per_block(description: ModelDescription, block_size: int, dtype: torch.dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * description.num_layers * block_size * description.num_kv_heads * description.head_dim * itemsize

    # ------------------------------------------------------------------ inputs

    def _positions(self, request, indices: list[int]) -> list[list[int]]:
        rows = self.hooks.zoo_step_positions(request=request, indices=indices, description=self.description)
        return rows if rows is not None else [list(indices)]

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        input_ids, slots, token_seq, query_index, logits_indices = [], [], [], [], []
        positions: list[list[int]] = [[] for _ in range(self.description.position_rows)]
        offsets, logits_rows, cache_index_rows, context_lens, draft_starts = [], [], [], [], []
        tree_rows = []
        bs = self.block_size
        for b, entry in enumerate(scheduled):
            request, draft = entry.request, entry.draft
            offsets.append(len(input_ids))
            committed = list(range(entry.start, entry.start + entry.num_tokens))
            tokens = request.token_ids[entry.start:entry.start + entry.num_tokens]
            cache_index = list(committed)
            position_index = list(committed)
            if draft is not None:
                tokens += draft.tokens
                first = entry.start + entry.num_tokens
                cache_index += range(first, first + len(draft.tokens))
                position_index += [request.num_tokens - 1 + draft.depth(i) for i in range(len(draft.tokens))]
                tree_rows.append((b, draft))
            for row, values in zip(positions, self._positions(request, position_index)):
                row.extend(values)
            rows = []
            if entry.samples:
                rows.append(len(input_ids) + entry.num_tokens - 1)
                rows += range(len(input_ids) + entry.num_tokens, len(input_ids) + len(tokens))
            logits_rows.append(list(range(len(logits_indices), len(logits_indices) + len(rows))))
            logits_indices += rows
            input_ids += tokens
            slots += [request.block_ids[i // bs] * bs + i % bs for i in cache_index]
            token_seq += [b] * len(tokens)
            query_index += range(len(tokens))
            cache_index_rows.append(cache_index)
            context_lens.append(cache_index[-1] + 1)
            draft_starts.append(entry.start + entry.num_tokens if draft is not None else cache_index[-1] + 1)

        num_tokens, num_seqs = len(input_ids), len(scheduled)
        max_query = max(len(r) for r in cache_index_rows)
        num_blocks = max(len(e.request.block_ids) for e in scheduled)
        buf = self.buffers
        self._fill(buf["input_ids"], input_ids)
        for r, row in enumerate(positions):
            self._fill(buf["positions"][r], row)
        self._fill(buf["slot_mapping"], slots)
        self._fill(buf["token_seq"], token_seq)
        self._fill(buf["token_query_index"], query_index)
        self._fill(buf["logits_indices"], logits_indices)
        self._fill(buf["context_lens"], context_lens)
        self._fill(buf["draft_start"], draft_starts)
        table = torch.tensor([e.request.block_ids + [0] * (num_blocks - len(e.request.block_ids))
                              for e in scheduled], dtype=torch.int64)
        cache_rows = torch.tensor([r + [0] * (max_query - len(r)) for r in cache_index_rows], dtype=torch.int64)
        buf["block_tables"][:num_seqs, :num_blocks].copy_(table)
        buf["query_cache_index"][:num_seqs, :max_query].copy_(cache_rows)
        if tree_rows:
            ancestors = buf["draft_ancestors"]
            ancestors[:num_seqs].zero_()
            for b, draft in tree_rows:
                for i in range(len(draft.tokens)):
                    ancestors[b, i, draft.ancestors(i)] = True

        batch = StepBatch(scheduled, num_tokens, offsets, logits_rows)
        self.step_sizes = {"token": num_tokens, "seq": num_seqs}
        self.step_meta = self._attention_metadata(num_tokens, num_seqs, max_query, num_blocks, bool(tree_rows))
        self.hooks.zoo_step_prepare(batch=batch, buffers=self.step_buffers())
        return batch

    def _fill(self, buffer: torch.Tensor, values: list) -> None:
        if values:
            buffer[:len(values)].copy_(torch.tensor(values, dtype=buffer.dtype), non_blocking=True)

    def step_buffers(self) -> dict[str, torch.Tensor]:
        views = {}
        for name, spec in self.specs.items():
            views[name] = self.buffers[name].narrow(spec.step_dim, 0, self.step_sizes[spec.per])
        return views

    def _attention_metadata(self, num_tokens, num_seqs, max_query, num_blocks, has_tree) -> AttentionMetadata:
        buf = self.buffers
        length = num_blocks * self.block_size
        key_index = torch.arange(length, device=self.device)
        query_cache_index = buf["query_cache_index"][:num_seqs, :max_query]
        context_lens = buf["context_lens"][:num_seqs]
        mask = (key_index <= query_cache_index[:, :, None]) & (key_index < context_lens[:, None, None])
        window = self.description.sliding_window
        if window:
            mask &= key_index > query_cache_index[:, :, None] - window
        if has_tree:
            # Inside a draft tree a token sees its ancestors only, not every earlier draft.
            draft_start = buf["draft_start"][:num_seqs]
            ancestors = buf["draft_ancestors"][:num_seqs]
            max_draft = ancestors.shape[-1]
            key_draft = key_index[None, :] - draft_start[:, None]  # [B, L]
            query_draft = query_cache_index - draft_start[:, None]  # [B, Q]
            seq = torch.arange(num_seqs, device=self.device)[:, None, None]
            tree = ancestors[seq, query_draft.clamp(0, max_draft - 1)[:, :, None],
                             key_draft.clamp(0, max_draft - 1)[:, None, :]]
            in_tree = (key_draft >= 0)[:, None, :] & (query_draft >= 0)[:, :, None]
            mask &= ~in_tree | tree
        return AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:num_tokens],
            block_tables=buf["block_tables"][:num_seqs, :num_blocks],
            token_seq=buf["token_seq"][:num_tokens],
            token_query_index=buf["token_query_index"][:num_tokens],
            mask=mask[:, None],
            max_query_len=max_query,
        )

    # ------------------------------------------------------------------ run

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepOutput:
        n = batch.num_tokens
        buffers = self.step_buffers()
        hidden = self.model(self.buffers["input_ids"][:n], self.buffers["positions"][:, :n],
                            self.step_meta, batch=batch, buffers=buffers)
        extras = {}
        for result in self.hooks.zoo_output_collect(hidden=hidden, batch=batch, buffers=buffers):
            extras.update(result or {})
        rows = sum(len(r) for r in batch.logits_rows)
        logits = self.model.compute_logits(hidden[self.buffers["logits_indices"][:rows]])
        return StepOutput(logits=logits, extras=extras)

    def move_cache_entries(self, request, sources: list[int], targets: list[int]) -> None:
        """Copy K/V of cache indices ``sources`` to ``targets`` (compacting accepted drafts)."""
        if not sources:
            return
        bs = self.block_size

        def slots(indices):
            return torch.tensor([request.block_ids[i // bs] * bs + i % bs for i in indices], device=self.device)

        flat = self.kv_cache.view(self.kv_cache.shape[0], 2, -1, *self.kv_cache.shape[-2:])
        flat[:, :, slots(targets)] = flat[:, :, slots(sources)]
