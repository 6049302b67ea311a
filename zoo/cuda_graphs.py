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
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[int, tuple] = {}  # batch size -> (graph, logits, hidden, layer outputs)

    def batch_sizes(self) -> list[int]:
        # A decode step runs one token per sequence, so no step is wider than the token budget either.
        limits = self.runner.limits
        limit = min(limits.max_num_seqs, limits.max_num_tokens)
        sizes = [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]
        return sorted(set(sizes))

    def capture(self) -> None:
        """Largest first, sharing one memory pool."""
        runner, device = self.runner, self.runner.device
        pool = None
        stream = torch.cuda.Stream(device)
        for size in reversed(self.batch_sizes()):
            self.pad_rows(0, size)
            buffers = runner.step_buffers({"token": size, "seq": size})
            meta = runner.attention_metadata(size, size, 1, runner.limits.max_blocks_per_seq, False, True)
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
            self.graphs[size] = (graph, *outputs)
        torch.cuda.synchronize(device)

    def _body(self, context: ForwardContext):
        # A decode step's logits rows are its tokens, in order: no logits_indices gather needed.
        with forward_context(context):
            hidden = self.runner.model(context.buffers["input_ids"], context.positions)
        return self.runner.model.compute_logits(hidden), hidden, dict(context.layer_outputs)

    def size_for(self, scheduled) -> int | None:
        """The captured batch size a step can replay, or None to run eagerly."""
        if not self.graphs or any(e.num_tokens != 1 or e.draft is not None or not e.samples for e in scheduled):
            return None
        return next((size for size in sorted(self.graphs) if size >= len(scheduled)), None)

    def replay(self, size: int):
        graph, logits, hidden, layer_outputs = self.graphs[size]
        graph.replay()
        return logits, hidden, layer_outputs

    def pad_rows(self, real: int, size: int) -> None:
        """Rows ``real..size-1`` become harmless dummies: one token writing to the scratch block."""
        if real == size:
            return
        runner = self.runner
        buf, pad, scratch = runner.buffers, slice(real, size), runner.kv.scratch_block
        buf["input_ids"][pad] = 0
        buf["positions"][:, pad] = 0
        buf["slot_mapping"][pad] = scratch * runner.block_size
        buf["token_seq"][pad] = torch.arange(real, size, device=runner.device)
        buf["token_query_index"][pad] = 0
        buf["token_cache_index"][pad] = 0
        buf["block_tables"][pad, 0] = scratch
        buf["context_lens"][pad] = 1
        buf["draft_start"][pad] = 1
