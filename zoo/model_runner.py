"""Turns a scheduled step into tensors and runs the model.

Every per-step input lives in a buffer allocated once at its largest size
(the core's and those plugins add at engine start); a step writes the first
rows of each and the forward context hands the model views of them. On CUDA,
plain decode steps replay a CUDA graph over those same buffers
(:mod:`zoo.cuda_graphs`), so a plugin that fills its buffers runs under graphs
unchanged.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from zoo import fused_ops, triton_attention
from zoo.cuda_graphs import MIXED_FAMILY, PROMPT_FAMILY, DecodeGraphs
from zoo.description import ModelDescription
from zoo.forward_context import ForwardContext, forward_context
from zoo.kv_cache import KVCache
from zoo.model import AttentionMetadata, DecoderModel, MixedStep, RaggedCausal, ragged_attention_usable
from zoo.request import Request
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest
from zoo.step import BufferSpec, StepBatch, StepOutput
from zoo.step_inputs import StepLayout, device_lays_out, int64_tensor, is_decode_token


def advance_rows(buffers: dict[str, torch.Tensor], n: int, block_size: int) -> None:
    """Rows ``0..n-1`` of a decode step's buffers, one token further: positions, cache indices, context lengths,
    draft starts and query cache indices plus one, and each row's slot looked up in its block table at its new
    cache index (row i is sequence i). ``fused_ops.advance_decode_rows`` does the same in one launch."""
    buffers["positions"][:, :n] += 1
    for name in ("token_cache_index", "context_lens", "draft_start"):
        buffers[name][:n] += 1
    buffers["query_cache_index"][:n, 0] += 1
    if "query_index_in_sequence" in buffers:
        buffers["query_index_in_sequence"][:n, 0] += 1
    index = buffers["token_cache_index"][:n]
    buffers["slot_mapping"][:n] = (buffers["block_tables"][:n].gather(1, (index // block_size)[:, None])[:, 0]
                                   * block_size + index % block_size)


@dataclass(frozen=True)
class RunnerLimits:
    max_num_tokens: int  # query tokens per step, drafts included
    max_model_len: int  # positions per sequence
    max_num_seqs: int
    max_blocks_per_seq: int
    block_size: int
    max_draft_tokens: int  # per sequence, from the decoding method (0: plain decoding)


class ModelRunner:
    def __init__(self, model: DecoderModel, description: ModelDescription, limits: RunnerLimits,
                 dtype: torch.dtype, device: torch.device, hooks, attention_backend: str):
        self.model, self.description, self.limits = model, description, limits
        self.device, self.dtype, self.hooks = device, dtype, hooks
        self.block_size = limits.block_size
        self.specs: dict[str, BufferSpec] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        t, s = limits.max_num_tokens, limits.max_num_seqs
        for spec in [
            BufferSpec("input_ids", (t,)),
            BufferSpec("positions", (description.position_rows, t), step_dim=1),
            BufferSpec("slot_mapping", (t,)),
            BufferSpec("token_seq", (t,)),
            BufferSpec("token_query_index", (t,)),
            BufferSpec("token_cache_index", (t,)),
            BufferSpec("logits_indices", (t,)),
            BufferSpec("block_tables", (s, limits.max_blocks_per_seq), per="seq"),
            BufferSpec("query_cache_index", (s, t), per="seq"),
            BufferSpec("context_lens", (s,), per="seq"),
            BufferSpec("draft_start", (s,), per="seq"),
        ] + ([BufferSpec("draft_visible", (t, limits.max_draft_tokens), dtype=torch.int8)]
             if limits.max_draft_tokens else []) + ([BufferSpec("query_index_in_sequence", (s, t), per="seq")]
                                                    if description.sliding_window else []):
            self.add_buffer(spec)
        self.kv = KVCache(description, self.block_size, dtype, device)
        self.kv.add_layers(model.attention_layers())
        self.graphs = DecodeGraphs(self)
        self.decode_kernel = self._decode_kernel_usable(attention_backend)
        self.position_hooks = bool(hooks.zoo_step_positions.get_hookimpls())
        # Whole-prompt steps attend without the cache's mask (flash kernels), and steps mixing decodes with
        # prompts attend kind by kind (see zoo.model.MixedStep), rather than one dense mask padding every decode
        # token to the longest prompt; tests turn it off to check the masked path, which the steps it cannot
        # take (drafts, bidirectional prefixes, windows) keep.
        self.fresh_causal_path = True
        # Mixed steps attend their whole prompts and chunks in one varlen flash call where it runs.
        self.ragged_path = ragged_attention_usable(device, dtype, description.head_dim)

    def add_buffer(self, spec: BufferSpec) -> None:
        if spec.name in self.specs:
            raise ValueError(f"buffer {spec.name!r} is declared twice")
        self.specs[spec.name] = spec
        self.buffers[spec.name] = torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=self.device)

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

    def step_buffers(self, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
        return {name: self.buffers[name].narrow(spec.step_dim, 0, sizes[spec.per]) for name, spec in self.specs.items()}

    # ------------------------------------------------------------------ inputs

    def _positions(self, request: Request, indices: list[int]) -> list[list[int]]:
        rows = None
        if self.position_hooks:
            rows = self.hooks.zoo_step_positions(request=request, indices=indices, description=self.description)
        return rows if rows is not None else [list(indices)]

    def prepare(self, scheduled: list[ScheduledRequest]) -> StepBatch:
        layout = StepLayout(self.description.position_rows, self.block_size)
        graph = self.graphs.key_for(scheduled)
        stride = self.graphs.families[graph[0]].stride if graph else 1
        # Steps with prompts or chunks are laid out on the device (bench/step_layout.py); decodes alone stay on the
        # lists, one token a sequence, where the device layout has not been measured to gain.
        default_layout = stride == 1 and not self.position_hooks  # no graph padding, positions by cache index
        if (default_layout and sum(e.num_tokens for e in scheduled) > len(scheduled)
                and all(map(device_lays_out, scheduled))):
            layout.runs = []
            for b, entry in enumerate(scheduled):
                layout.add_run(b, entry)
        else:
            for b, entry in enumerate(scheduled):
                if default_layout and is_decode_token(entry):
                    layout.add_decode_token(b, entry)
                else:
                    layout.add_entry(b, entry, self._positions)
                    if stride > 1:
                        layout.pad_entry(stride, self.kv.scratch_block * self.block_size)
        if stride > 1:
            layout.every_row_gives_logits()
        runs_writer = fused_ops.lay_out_runs if self.model.fused and fused_ops.RUNS_KERNEL else None
        max_query, num_blocks = layout.write(self.buffers, [e.request.block_ids for e in scheduled], runs_writer)
        if graph is None:
            graph = self.graphs.prompt_key(layout, scheduled) or self.graphs.mixed_key(layout, scheduled)
        batch = StepBatch(scheduled, len(layout.input_ids), layout.offsets, layout.logits_rows,
                          layout.logits_indices, graph=graph, prompt_logits_rows=layout.prompt_logits_rows)
        if graph is not None and graph[0] == PROMPT_FAMILY:
            self.graphs.pad_prompts(layout, graph[1])
        elif graph is not None and graph[0] == MIXED_FAMILY:
            self.graphs.pad_mixed(layout, graph[1])
        elif graph is None:
            unmasked = self.fresh_causal_path and not self.description.sliding_window
            split = unmasked and layout.splittable and max_query > 1
            # whole prompts alone take the ragged call too where it runs: no padding to the longest prompt
            fresh = unmasked and layout.fresh_causal and not (split and self.ragged_path)
            split = split and not fresh
            batch.attention = self.attention_metadata(batch.num_tokens, len(scheduled), max_query, num_blocks,
                                                      layout.has_drafts, fresh_causal=fresh,
                                                      split=layout if split else None)
        else:
            self.graphs.pad_rows(len(scheduled), graph[1], stride)
        self.hooks.zoo_step_prepare(batch=batch, buffers=self.step_buffers(batch.sizes))
        return batch

    def advance_decode(self, batch: StepBatch, scheduled: list[ScheduledRequest],
                       new_blocks: list[tuple[int, int, int]]) -> StepBatch:
        """The step after ``batch`` (plain decodes, one token each) for the same requests in the same rows, laid
        out on the device: every position, cache index and context length one further, each slot looked up in
        the block tables. From the host only ``new_blocks`` ((row, column, block id): blocks appended since)
        and the next tokens, which the caller copies; a full :meth:`prepare` builds and copies every list."""
        n, buf, bs = len(scheduled), self.buffers, self.block_size
        if new_blocks:  # one copy for the three lists (py-spy found the three copies at 2% of a serving engine)
            table = int64_tensor([v for entry in new_blocks for v in entry]).to(self.device, non_blocking=True)
            table = table.view(-1, 3)
            buf["block_tables"][table[:, 0], table[:, 1]] = table[:, 2]
        advance = fused_ops.advance_decode_rows if self.model.fused and fused_ops.ADVANCE_KERNEL else advance_rows
        advance(buf, n, bs)
        step = StepBatch(scheduled, n, batch.token_offsets, batch.logits_rows, batch.logits_indices,
                         graph=batch.graph)
        if step.graph is None:
            num_blocks = max(len(e.request.block_ids) for e in scheduled)
            step.attention = self.attention_metadata(n, n, 1, num_blocks, False)
        self.hooks.zoo_step_prepare(batch=step, buffers=self.step_buffers(step.sizes))
        return step

    def attention_metadata(self, num_tokens, num_seqs, max_query, num_blocks, has_drafts,
                           use_kernel: bool | None = None, fresh_causal: bool = False,
                           split: StepLayout | None = None, ragged: RaggedCausal | None = None
                           ) -> AttentionMetadata:
        """The step's attention metadata; ``use_kernel`` None: the decode kernel wherever it handles the query.
        ``fresh_causal``: every sequence attends causally over exactly this step's tokens (whole prompts).
        ``split``: a splittable step's layout, attended group by group (:class:`zoo.model.MixedStep`).
        ``ragged``: every row of the step attended by this one varlen call (a prompt graph's)."""
        if use_kernel is None:
            use_kernel = self.decode_kernel and max_query <= 1 + self.limits.max_draft_tokens
        fresh_causal = fresh_causal and not use_kernel
        buf = self.buffers
        mixed = (MixedStep(ragged=ragged) if ragged is not None
                 else None if use_kernel or fresh_causal or split is None else self._mixed_step(split))
        visible = buf["draft_visible"][:num_tokens] if has_drafts else None
        mask = (None if use_kernel or fresh_causal or mixed
                else self._dense_mask(num_tokens, num_seqs, max_query, num_blocks, visible))
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
            draft_visible=visible,
            has_tree=has_drafts,
            use_decode_kernel=use_kernel,
            fresh_causal=fresh_causal,
            split=mixed,
        )

    def _mixed_step(self, layout: StepLayout) -> MixedStep:
        """The step's sequences by kind (see :class:`zoo.model.MixedStep`), from the buffers already written."""
        buf, device = self.buffers, self.device

        def on_device(values):
            return int64_tensor(values).to(device, non_blocking=True) if values else None

        def spans(lengths):  # each span's rows: which span, index in it
            seq, index = [], []
            for k, n in enumerate(lengths):
                seq += [k] * n
                index += range(n)
            return on_device(seq), on_device(index)

        decode_rows = on_device(layout.decode_rows)
        decode = dict(decode_rows=decode_rows,
                      decode_seq=None if decode_rows is None else buf["token_seq"][decode_rows],
                      decode_cache_index=None if decode_rows is None else buf["token_cache_index"][decode_rows])
        if decode_rows is not None and not self.decode_kernel:
            num_blocks = -(-max(layout.context_lens[b] for b in layout.decode_seqs)
                           // self.block_size)
            key_index = torch.arange(num_blocks * self.block_size, device=device)
            decode.update(decode_tables=buf["block_tables"][decode["decode_seq"], :num_blocks],
                          decode_mask=(key_index <= decode["decode_cache_index"][:, None])[:, None, None])
        if self.ragged_path and (layout.prompt_spans or layout.chunk_spans):
            return MixedStep(**decode, ragged=self._ragged(layout))
        prompt_rows = on_device([r for first, n in layout.prompt_spans for r in range(first, first + n)])
        prompt_seq, prompt_index = spans([n for _, n in layout.prompt_spans])
        chunk_rows = on_device([r for _, first, n in layout.chunk_spans for r in range(first, first + n)])
        chunk_seq, chunk_index = spans([n for _, _, n in layout.chunk_spans])
        chunk_tables = chunk_mask = None
        if layout.chunk_spans:
            seqs = on_device([b for b, _, _ in layout.chunk_spans])
            longest = max(n for _, _, n in layout.chunk_spans)
            num_blocks = max(-(-layout.context_lens[b] // self.block_size) for b, _, _ in layout.chunk_spans)
            chunk_tables = buf["block_tables"][seqs, :num_blocks]
            key_index = torch.arange(num_blocks * self.block_size, device=device)
            chunk_mask = ((key_index <= buf["query_cache_index"][seqs, :longest, None])
                          & (key_index < buf["context_lens"][seqs, None, None]))[:, None]
        return MixedStep(
            **decode,
            prompt_rows=prompt_rows, prompt_slots=None if prompt_rows is None else buf["slot_mapping"][prompt_rows],
            prompt_seq=prompt_seq, prompt_query_index=prompt_index, num_prompts=len(layout.prompt_spans),
            longest_prompt=max((n for _, n in layout.prompt_spans), default=0),
            chunk_rows=chunk_rows, chunk_seq=chunk_seq, chunk_query_index=chunk_index, chunk_tables=chunk_tables,
            chunk_mask=chunk_mask)

    def _ragged(self, layout: StepLayout) -> RaggedCausal:
        """The step's whole prompts, then its chunks, as :class:`zoo.model.RaggedCausal`: a prompt's keys are its
        own tokens' slots; a chunk's are every slot of its sequence up to its last token, from its block table."""
        buf, device, bs = self.buffers, self.device, self.block_size
        spans = layout.prompt_spans + [(first, n) for _, first, n in layout.chunk_spans]
        query_lens = [n for _, n in spans]
        key_lens = [n for _, n in layout.prompt_spans] + [layout.context_lens[b] for b, _, _ in layout.chunk_spans]
        prompt_rows = sum(n for _, n in layout.prompt_spans)
        # A step of prompts and chunks alone, laid out in this order (a long prompt's step): the call's rows are
        # the step's, so neither the queries nor the output need gathering, nor the prompts' slots.
        starts = itertools.accumulate(query_lens, initial=0)
        in_order = not layout.decode_rows and all(first == start for (first, _), start in zip(spans, starts))
        if in_order:
            rows_on_device = None
            key_slots = buf["slot_mapping"][:prompt_rows]  # a whole prompt's keys are its own tokens
        else:
            rows = [r for first, n in spans for r in range(first, first + n)]
            rows_on_device = int64_tensor(rows).to(device, non_blocking=True)
            key_slots = buf["slot_mapping"][rows_on_device[:prompt_rows]]
        if layout.chunk_spans:
            seqs = int64_tensor([b for b, _, _ in layout.chunk_spans]).to(device, non_blocking=True)
            num_blocks = max(-(-layout.context_lens[b] // bs) for b, _, _ in layout.chunk_spans)
            width = num_blocks * bs
            grid = (buf["block_tables"][seqs, :num_blocks, None] * bs
                    + torch.arange(bs, device=device)).flatten(1)  # [chunks, width]: slot of each cache index
            picks = [k * width + i for k, (b, _, _) in enumerate(layout.chunk_spans)
                     for i in range(layout.context_lens[b])]
            key_slots = torch.cat([key_slots, grid.flatten()[int64_tensor(picks).to(device, non_blocking=True)]])

        def cumulative(lengths):
            return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device, non_blocking=True)

        return RaggedCausal(rows=rows_on_device, key_slots=key_slots, cu_queries=cumulative(query_lens),
                            cu_keys=cumulative(key_lens), longest_query=max(query_lens), longest_keys=max(key_lens))

    def _dense_mask(self, num_tokens, num_seqs, max_query, num_blocks, visible) -> torch.Tensor:
        """``[B, 1, Q, keys]``: causal by cache index, windowed, and ancestors only inside a draft block."""
        buf = self.buffers
        key_index = torch.arange(num_blocks * self.block_size, device=self.device)
        query_cache_index = buf["query_cache_index"][:num_seqs, :max_query]
        mask = (key_index <= query_cache_index[:, :, None]) & (key_index < buf["context_lens"][:num_seqs, None, None])
        window = self.description.sliding_window
        if window:  # by index in the sequence: a draft token's is its depth past the last committed token
            in_window = key_index > buf["query_index_in_sequence"][:num_seqs, :max_query, None] - window
            mask &= in_window | (key_index < self.description.attention_sinks)
        if visible is not None:
            width = visible.shape[1]
            sees = torch.zeros(num_seqs, max_query, width, dtype=torch.bool, device=self.device)
            sees[buf["token_seq"][:num_tokens], buf["token_query_index"][:num_tokens]] = visible.bool()
            offset = key_index[None, :] - buf["draft_start"][:num_seqs, None]  # [B, L]
            in_block = (offset >= 0) & (offset < width)
            allowed = sees.gather(2, offset.clamp(0, width - 1)[:, None, :].expand(-1, max_query, -1))
            mask &= ~in_block[:, None, :] | allowed
        return mask[:, None]

    # ------------------------------------------------------------------ run

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> StepOutput:
        rows = len(batch.logits_indices)
        if batch.graph is not None:
            logits, hidden, layer_outputs, argmax = self.graphs.replay(*batch.graph)
            return StepOutput(logits[:rows], hidden, layer_outputs, argmax[:rows])
        buffers = self.step_buffers(batch.sizes)
        with forward_context(ForwardContext(batch.attention, buffers, batch)) as context:
            hidden = self.model(buffers["input_ids"], buffers["positions"])
        logits = self.model.compute_logits(hidden[self.buffers["logits_indices"][:rows]])
        return StepOutput(logits, hidden, context.layer_outputs)

    def pass_size(self, family: str, rows_per_seq: list[int]) -> int | None:
        """The graph size a plugin's pass replays (pad each sequence to the family's stride), or None: eager."""
        if not self.graphs.graphs or max(rows_per_seq) > self.graphs.families[family].stride:
            return None
        return self.graphs.size_for(family, len(rows_per_seq))

    @torch.inference_mode()
    def run_pass(self, family: str, layout: StepLayout, block_ids: list[list[int]], size: int | None) -> tuple:
        """A plugin's pass (:meth:`zoo.engine_setup.EngineSetup.add_graph_pass`) over a laid-out step: the
        graph of ``size`` replays (its sequences padded to the stride), else the body runs eagerly."""
        max_query, num_blocks = layout.write(self.buffers, block_ids)
        return self.run_written_pass(family, len(layout.input_ids), len(block_ids), max_query, num_blocks,
                                     layout.has_drafts, size)

    @torch.inference_mode()
    def run_written_pass(self, family: str, num_tokens: int, num_seqs: int, max_query: int, num_blocks: int,
                         has_drafts: bool, size: int | None) -> tuple:
        """:meth:`run_pass` over buffers the plugin has already filled (on the device, without a layout)."""
        if size is not None:
            self.graphs.pad_rows(num_seqs, size, self.graphs.families[family].stride)
            return self.graphs.replay(family, size)
        meta = self.attention_metadata(num_tokens, num_seqs, max_query, num_blocks, has_drafts)
        buffers = self.step_buffers({"token": num_tokens, "seq": num_seqs})
        return self.graphs.families[family].body(ForwardContext(meta, buffers, None))

    def run_full_step(self) -> None:
        """One forward pass as big as the limits allow: the most tokens, split over dummy requests."""
        limits = self.limits
        longest = min(limits.max_num_tokens, limits.max_model_len)
        lengths = [longest] * (limits.max_num_tokens // longest)
        if limits.max_num_tokens % longest:
            lengths.append(limits.max_num_tokens % longest)
        lengths = lengths[:limits.max_num_seqs]
        blocks_per_seq = -(-longest // self.block_size)
        self.kv.allocate(len(lengths) * blocks_per_seq)
        scheduled = []
        for i, length in enumerate(lengths):
            dummy = Request(-1 - i, [0] * length, SamplingParams(max_new_tokens=1))
            dummy.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            scheduled.append(ScheduledRequest(dummy, 0, length))
        batch = self.prepare(scheduled)
        if self.limits.max_draft_tokens:  # verify graphs take logits of every row: count them in the peak
            batch.logits_indices = list(range(batch.num_tokens))
            self.buffers["logits_indices"][:batch.num_tokens].copy_(torch.arange(batch.num_tokens))
        self.run(batch)

    def profile_peak_memory(self) -> int:
        """Peak CUDA bytes of the largest step (weights included), before the KV cache exists."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_full_step()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv.release()
        torch.cuda.empty_cache()
        return peak
