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

Steps of whole prompts replay graphs too (``runtime.prompt_graph_tokens``),
one per token bucket: an eager pass launches some 270 kernels for a 1B
model, and on the H200 the host took longer to launch them than the GPU to
run them (a 2,040-token prompt: 8 ms of kernels, 10 ms of launching). The
step's rows are padded to the bucket with a dummy prompt writing to the
scratch block, and up to PROMPT_GRAPH_SEQS prompts go through one varlen
flash call whose sequence boundaries are a buffer the step writes.

Steps that mix decodes with prompts or chunks (a server admitting requests
while others decode) replay graphs of their own (``runtime.mixed_graph_tokens``),
one per token bucket. There the decode kernel attends every row: a prompt's
row at cache index i is a query that sees its sequence's keys 0..i, which the
step has just written, so no row is gathered and no varlen call's bounds are
needed. Such a graph holds up to min(bucket, max_num_seqs) sequences; rows
past the step's write to the scratch block. The kernel reads each row's keys
again, so long prompts stay with the prompt graphs and the eager path. On the
H200 the eager forward of these steps took 31% of a serving engine process
that was itself the bottleneck (bench/results/serve/h200_round4/).

Steps a plugin must run eagerly (its work reads the step's requests, as
prompt tuning's virtual tokens or an image's features do) say so with
:meth:`zoo.engine_setup.EngineSetup.run_eagerly_when`; neither prompt nor
mixed graphs are taken for a step a graph variant's predicate holds for.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from zoo import fused_ops
from zoo.forward_context import ForwardContext, forward_context
from zoo.model import RaggedCausal

PROMPT_FAMILY = "prompt"
MIXED_FAMILY = "mixed"
# Prompts one prompt graph holds. Its varlen call runs one more sequence (the padding) and launches programs for
# every sequence at the bucket's length; the empty ones return at once, so a few cost little.
PROMPT_GRAPH_SEQS = 8


def token_buckets(limit: int) -> list[int]:
    """Token counts of the prompt and mixed graphs up to ``limit`` (0: none): powers of two up to 256, then every
    256, then ``limit`` (a step pads to the next one, so at most a quarter of the work is padding past 256)."""
    if limit < 1:
        return []
    sizes = [n for n in (16, 32, 64, 128, 256) if n < limit] + list(range(512, limit, 256)) + [limit]
    return sorted(set(sizes))


