"""Decode steps replayed as CUDA graphs, one per padded batch size.

A plain decode step (one committed token per sequence, no drafts) fills the
static buffers as any step does; rows past the real batch become dummies that
write to the scratch KV block, and the graph captured for the next larger size
replays. Everything the forward pass reads (the forward context included) is a
view of those buffers, so the graph sees each step's values.
"""

from __future__ import annotations

import torch

from zoo.forward_context import ForwardContext, forward_context


class DecodeGraphs:
    """Graphs keyed by (batch size, rows per sequence): 1 for plain decode steps, 1 + max_draft_tokens for
    verify steps, whose sequences each take that many rows (draft blocks padded with dummy tokens)."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple[int, int], tuple] = {}  # (size, stride) -> (graph, logits, hidden, layer outputs)
        self.replays: dict[int, int] = {}  # stride -> replays, to tell which families ran

    def batch_sizes(self, stride: int = 1) -> list[int]:
        # A decode step runs `stride` tokens per sequence, so no step is wider than the token budget either.
        limits = self.runner.limits
        limit = min(limits.max_num_seqs, limits.max_num_tokens // stride)
        sizes = [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]
        return sorted(set(n for n in sizes if n >= 1))

    def strides(self) -> list[int]:
        draft = self.runner.limits.max_draft_tokens
        return [1] + ([1 + draft] if draft else [])

    def capture(self) -> None:
        """Every family, largest first, sharing one memory pool."""
        runner, device = self.runner, self.runner.device
        pool = None
        stream = torch.cuda.Stream(device)
        for stride in self.strides():
            for size in reversed(self.batch_sizes(stride)):
                self.pad_rows(0, size, stride)
                buffers = runner.step_buffers({"token": size * stride, "seq": size})
                meta = runner.attention_metadata(size * stride, size, stride, runner.limits.max_blocks_per_seq,
                                                 stride > 1, True)
                meta.block_tables = runner.buffers["block_tables"][:size]  # full width: any context length fits
                context = ForwardContext(meta, buffers, None)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream), torch.inference_mode():
                    self._body(context)  # warm-up: compiles kernels, fills caches
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                context.layer_outputs = {}
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = self._body(context)
                pool = graph.pool()
                self.graphs[size, stride] = (graph, *outputs)
        torch.cuda.synchronize(device)

    def _body(self, context: ForwardContext):
        # Every row of a graph step gives logits, in order: no logits_indices gather needed.
        with forward_context(context):
            hidden = self.runner.model(context.buffers["input_ids"], context.positions)
        return self.runner.model.compute_logits(hidden), hidden, dict(context.layer_outputs)

    def size_for(self, scheduled) -> tuple[int, int] | None:
        """The captured (size, stride) a step can replay, or None to run eagerly."""
        if not self.graphs or any(e.num_tokens != 1 or not e.samples for e in scheduled):
            return None
        stride = max(self.strides()) if any(e.draft is not None for e in scheduled) else 1
        return next(((size, stride) for size in self.batch_sizes(stride)
                     if size >= len(scheduled) and (size, stride) in self.graphs), None)

    def replay(self, key: tuple[int, int]):
        graph, logits, hidden, layer_outputs = self.graphs[key]
        graph.replay()
        self.replays[key[1]] = self.replays.get(key[1], 0) + 1
        return logits, hidden, layer_outputs

    def pad_rows(self, real: int, size: int, stride: int = 1) -> None:
        """Sequences ``real..size-1`` become harmless dummies: tokens writing to the scratch block."""
        if real == size:
            return
        runner = self.runner
        buf, scratch = runner.buffers, runner.kv.scratch_block
        rows, seqs = slice(real * stride, size * stride), slice(real, size)
        buf["input_ids"][rows] = 0
        buf["positions"][:, rows] = 0
        buf["slot_mapping"][rows] = scratch * runner.block_size
        buf["token_seq"][rows] = torch.arange(real, size, device=runner.device).repeat_interleave(stride)
        buf["token_query_index"][rows] = torch.arange(stride, device=runner.device).repeat(size - real)
        buf["token_cache_index"][rows] = 0
        if stride > 1:
            buf["draft_visible"][rows] = 0
        buf["block_tables"][seqs, 0] = scratch
        buf["context_lens"][seqs] = 1
        buf["draft_start"][seqs] = 1
