"""Forward passes replayed as CUDA graphs, one per padded batch size.

A graph family is one forward pass over the runner's static buffers with a
fixed number of rows per sequence (its stride): the model's plain decode steps
(1), its verify steps (1 + max_draft_tokens, draft blocks padded with dummy
tokens), and whatever passes plugins add at engine start (a draft model's).
A step fills the buffers as any step does; sequences past the real batch
become dummies that write to the scratch KV block, and the graph captured for
the next larger size replays. Everything a pass reads (the forward context
included) is a view of those buffers, so the graph sees each step's values.

A plugin whose work inside the model only some steps need (LoRA's products,
for steps with an adapter request) adds a variant: the model's own families
are captured once more with ``context.graph_variant`` set to its name, and a
step replays that variant when the plugin's predicate holds for it, the plain
graphs otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from zoo import fused_ops
from zoo.forward_context import ForwardContext, forward_context


@dataclass(frozen=True)
class GraphFamily:
    name: str
    stride: int  # rows per sequence
    tree: bool  # rows see only their draft ancestors inside the sequence's draft block (``draft_visible``)
    body: Callable[[ForwardContext], tuple]  # the pass: reads the context's buffers, returns tensors


class DecodeGraphs:
    """Graphs keyed by (family name, batch size), sharing one memory pool."""

    def __init__(self, runner):
        self.runner = runner
        self.families: dict[str, GraphFamily] = {"decode": GraphFamily("decode", 1, False, self._model_body)}
        if runner.limits.max_draft_tokens:
            self.add(GraphFamily("verify", 1 + runner.limits.max_draft_tokens, True, self._model_body))
        self.graphs: dict[tuple, tuple] = {}  # (family, size[, variant]) -> (graph, outputs)
        self.replays: dict[str, int] = {}  # family (+variant) -> replays, to tell which ran
        self.variants: dict[str, Callable] = {}  # name -> predicate on a step's scheduled requests

    def add(self, family: GraphFamily) -> None:
        if family.name in self.families:
            raise ValueError(f"graph family {family.name!r} is declared twice")
        if not 1 <= family.stride <= self.runner.limits.max_num_tokens:
            raise ValueError(f"graph family {family.name!r}: stride {family.stride} does not fit a step")
        if family.tree and not self.runner.limits.max_draft_tokens:
            raise ValueError(f"graph family {family.name!r} reads draft visibility, which plain decoding lacks")
        self.families[family.name] = family

    def add_variant(self, name: str, when: Callable) -> None:
        if name in self.variants:
            raise ValueError(f"graph variant {name!r} is declared twice")
        self.variants[name] = when

    def batch_sizes(self, stride: int = 1) -> list[int]:
        # A pass runs `stride` tokens per sequence, so none is wider than the token budget either.
        limits = self.runner.limits
        limit = min(limits.max_num_seqs, limits.max_num_tokens // stride)
        sizes = [n for n in (1, 2, 4, 8) if n < limit] + list(range(16, limit, 16)) + [limit]
        return sorted(set(n for n in sizes if n >= 1))

    def capture(self) -> None:
        """Every family, largest first, sharing one memory pool."""
        runner, device = self.runner, self.runner.device
        pool = None
        stream = torch.cuda.Stream(device)
        captures = [(family, None) for family in self.families.values()]
        captures += [(family, variant) for variant in self.variants for family in self.families.values()
                     if family.body == self._model_body]
        for family, variant in captures:
            stride = family.stride
            for size in reversed(self.batch_sizes(stride)):
                self.pad_rows(0, size, stride)
                buffers = runner.step_buffers({"token": size * stride, "seq": size})
                meta = runner.attention_metadata(size * stride, size, stride, runner.limits.max_blocks_per_seq,
                                                 family.tree, True)
                meta.block_tables = runner.buffers["block_tables"][:size]  # full width: any context length fits
                context = ForwardContext(meta, buffers, None, graph_variant=variant)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream), torch.inference_mode():
                    family.body(context)  # warm-up: compiles kernels, fills caches
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                context.layer_outputs = {}
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool, stream=stream):
                    outputs = family.body(context)
                pool = graph.pool()
                self.graphs[(family.name, size) + ((variant,) if variant else ())] = (graph, outputs)
        torch.cuda.synchronize(device)

    def _model_body(self, context: ForwardContext):
        # Every row of a graph step gives logits, in order: no logits_indices gather needed. The argmax rides
        # along (a few microseconds in the graph, against an eager launch after it for every greedy step).
        model = self.runner.model
        with forward_context(context):
            hidden = model(context.buffers["input_ids"], context.positions)
        logits = model.compute_logits(hidden)
        argmax = fused_ops.argmax(logits) if model.fused else logits.argmax(-1)
        return logits, hidden, dict(context.layer_outputs), argmax

    def size_for(self, family: str, num_seqs: int) -> int | None:
        """The captured batch size a pass of ``num_seqs`` sequences replays, or None to run eagerly."""
        stride = self.families[family].stride
        return next((size for size in self.batch_sizes(stride)
                     if size >= num_seqs and (family, size) in self.graphs), None)

    def key_for(self, scheduled) -> tuple | None:
        """The (family, size[, variant]) a model step replays, or None to run eagerly."""
        if not self.graphs or any(e.num_tokens != 1 or not e.samples for e in scheduled):
            return None
        family = "verify" if any(e.draft is not None for e in scheduled) else "decode"
        size = self.size_for(family, len(scheduled))
        variant = next((name for name, when in self.variants.items() if when(scheduled)), None)
        return None if size is None else (family, size) + ((variant,) if variant else ())

    def replay(self, family: str, size: int, variant: str | None = None) -> tuple:
        graph, outputs = self.graphs[(family, size) + ((variant,) if variant else ())]
        graph.replay()
        name = family + (f"+{variant}" if variant else "")
        self.replays[name] = self.replays.get(name, 0) + 1
        return outputs

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
        if "draft_visible" in buf:
            buf["draft_visible"][rows] = 0
        buf["block_tables"][seqs] = scratch  # every column: a pass may derive slots past the first block
        buf["context_lens"][seqs] = 1
        buf["draft_start"][seqs] = 1