def next_bucket(buckets: list[int], tokens: int) -> int | None:
    return min((size for size in buckets if size >= tokens), default=None)


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
        self.eager_when: list[Callable] = []  # predicates on a step's scheduled requests: no graph for it
        self._pool = self._stream = None  # the captures' memory pool and side stream
        self.prompt_sizes: list[int] = []  # the prompt buckets captured
        self.mixed_sizes: list[int] = []  # the mixed-step buckets captured
        # a prompt graph's sequence boundaries (int32, as flash's varlen call takes them): its prompts', then the
        # padding's, then empty sequences up to PROMPT_GRAPH_SEQS + 1
        self.prompt_bounds = torch.zeros(PROMPT_GRAPH_SEQS + 2, dtype=torch.int32, device=runner.device)

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

    def prompt_buckets(self, prompt_tokens: int) -> list[int]:
        """Token counts prompt graphs are captured for, up to ``prompt_tokens`` (runtime.prompt_graph_tokens; 0:
        none); see :func:`token_buckets`."""
        runner = self.runner
        if not (runner.ragged_path and runner.fresh_causal_path) or runner.description.sliding_window:
            return []
        return token_buckets(min(prompt_tokens, runner.limits.max_num_tokens))

    def mixed_buckets(self, mixed_tokens: int) -> list[int]:
        """Token counts mixed-step graphs are captured for, up to ``mixed_tokens`` (runtime.mixed_graph_tokens;
        0: none). They need the decode kernel, which a sliding window turns off."""
        runner = self.runner
        return token_buckets(min(mixed_tokens, runner.limits.max_num_tokens)) if runner.decode_kernel else []

    def mixed_seqs(self, tokens: int) -> int:
        """Sequences a mixed graph of ``tokens`` rows holds: as many as could fit, one row each."""
        return min(tokens, self.runner.limits.max_num_seqs)

    def capture(self, prompt_tokens: int = 0, mixed_tokens: int = 0) -> None:
        """Every family, largest first, sharing one memory pool: prompt graphs (up to ``prompt_tokens``) first,
        then mixed-step graphs (up to ``mixed_tokens``): their activations are the largest, and later captures
        reuse the pool's free memory."""
        runner = self.runner
        self._pool = None
        self.prompt_sizes = self.prompt_buckets(prompt_tokens)
        self.mixed_sizes = self.mixed_buckets(mixed_tokens)
        for tokens in reversed(self.prompt_sizes):
            self.pad_prompts(None, tokens)
            ragged = RaggedCausal(rows=None, key_slots=runner.buffers["slot_mapping"][:tokens],
                                  cu_queries=self.prompt_bounds, cu_keys=self.prompt_bounds,
                                  longest_query=tokens, longest_keys=tokens)
            meta = runner.attention_metadata(tokens, PROMPT_GRAPH_SEQS, tokens, 1, False, use_kernel=False,
                                             ragged=ragged)
            context = ForwardContext(meta, runner.step_buffers({"token": tokens, "seq": PROMPT_GRAPH_SEQS}), None)
            body = functools.partial(self._model_body, logits_rows=PROMPT_GRAPH_SEQS)
            self.graphs[(PROMPT_FAMILY, tokens)] = self._capture(body, context)
        for tokens in reversed(self.mixed_sizes):
            seqs = self.mixed_seqs(tokens)
            self.pad_mixed(None, tokens)
            meta = runner.attention_metadata(tokens, seqs, 1, runner.limits.max_blocks_per_seq, False,
                                             use_kernel=True)
            context = ForwardContext(meta, runner.step_buffers({"token": tokens, "seq": seqs}), None)
            body = functools.partial(self._model_body, logits_rows=seqs)
            self.graphs[(MIXED_FAMILY, tokens)] = self._capture(body, context)
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
                self.graphs[(family.name, size) + ((variant,) if variant else ())] = self._capture(family.body,
                                                                                                   context)
        if self._stream is not None:  # anything captured
            torch.cuda.synchronize(runner.device)

    def _capture(self, body, context: ForwardContext) -> tuple:
        device = self.runner.device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.inference_mode():
            body(context)  # warm-up: compiles kernels, fills caches
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        context.layer_outputs = {}
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
            outputs = body(context)
        self._pool = graph.pool()
        return graph, outputs

    def _model_body(self, context: ForwardContext, logits_rows: int = 0):
        # Every row of a decode or verify graph step gives logits, in order: no logits_indices gather needed. A
        # prompt graph's logits are those of the first ``logits_rows`` logits_indices. The argmax rides along
        # (a few microseconds in the graph, against an eager launch after it for every greedy step).
        model = self.runner.model
        with forward_context(context):
            hidden = model(context.buffers["input_ids"], context.positions)
        rows = self.runner.buffers["logits_indices"][:logits_rows] if logits_rows else slice(None)
        logits = model.compute_logits(hidden[rows])
        argmax = fused_ops.argmax(logits) if model.fused else logits.argmax(-1)
        return logits, hidden, dict(context.layer_outputs), argmax

    def size_for(self, family: str, num_seqs: int) -> int | None:
        """The captured batch size a pass of ``num_seqs`` sequences replays, or None to run eagerly."""
        stride = self.families[family].stride
        return next((size for size in self.batch_sizes(stride)
                     if size >= num_seqs and (family, size) in self.graphs), None)

    def key_for(self, scheduled) -> tuple | None:
        """The (family, size[, variant]) a model step replays, or None to run eagerly."""
        if (not self.graphs or any(e.num_tokens != 1 or not e.samples for e in scheduled)
                or any(when(scheduled) for when in self.eager_when)):
            return None
        family = "verify" if any(e.draft is not None for e in scheduled) else "decode"
        size = self.size_for(family, len(scheduled))
        variant = next((name for name, when in self.variants.items() if when(scheduled)), None)
        return None if size is None else (family, size) + ((variant,) if variant else ())

    def prompt_key(self, layout, scheduled) -> tuple | None:
        """(PROMPT_FAMILY, bucket) for a step of whole prompts that a prompt graph can replay, else None."""
        buckets = self.prompt_sizes
        # fresh_causal: every entry a prompt from its start, without drafts or a bidirectional prefix (so no chunks
        # and a splittable step); decode_rows: a one-token prompt is laid out as a decode. The whole-prompt path
        # switched off (bench/gpu.py times the masked path so) leaves them eager too.
        if (not buckets or not self.runner.fresh_causal_path or not layout.fresh_causal or layout.decode_rows
                or len(layout.prompt_spans) > PROMPT_GRAPH_SEQS
                or len(layout.logits_indices) > PROMPT_GRAPH_SEQS or self._kept_eager(scheduled)):
            return None
        bucket = next_bucket(buckets, len(layout.input_ids))
        return None if bucket is None else (PROMPT_FAMILY, bucket)

    def mixed_key(self, layout, scheduled) -> tuple | None:
        """(MIXED_FAMILY, bucket) for any other step a mixed graph can replay, else None: no drafts and no
        bidirectional prefix (``layout.splittable``: the decode kernel's causal rule is all it attends by), at
        most the bucket's sequences of logits rows."""
        if not self.mixed_sizes or not layout.splittable or self._kept_eager(scheduled):
            return None
        bucket = next_bucket(self.mixed_sizes, len(layout.input_ids))
        if bucket is None or len(layout.logits_indices) > self.mixed_seqs(bucket):
            return None
        return (MIXED_FAMILY, bucket)

    def _kept_eager(self, scheduled) -> bool:
        """Whether a plugin keeps the step off the prompt and mixed graphs: it asks for eager, or a graph
        variant holds (only the decode families are captured per variant)."""
        return any(when(scheduled) for when in itertools.chain(self.variants.values(), self.eager_when))

    def pad_prompts(self, layout, tokens: int) -> None:
        """A prompt step's rows past its own, up to ``tokens``, become a dummy prompt writing to the scratch
        block; its sequence boundaries go to ``prompt_bounds``. ``layout`` None: all ``tokens`` rows (capture)."""
        buf, real = self.runner.buffers, 0 if layout is None else len(layout.input_ids)
        if real < tokens:
            self._dummy_tokens(slice(real, tokens))
        logits = 0 if layout is None else len(layout.logits_indices)
        buf["logits_indices"][logits:PROMPT_GRAPH_SEQS] = 0
        ends = [] if layout is None else list(itertools.accumulate(n for _, n in layout.prompt_spans))
        bounds = [0, *ends] + [tokens] * (PROMPT_GRAPH_SEQS + 1 - len(ends))
        self.prompt_bounds.copy_(torch.tensor(bounds, dtype=torch.int32), non_blocking=True)

    def pad_mixed(self, layout, tokens: int) -> None:
        """A mixed step's rows past its own, up to ``tokens``, become dummies writing to the scratch block, each
        a query at cache index 0 of sequence 0 (read, never used); logits rows past its own read row 0.
        ``layout`` None (capture): every row and sequence a dummy."""
        buf, real = self.runner.buffers, 0 if layout is None else len(layout.input_ids)
        seqs = self.mixed_seqs(tokens)
        if real < tokens:
            rows = slice(real, tokens)
            self._dummy_tokens(rows)
            buf["token_seq"][rows] = 0
            buf["token_cache_index"][rows] = 0
        buf["logits_indices"][0 if layout is None else len(layout.logits_indices):seqs] = 0
        if layout is None:
            buf["block_tables"][:seqs] = self.runner.kv.scratch_block
            buf["context_lens"][:seqs] = 1
            buf["draft_start"][:seqs] = 1

    def replay(self, family: str, size: int, variant: str | None = None) -> tuple:
        graph, outputs = self.graphs[(family, size) + ((variant,) if variant else ())]
        graph.replay()
        name = family + (f"+{variant}" if variant else "")
        self.replays[name] = self.replays.get(name, 0) + 1
        return outputs

    def _dummy_tokens(self, rows: slice) -> None:
        """Token rows that write to the scratch block: token 0 at position 0."""
        runner, buf = self.runner, self.runner.buffers
        buf["input_ids"][rows] = 0
        buf["positions"][:, rows] = 0
        buf["slot_mapping"][rows] = runner.kv.scratch_block * runner.block_size

    def pad_rows(self, real: int, size: int, stride: int = 1) -> None:
        """Sequences ``real..size-1`` become harmless dummies: tokens writing to the scratch block."""
        if real == size:
            return
        runner = self.runner
        buf, scratch = runner.buffers, runner.kv.scratch_block
        rows, seqs = slice(real * stride, size * stride), slice(real, size)
        self._dummy_tokens(rows)
        buf["token_seq"][rows] = torch.arange(real, size, device=runner.device).repeat_interleave(stride)
        buf["token_query_index"][rows] = torch.arange(stride, device=runner.device).repeat(size - real)
        buf["token_cache_index"][rows] = 0
        if "draft_visible" in buf:
            buf["draft_visible"][rows] = 0
        buf["block_tables"][seqs] = scratch  # every column: a pass may derive slots past the first block
        buf["context_lens"][seqs] = 1
        buf["draft_start"][seqs] = 1
