"""Turns a scheduled step into tensors and runs the model.

Every per-step input lives in a buffer allocated once at its largest size
(core buffers and those plugins declare); a step writes the first rows of
each and hands the model views of them. On CUDA, plain decode steps replay a
CUDA graph captured once per padded batch size over those same buffers, so
any plugin that fills its declared buffers runs under graphs unchanged.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch

from zoo.description import ModelDescription
from zoo.model import AttentionMetadata, DecoderModel
from zoo.request import Request
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest
from zoo import triton_attention


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


class ModelRunner:
    def __init__(self, model: DecoderModel, description: ModelDescription, limits: RunnerLimits,
                 dtype: torch.dtype, device: torch.device, hooks, attention_backend: str = "auto"):
        self.model = model
        self.description = description
        self.limits = limits
        self.device = device
        self.hooks = hooks
        self.dtype = dtype
        self.block_size = limits.block_size
        t, s = limits.max_num_tokens, limits.max_num_seqs
        core = [
            BufferSpec("input_ids", (t,)),
            BufferSpec("positions", (description.position_rows, t), step_dim=1),
            BufferSpec("slot_mapping", (t,)),
            BufferSpec("token_seq", (t,)),
            BufferSpec("token_query_index", (t,)),
            BufferSpec("token_cache_index", (t,)),
            BufferSpec("tree_bits", (t,), fill=-1),
            BufferSpec("logits_indices", (t,)),
            BufferSpec("block_tables", (s, limits.max_blocks_per_seq), per="seq"),
            BufferSpec("query_cache_index", (s, t), per="seq"),
            BufferSpec("context_lens", (s,), per="seq"),
            BufferSpec("draft_start", (s,), per="seq"),
        ]
        specs = core + [spec for specs in hooks.zoo_buffers_declare(description=description, limits=limits)
                        for spec in specs or []]
        self.specs = {}
        for spec in specs:
            if spec.name in self.specs:
                raise ValueError(f"buffer {spec.name!r} is declared twice")
            self.specs[spec.name] = spec
        self.buffers = {spec.name: torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=device)
                        for spec in specs}
        self.kv_cache: torch.Tensor | None = None
        self.scratch_block = 0  # a cache block no request owns: padded graph rows write there
        self.graphs: dict[int, tuple] = {}
        self.decode_kernel = self._decode_kernel_usable(attention_backend)
        self.position_hooks = bool(hooks.zoo_step_positions.get_hookimpls())

    def _decode_kernel_usable(self, backend: str) -> bool:
        if backend == "sdpa":
            return False
        desc = self.description
        shape_ok = (self.block_size >= 16 and self.block_size & (self.block_size - 1) == 0
                    and desc.head_dim >= 16 and desc.head_dim & (desc.head_dim - 1) == 0
                    and not desc.sliding_window)
        usable = self.device.type == "cuda" and triton_attention.available() and shape_ok
        if backend == "triton" and not usable:
            raise ValueError("runtime.attention_backend=triton needs CUDA, triton, a power-of-two block_size >= 16, "
                             "a power-of-two head_dim >= 16 and no sliding window")
        return usable

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Blocks ``0..num_blocks-1`` for requests, plus one scratch block after them."""
        self.kv_cache = None  # let the old cache go before the new one is made
        self.graphs = {}
        desc = self.description
        self.kv_cache = torch.zeros(desc.num_layers, 2, num_blocks + 1, self.block_size, desc.num_kv_heads,
                                    desc.head_dim, dtype=self.dtype, device=self.device)
        self.scratch_block = num_blocks
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
        rows = None
        # Most requests take the default: once no plugin answered for a request, it is not asked again.
        if self.position_hooks and request.plugin_positions is not False:
            rows = self.hooks.zoo_step_positions(request=request, indices=indices, description=self.description)
            request.plugin_positions = rows is not None
        return rows if rows is not None else [list(indices)]

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        input_ids, slots, token_seq, query_index, logits_indices = [], [], [], [], []
        positions: list[list[int]] = [[] for _ in range(self.description.position_rows)]
        offsets, logits_rows, visible_rows, context_lens, draft_starts = [], [], [], [], []
        tree_bits: list[int] = []
        bs = self.block_size
        for b, entry in enumerate(scheduled):
            request, draft = entry.request, entry.draft
            offsets.append(len(input_ids))
            if (entry.num_tokens == 1 and draft is None and entry.start >= request.bidirectional_prefix
                    and (request.plugin_positions is False or not self.position_hooks)):
                # A plain decode token, the common case at large batch: the general path below, unrolled.
                i = entry.start
                logits_rows.append([len(logits_indices)] if entry.samples else [])
                if entry.samples:
                    logits_indices.append(len(input_ids))
                input_ids.append(request.token_at(i))
                positions[0].append(i)
                tree_bits.append(-1)
                slots.append(request.block_ids[i // bs] * bs + i % bs)
                token_seq.append(b)
                query_index.append(0)
                visible_rows.append([i])
                context_lens.append(i + 1)
                draft_starts.append(i + 1)
                continue
            committed = list(range(entry.start, entry.start + entry.num_tokens))
            tokens = request.token_slice(entry.start, entry.start + entry.num_tokens)
            cache_index = list(committed)
            position_index = list(committed)
            tree_bits += [-1] * len(committed)  # -1: every bit set, committed tokens see all drafts before them
            if draft is not None:
                tokens += draft.tokens
                first = entry.start + entry.num_tokens
                cache_index += range(first, first + len(draft.tokens))
                position_index += [request.num_tokens - 1 + draft.depth(i) for i in range(len(draft.tokens))]
                # Inside a draft tree a token sees its ancestors only, not every earlier draft.
                tree_bits += [sum(1 << a for a in draft.ancestors(i)) for i in range(len(draft.tokens))]
            for row, values in zip(positions, self._positions(request, position_index)):
                row.extend(values)
            # What each token sees: cache entries up to its own index, or to the end of the
            # bidirectional prefix for tokens inside it (all of which this step computes).
            visible_until = cache_index
            if entry.start < request.bidirectional_prefix:
                last = request.bidirectional_prefix - 1
                visible_until = [max(i, last) for i in cache_index]
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
            visible_rows.append(visible_until)
            context_lens.append(cache_index[-1] + 1)
            draft_starts.append(entry.start + entry.num_tokens if draft is not None else cache_index[-1] + 1)

        num_tokens, num_seqs = len(input_ids), len(scheduled)
        max_query = max(len(r) for r in visible_rows)
        num_blocks = max(len(e.request.block_ids) for e in scheduled)
        buf = self.buffers
        self._fill(buf["input_ids"], input_ids)
        for r, row in enumerate(positions):
            self._fill(buf["positions"][r], row)
        self._fill(buf["slot_mapping"], slots)
        self._fill(buf["token_seq"], token_seq)
        self._fill(buf["token_query_index"], query_index)
        self._fill(buf["token_cache_index"], [i for row in visible_rows for i in row])
        self._fill(buf["tree_bits"], tree_bits)
        self._fill(buf["logits_indices"], logits_indices)
        self._fill(buf["context_lens"], context_lens)
        self._fill(buf["draft_start"], draft_starts)
        buf["block_tables"][:num_seqs, :num_blocks].copy_(
            padded_rows([e.request.block_ids for e in scheduled], num_blocks))
        buf["query_cache_index"][:num_seqs, :max_query].copy_(padded_rows(visible_rows, max_query))

        has_tree = any(e.draft is not None for e in scheduled)
        batch = StepBatch(scheduled, num_tokens, offsets, logits_rows)
        self.step_sizes = {"token": num_tokens, "seq": num_seqs}
        self.step_graph = self._graph_for(scheduled)
        if self.step_graph is None:
            use_kernel = self.decode_kernel and max_query <= 1 + self.limits.max_draft_tokens
            self.step_meta = self._attention_metadata(num_tokens, num_seqs, max_query, num_blocks, has_tree,
                                                      use_kernel)
        else:
            self._pad_graph_rows(num_seqs, self.step_graph)
        self.hooks.zoo_step_prepare(batch=batch, buffers=self.step_buffers())
        return batch

    def _fill(self, buffer: torch.Tensor, values: list) -> None:
        if values:
            buffer[:len(values)].copy_(int64_tensor(values), non_blocking=True)

    def step_buffers(self) -> dict[str, torch.Tensor]:
        views = {}
        for name, spec in self.specs.items():
            views[name] = self.buffers[name].narrow(spec.step_dim, 0, self.step_sizes[spec.per])
        return views

    def _attention_metadata(self, num_tokens, num_seqs, max_query, num_blocks, has_tree,
                            use_kernel) -> AttentionMetadata:
        buf = self.buffers
        mask = None
        if not use_kernel:
            key_index = torch.arange(num_blocks * self.block_size, device=self.device)
            query_cache_index = buf["query_cache_index"][:num_seqs, :max_query]
            mask = (key_index <= query_cache_index[:, :, None]) & (key_index < buf["context_lens"][:num_seqs, None, None])
            window = self.description.sliding_window
            if window:
                mask &= key_index > query_cache_index[:, :, None] - window
            if has_tree:
                bits = torch.full((num_seqs, max_query), -1, dtype=torch.int64, device=self.device)
                bits[buf["token_seq"][:num_tokens], buf["token_query_index"][:num_tokens]] = buf["tree_bits"][:num_tokens]
                offset = key_index[None, :] - buf["draft_start"][:num_seqs, None]  # [B, L]
                allowed = (bits[:, :, None] >> offset.clamp(0, 63)[:, None, :]) & 1 == 1
                mask &= (offset < 0)[:, None, :] | allowed
            mask = mask[:, None]
        return AttentionMetadata(
            slot_mapping=buf["slot_mapping"][:num_tokens],
            block_tables=buf["block_tables"][:num_seqs, :num_blocks],
            token_seq=buf["token_seq"][:num_tokens],
            token_query_index=buf["token_query_index"][:num_tokens],
            mask=mask,
            max_query_len=max_query,
            token_cache_index=buf["token_cache_index"][:num_tokens],
            context_lens=buf["context_lens"][:num_seqs],
            draft_start=buf["draft_start"][:num_seqs],
            tree_bits=buf["tree_bits"][:num_tokens],
            has_tree=has_tree,
            use_decode_kernel=use_kernel,
        )

    # ------------------------------------------------------------------ CUDA graphs

    def graph_batch_sizes(self) -> list[int]:
        limit = self.limits.max_num_seqs
        sizes = [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]
        return sorted(set(sizes))

    def capture_cuda_graphs(self) -> None:
        """Capture one decode graph per padded batch size, largest first, sharing one memory pool."""
        if not self.decode_kernel:
            raise ValueError("CUDA graphs need the Triton decode kernel (see runtime.attention_backend)")
        pool = None
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.graph_batch_sizes()):
            self._pad_graph_rows(0, size)
            self.step_sizes = {"token": size, "seq": size}
            buffers = self.step_buffers()
            meta = self._attention_metadata(size, size, 1, self.limits.max_blocks_per_seq, False, True)
            meta.block_tables = self.buffers["block_tables"][:size]  # full width: any context length fits
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream), torch.inference_mode():
                self._graph_body(size, meta, buffers)  # warm-up: compiles kernels, fills caches
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=stream):
                logits, extras = self._graph_body(size, meta, buffers)
            pool = graph.pool()
            self.graphs[size] = (graph, logits, extras)
        torch.cuda.synchronize(self.device)

    def _graph_for(self, scheduled) -> int | None:
        """The captured batch size a step can replay, or None to run eagerly."""
        if not self.graphs or any(e.num_tokens != 1 or e.draft is not None or not e.samples for e in scheduled):
            return None
        return next((size for size in sorted(self.graphs) if size >= len(scheduled)), None)

    def _pad_graph_rows(self, real: int, size: int) -> None:
        """Rows ``real..size-1`` become harmless dummies: one token writing to the scratch block."""
        if real == size:
            return
        buf, pad = self.buffers, slice(real, size)
        buf["input_ids"][pad] = 0
        buf["positions"][:, pad] = 0
        buf["slot_mapping"][pad] = self.scratch_block * self.block_size
        buf["token_seq"][pad] = torch.arange(real, size, device=self.device)
        buf["token_query_index"][pad] = 0
        buf["token_cache_index"][pad] = 0
        buf["tree_bits"][pad] = -1
        buf["block_tables"][pad, 0] = self.scratch_block
        buf["context_lens"][pad] = 1
        buf["draft_start"][pad] = 1

    # ------------------------------------------------------------------ run

    def _forward(self, num_tokens: int, meta: AttentionMetadata, batch, buffers):
        hidden = self.model(self.buffers["input_ids"][:num_tokens], self.buffers["positions"][:, :num_tokens],
                            meta, batch=batch, buffers=buffers)
        extras = {}
        for result in self.hooks.zoo_output_collect(hidden=hidden, batch=batch, buffers=buffers):
            extras.update(result or {})
        return hidden, extras

    def _graph_body(self, size: int, meta: AttentionMetadata, buffers):
        # A decode step's logits rows are its tokens, in order: no logits_indices gather needed.
        hidden, extras = self._forward(size, meta, None, buffers)
        return self.model.compute_logits(hidden), extras

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepOutput:
        rows = sum(len(r) for r in batch.logits_rows)
        if self.step_graph is not None:
            graph, logits, extras = self.graphs[self.step_graph]
            graph.replay()
            return StepOutput(logits=logits[:rows], extras=extras)
        hidden, extras = self._forward(batch.num_tokens, self.step_meta, batch, self.step_buffers())
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
