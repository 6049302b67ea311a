"""The one generic decoder-only transformer.

Parameter names follow the Llama layout of HF checkpoints
(``model.layers.N.self_attn.q_proj.weight``...), so architecture plugins only
map names that differ. Attention reads and writes the paged KV cache through
the step's :class:`AttentionMetadata`, which it reads from the forward context
(:mod:`zoo.forward_context`); the model itself keeps no per-request state.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from zoo import fused_ops
from zoo.description import ModelDescription
from zoo.forward_context import get_forward_context
from zoo.parallel import summed


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged cache and what each may see.

    Tokens are ragged (no padding). The SDPA path pads them per sequence to
    ``[num_seqs, max_query_len]`` through ``token_seq``/``token_query_index``
    and uses ``mask``; the decode kernel reads the same rule from
    ``token_cache_index``, ``context_lens``, ``draft_start`` and ``draft_visible``.
    """

    slot_mapping: torch.Tensor  # [T] flat cache slot written by each token
    block_tables: torch.Tensor  # [B, blocks] cache blocks of each sequence
    token_seq: torch.Tensor  # [T] sequence of each token
    token_query_index: torch.Tensor  # [T] position of the token among its sequence's queries
    mask: torch.Tensor | None  # [B, 1, Q, blocks * block_size] True where allowed; None on the kernel path
    max_query_len: int
    token_cache_index: torch.Tensor | None = None  # [T] cache index of each token (its causal limit)
    context_lens: torch.Tensor | None = None  # [B] cache entries of each sequence after this step
    draft_start: torch.Tensor | None = None  # [B] first cache index of the draft tree
    draft_visible: torch.Tensor | None = None  # [T, max_draft] int8: 1 where the token sees draft token j
    has_tree: bool = False
    use_decode_kernel: bool = False
    fresh_causal: bool = False  # whole prompts only: causal attention over the step's own keys, no mask
    split: "MixedStep | None" = None  # decode tokens, whole prompts and chunks apart: no mask over all of them


@dataclass
class MixedStep:
    """A step mixing kinds of sequences (continuous batching admitting requests while others decode), attended
    group by group: decode tokens by the decode kernel, whole prompts by causal SDPA over their own keys, and
    chunks after cached tokens by SDPA over their own blocks with a mask of their own. One dense mask over the
    whole step would pad every decode token to the longest chunk and every sequence to the widest table."""

    decode_rows: torch.Tensor | None = None  # [Td] token rows of the decode tokens
    decode_seq: torch.Tensor | None = None  # [Td] their sequences (rows of block_tables)
    decode_cache_index: torch.Tensor | None = None  # [Td] their cache indices
    # where the decode kernel does not run (CPU, attention_backend=sdpa): SDPA over each one's own blocks
    decode_tables: torch.Tensor | None = None  # [Td, blocks] their block tables
    decode_mask: torch.Tensor | None = None  # [Td, 1, 1, blocks * block_size]
    prompt_rows: torch.Tensor | None = None  # [Tp] token rows of the whole prompts
    prompt_slots: torch.Tensor | None = None  # [Tp] their cache slots
    prompt_seq: torch.Tensor | None = None  # [Tp] which prompt, 0..num_prompts-1
    prompt_query_index: torch.Tensor | None = None  # [Tp] index in its prompt
    num_prompts: int = 0
    longest_prompt: int = 0
    chunk_rows: torch.Tensor | None = None  # [Tc] token rows of the chunks
    chunk_seq: torch.Tensor | None = None  # [Tc] which chunk, 0..chunks-1
    chunk_query_index: torch.Tensor | None = None  # [Tc] index in its chunk
    chunk_tables: torch.Tensor | None = None  # [chunks, blocks] their block tables
    chunk_mask: torch.Tensor | None = None  # [chunks, 1, longest chunk, blocks * block_size]
    ragged: "RaggedCausal | None" = None  # on CUDA: whole prompts and chunks together, in place of the two above


@dataclass
class RaggedCausal:
    """Whole prompts and chunks after cached tokens as one varlen flash call (CUDA, fp16/bf16): the queries of
    each sequence laid end to end, and the cache slots of every key each one sees (its cached tokens, then its
    own). Causality aligned to the last key lets a chunk's query i see its cached tokens and own tokens 0..i:
    no mask, no padding, one kernel for the step however many prompts it carries."""

    rows: torch.Tensor | None  # [Tq] token rows, sequence by sequence; None: every row of the step, in order
    key_slots: torch.Tensor  # [Tk] cache slots of the keys, sequence by sequence
    cu_queries: torch.Tensor  # [S + 1] int32: where each sequence's queries start in ``rows``
    cu_keys: torch.Tensor  # [S + 1] int32: where its keys start in ``key_slots``
    longest_query: int
    longest_keys: int

    def attend(self, q, key_cache, value_cache, scale: float) -> torch.Tensor:
        kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
        keys = key_cache.view(-1, kv_heads, head_dim).index_select(0, self.key_slots)
        values = value_cache.view(-1, kv_heads, head_dim).index_select(0, self.key_slots)
        queries = q if self.rows is None else q.index_select(0, self.rows)
        varlen_attn, causal = flash_varlen()
        return varlen_attn(queries, keys, values, self.cu_queries, self.cu_keys, self.longest_query,
                           self.longest_keys, scale=scale, **causal)


@functools.cache
def flash_varlen() -> tuple | None:
    """torch's flash call over sequences laid end to end (torch >= 2.10; grouped KV heads taken as they are) and
    its causal keyword, or None. Imported on first use: its module pulls in torch._dynamo, 1.4 s of every process's
    start on this project's 2-core CPU (the CLI's, a server's, each rank's), where the call never runs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    # 2.10 spells causal is_causal=True; later releases a window of (-1, 0), aligned to the last key either way
    causal = (dict(window_size=(-1, 0)) if "window_size" in inspect.signature(varlen_attn).parameters
              else dict(is_causal=True))
    return varlen_attn, causal


def ragged_attention_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether :class:`RaggedCausal` runs here: flash's varlen kernel needs CUDA, half precision and a head
    size it was built for."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0
            and head_dim <= 256 and flash_varlen() is not None)


@dataclass
class DenseCausal:
    """Attention without a cache: ``num_seqs`` equal-length sequences laid end to end, each token seeing its
    own sequence's earlier tokens. For training and teacher-forced scoring (``zoo.pretrain``, ``zoo.train``)."""

    num_seqs: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        def batched(x):  # [T, H, D] -> [B, H, T / B, D]
            return x.view(self.num_seqs, -1, *x.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(q.shape)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False  # set by DecoderModel.use_fused_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, cast back, then scale: the order HF's Llama uses.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class MLPSums:
    """A decoder layer's MLP output still in the float32 sums that ``fused_ops.mlp_split_k`` adds into. The next
    norm takes it: rounded to the model dtype (where the down product would have rounded), the residual added, and
    the sums zeroed for the next layer's MLP (``add_norm``)."""

    def __init__(self, sums: torch.Tensor, dtype: torch.dtype):
        self.sums, self.dtype = sums, dtype

    def rounded(self) -> torch.Tensor:
        return self.sums.to(self.dtype)

    def take(self) -> torch.Tensor:
        out = self.rounded()
        self.sums.zero_()
        return out


def add_norm(norm: nn.Module, x: torch.Tensor | MLPSums, residual: torch.Tensor | None):
    """``(norm(x + residual), x + residual)``, a residual of None adding nothing; one kernel for RMSNorm on GPU."""
    accumulated = isinstance(x, MLPSums)
    if isinstance(norm, RMSNorm) and norm.fused:
        return fused_ops.add_rms_norm(x.sums if accumulated else x, residual, norm.weight, norm.eps,
                                      accumulated=accumulated)
    if accumulated:  # a plugin's norm: the sums as the model dtype, then the plain ops
        x = x.take()
    summed = x if residual is None else x + residual
    return norm(summed), summed


def make_norm(desc: ModelDescription) -> nn.Module:
    if desc.norm == "rms":
        return RMSNorm(desc.hidden_size, desc.norm_eps)
    return nn.LayerNorm(desc.hidden_size, eps=desc.norm_eps, bias=desc.norm_bias)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def rope_inverse_frequencies(desc: ModelDescription) -> torch.Tensor:
    """Plain RoPE frequencies; a plugin with scaled RoPE (llama3, linear) overrides ``Rotary.inverse_frequencies``."""
    dim = desc.head_dim
    return 1.0 / (desc.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


class Rotary(nn.Module):
    """Rotate-half RoPE on position row 0: the extension point for position layouts.

    One instance serves every layer: ``prepare`` turns the step's positions into
    tables once per forward pass, ``forward`` applies them to q and k. A plugin
    replaces ``model.model.rotary`` in ``zoo_model_build`` with a subclass for
    scaled frequencies (``inverse_frequencies``), 2-D or 3-D position rows
    (``prepare``) or another rotation (``forward``, with
    ``rotate_half_tables = False``).
    """

    # The tables are (cos, sin) of shape [T, 1, head_dim], applied as x*cos + rotate_half(x)*sin, so the
    # fused GPU kernel may apply them in place of ``forward``. A subclass that rotates differently sets False.
    rotate_half_tables = True

    def __init__(self, desc: ModelDescription):
        super().__init__()
        self.description = desc
        self.register_buffer("inv_freq", self.inverse_frequencies(), persistent=False)
        self.fused = False  # set by DecoderModel.use_fused_ops

    def inverse_frequencies(self) -> torch.Tensor:
        return rope_inverse_frequencies(self.description)

    def reset_buffers(self, device) -> None:
        self.inv_freq = self.inverse_frequencies().to(device)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.tables(positions[0], dtype)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype):
        """``rotate_half_tables`` for one row of positions at this module's frequencies: with fused ops on, one
        Triton launch instead of seven PyTorch kernels, the same bits."""
        if self.fused and fused_ops.STEP_INPUT_KERNELS:
            return fused_ops.rotate_half_tables(positions, self.inv_freq, dtype)
        return rotate_half_tables(positions, self.inv_freq, dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, tables):
        cos, sin = tables
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """(cos, sin), each ``[T, 1, 2 * len(inv_freq)]``, for one row of positions."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def write_cache(k, v, kv_cache, slot_mapping) -> None:
    """k, v: [T, Hkv, D] into kv_cache [2, blocks, block_size, Hkv, D] at the flat slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attend over the cache, which already holds this step's keys/values.

    q: [T, H, D]; kv_cache: [2, blocks, block_size, Hkv, D].
    """
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if meta.use_decode_kernel:
        from zoo.triton_attention import paged_decode_attention

        return paged_decode_attention(q, key_cache, value_cache, meta.block_tables, meta.context_lens,
                                      meta.token_seq, meta.token_cache_index, meta.draft_start, meta.draft_visible,
                                      scale, meta.has_tree)
    if meta.fresh_causal:
        return causal_over_own_keys(q, key_cache, value_cache, meta.slot_mapping, meta.token_seq,
                                    meta.token_query_index, meta.block_tables.shape[0], meta.max_query_len, scale)
    if meta.split is not None:
        return mixed_step_attention(q, key_cache, value_cache, meta, scale)
    return masked_attention(q, key_cache, value_cache, meta.block_tables, meta.mask, meta.token_seq,
                            meta.token_query_index, meta.max_query_len, scale)


def masked_attention(q, key_cache, value_cache, block_tables, mask, seq, query_index, longest: int,
                     scale: float) -> torch.Tensor:
    """SDPA over the sequences' gathered cache blocks with a dense mask ``[B, 1, longest, keys]``; each row of
    ``q`` is query ``query_index`` of sequence ``seq``."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    # index_select, not key_cache[block_tables]: the same copy, 3.5x faster on CPU (advanced indexing copies
    # element by element there), which made the gather half of a CPU decode step's attention. It takes no
    # negative index: a window's FREED entries (-1) wrap to the last block, the scratch block, as indexing would.
    blocks = block_tables.flatten().remainder(key_cache.shape[0])
    width = block_tables.shape[1] * key_cache.shape[1]
    keys = key_cache.index_select(0, blocks).view(-1, width, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, L, D]
    values = value_cache.index_select(0, blocks).view(-1, width, num_kv_heads, head_dim).transpose(1, 2)
    if longest == 1:  # pure decode: token i is sequence i, and a KV head's query heads are its query rows (one
        # call over [B, Hkv, group, D] instead of one per query head: 15% less SDPA time on CPU)
        return F.scaled_dot_product_attention(q.view(q.shape[0], num_kv_heads, -1, head_dim), keys, values,
                                              attn_mask=mask, scale=scale).reshape(q.shape)
    queries = q.new_zeros(block_tables.shape[0], longest, q.shape[1], head_dim)
    queries[seq, query_index] = q
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != num_kv_heads,
    ).transpose(1, 2)
    return out[seq, query_index]


def mixed_step_attention(q, key_cache, value_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    split = meta.split
    if split.ragged is not None and split.ragged.rows is None:  # the call's rows are the step's, in order
        return split.ragged.attend(q, key_cache, value_cache, scale)
    # rows by index_select and index_copy_: on CPU, q[rows] and out[rows] = ... copy element by element
    out = torch.empty_like(q)
    if split.decode_rows is not None:
        rows = split.decode_rows
        if split.decode_mask is None:
            from zoo.triton_attention import paged_decode_attention

            attended = paged_decode_attention(
                q.index_select(0, rows), key_cache, value_cache, meta.block_tables, meta.context_lens,
                split.decode_seq, split.decode_cache_index, meta.draft_start, None, scale, False)
        else:
            attended = masked_attention(q.index_select(0, rows), key_cache, value_cache, split.decode_tables,
                                        split.decode_mask, None, None, 1, scale)
        out.index_copy_(0, rows, attended)
    if split.ragged is not None:
        out.index_copy_(0, split.ragged.rows, split.ragged.attend(q, key_cache, value_cache, scale))
    if split.prompt_rows is not None:
        out.index_copy_(0, split.prompt_rows, causal_over_own_keys(
            q.index_select(0, split.prompt_rows), key_cache, value_cache, split.prompt_slots, split.prompt_seq,
            split.prompt_query_index, split.num_prompts, split.longest_prompt, scale))
    if split.chunk_rows is not None:
        out.index_copy_(0, split.chunk_rows, masked_attention(
            q.index_select(0, split.chunk_rows), key_cache, value_cache, split.chunk_tables, split.chunk_mask,
            split.chunk_seq, split.chunk_query_index, split.chunk_mask.shape[2], scale))
    return out


WHOLE_PROMPT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_over_own_keys(q, key_cache, value_cache, slots, seq, query_index, num_seqs: int, longest: int,
                         scale: float) -> torch.Tensor:
    """Whole prompts: each sequence's keys are exactly its tokens of this step, so SDPA runs causally on them
    (flash kernels) with no gather of cache blocks and no dense mask. Sequences are right-padded to the longest;
    causality keeps every real query off the padding. ``seq``/``query_index``: each row's sequence (0..num_seqs-1)
    and index in it; ``slots``: where the cache holds each row's key and value."""
    kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    keys = key_cache.view(-1, kv_heads, head_dim).index_select(0, slots)  # rotated, as the cache holds them
    values = value_cache.view(-1, kv_heads, head_dim).index_select(0, slots)

    def by_sequence(x):  # [T, heads, D] -> [B, heads, L, D]
        if num_seqs == 1:
            return x[None].transpose(1, 2)
        padded = x.new_zeros(num_seqs, longest, *x.shape[1:])
        padded[seq, query_index] = x
        return padded.transpose(1, 2)

    # Flash first: cuDNN's attention builds a plan per new shape, and whole-prompt steps come in many shapes.
    with sdpa_kernel(WHOLE_PROMPT_BACKENDS):
        out = F.scaled_dot_product_attention(by_sequence(q), by_sequence(keys), by_sequence(values), is_causal=True,
                                             scale=scale, enable_gqa=q.shape[1] != kv_heads).transpose(1, 2)
    return out[0] if num_seqs == 1 else out[seq, query_index]


class LinearWrapper(nn.Module):
    """A plugin's module around one of the model's Linear layers: ``base_layer(x) + delta(x)``.

    Wrap projections in ``zoo_model_modify`` by subclassing this and defining
    ``delta`` (a LoRA's ``B(A(x)) * scale``, read per token from the forward
    context). Fusion keeps working: fused q/k/v and gate/up run the base
    layers as one product and add each wrapper's ``delta`` to its slice.
    """

    def __init__(self, base_layer: nn.Linear):
        super().__init__()
        self.base_layer = base_layer

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.delta(x)


def base_linear(module: nn.Module) -> nn.Linear | None:
    """The plain Linear a projection computes with (through any wrappers), or None."""
    while isinstance(module, LinearWrapper):
        module = module.base_layer
    return module if type(module) is nn.Linear else None


def project(module: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``module(x)``; with fused ops on, a plain Linear runs ``fused_ops.projection`` (a Triton kernel at decode
    row counts where it beats cuBLAS). A plugin's wrapper keeps its own forward."""
    if fused and type(module) is nn.Linear:
        return fused_ops.projection(x, module.weight, module.bias)
    return module(x)


class FusedLinear(nn.Module):
    """Several projections of one input as one matrix product, plus the deltas of wrapped ones."""

    def __init__(self, parts: list[nn.Module], joint: nn.Linear):
        super().__init__()
        self.joint = joint
        self.sizes = [p.out_features for p in parts]
        self.wrapped = [(i, p) for i, p in enumerate(parts) if isinstance(p, LinearWrapper)]
        self.fused = False  # set by DecoderModel.use_fused_ops

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outputs = list(project(self.joint, x, self.fused).split(self.sizes, dim=-1))
        for i, wrapper in self.wrapped:
            outputs[i] = outputs[i] + wrapper.delta(x)
        return outputs

    def concatenated(self, x: torch.Tensor) -> torch.Tensor:
        """The parts' outputs side by side (one tensor, as the fused SiLU-and-mul kernel takes them)."""
        return torch.cat(self(x), dim=-1) if self.wrapped else project(self.joint, x, self.fused)


def fuse_linears(*parts: nn.Module) -> FusedLinear | None:
    """One product for several projections that read the same input; their weights become views of it.

    Wrapped projections (``LinearWrapper``) fuse through their base layer and add their delta;
    a projection a plugin replaced by something else keeps its own forward, and nothing is fused.
    """
    linears = [base_linear(m) for m in parts]
    if any(m is None for m in linears):
        return None
    has_bias = linears[0].bias is not None
    if any((m.bias is not None) != has_bias for m in linears):
        return None
    first = linears[0].weight
    joint = nn.Linear(first.shape[1], sum(m.out_features for m in linears), bias=has_bias,
                      device=first.device, dtype=first.dtype)
    with torch.no_grad():
        joint.weight.copy_(torch.cat([m.weight for m in linears]))
        if has_bias:
            joint.bias.copy_(torch.cat([m.bias for m in linears]))
    start = 0
    for m in linears:  # share storage, so the separate names still load and report the same values
        end = start + m.out_features
        m.weight = nn.Parameter(joint.weight[start:end], requires_grad=False)
        if has_bias:
            m.bias = nn.Parameter(joint.bias[start:end], requires_grad=False)
        start = end
    return FusedLinear(list(parts), joint)


class Attention(nn.Module):
    def __init__(self, desc: ModelDescription):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = desc.num_heads, desc.num_kv_heads, desc.head_dim
        self.q_proj = nn.Linear(desc.hidden_size, desc.num_heads * desc.head_dim, bias=desc.qkv_bias)
        self.k_proj = nn.Linear(desc.hidden_size, desc.num_kv_heads * desc.head_dim, bias=desc.qkv_bias)
        self.v_proj = nn.Linear(desc.hidden_size, desc.num_kv_heads * desc.head_dim, bias=desc.qkv_bias)
        self.o_proj = nn.Linear(desc.num_heads * desc.head_dim, desc.hidden_size, bias=desc.o_bias)
        self.scale = desc.attn_scale or 1.0 / math.sqrt(desc.head_dim)
        self.kv_cache: torch.Tensor | None = None  # set by the model runner
        self.qkv_proj: FusedLinear | None = None  # set by fuse_projections
        self.fused = False  # set by DecoderModel.use_fused_ops: rotary and the cache write as one kernel
        self.fused_projections = False  # set by DecoderModel.use_fused_ops

    def fuse_projections(self) -> None:
        self.qkv_proj = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, hidden, rope):
        """``rope``: (rotary module, its tables for this step), or None without rotary positions."""
        meta = get_forward_context().attention
        tokens = hidden.shape[0]
        rotary, tables = rope if rope is not None else (None, None)
        fused_rope = self.fused and (rotary is None or rotary.rotate_half_tables)
        cos, sin = (tables[0][:, 0], tables[1][:, 0]) if fused_rope and rotary is not None else (None, None)
        joint = self.qkv_proj.joint if self.qkv_proj is not None and not self.qkv_proj.wrapped else None
        folds = (fused_rope and joint is not None and not isinstance(meta, DenseCausal)
                 and fused_ops.folds_into_projection(hidden, joint.weight))
        if folds:
            q = fused_ops.qkv_rope_and_write_cache(
                hidden, joint.weight, joint.bias, cos, sin, self.kv_cache[0], self.kv_cache[1], meta.slot_mapping,
                self.num_heads, self.num_kv_heads)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(hidden)
            else:
                q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
            q = q.reshape(tokens, self.num_heads, self.head_dim)
            k = k.reshape(tokens, self.num_kv_heads, self.head_dim)
            v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
            if isinstance(meta, DenseCausal):
                if rotary is not None:
                    q, k = rotary(q, k, tables)
                attended = meta.attend(q, k, v, self.scale).reshape(tokens, self.num_heads * self.head_dim)
                return project(self.o_proj, attended, self.fused_projections)
            if fused_rope:
                q = fused_ops.rope_and_write_cache(q, k, v, cos, sin, self.kv_cache[0], self.kv_cache[1],
                                                   meta.slot_mapping)
            else:
                if rotary is not None:
                    q, k = rotary(q, k, tables)
                write_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = paged_attention(q, self.kv_cache, meta, self.scale)
        return project(self.o_proj, out.reshape(tokens, self.num_heads * self.head_dim), self.fused_projections)


class MLP(nn.Module):
    def __init__(self, desc: ModelDescription):
        super().__init__()
        self.gate_proj = (nn.Linear(desc.hidden_size, desc.intermediate_size, bias=desc.mlp_bias)
                          if desc.gated_mlp else None)
        self.up_proj = nn.Linear(desc.hidden_size, desc.intermediate_size, bias=desc.mlp_bias)
        self.down_proj = nn.Linear(desc.intermediate_size, desc.hidden_size, bias=desc.mlp_bias)
        self.act = ACTIVATIONS[desc.activation]
        self.gate_up_proj: FusedLinear | None = None  # set by fuse_projections
        self.fused = False  # set by DecoderModel.use_fused_ops
        # float32 [rows, hidden] zeros that fused_ops.mlp_split_k adds into, shared by the decoder's layers; set by
        # DecoderModel.use_fused_ops where the layer's output goes to a norm that takes MLPSums
        self.sums: torch.Tensor | None = None

    def fuse_projections(self) -> None:
        if self.gate_proj is not None:
            self.gate_up_proj = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x) -> torch.Tensor | MLPSums:
        if self.gate_up_proj is not None and self.fused and self.act is F.silu:
            joint = self.gate_up_proj.joint
            if not self.gate_up_proj.wrapped and fused_ops.folds_into_projection(x, joint.weight):
                down = self.down_proj
                if (self.sums is not None and x.shape[0] <= self.sums.shape[0] and type(down) is nn.Linear
                        and down.bias is None and joint.bias is None):
                    return MLPSums(fused_ops.mlp_split_k(x, joint.weight, down.weight, self.sums[:x.shape[0]]),
                                   x.dtype)
                activated = fused_ops.gate_up_silu(x, joint.weight, joint.bias)
            else:
                activated = fused_ops.silu_and_mul(self.gate_up_proj.concatenated(x))
            return project(self.down_proj, activated, True)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)
            return self.down_proj(self.act(gate) * up)
        if self.gate_proj is not None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, desc: ModelDescription):
        super().__init__()
        self.input_layernorm = make_norm(desc)
        self.self_attn = Attention(desc)
        self.post_attention_layernorm = make_norm(desc)
        self.mlp = MLP(desc)
        # The residual branch carries the sublayer's input (pre-norm), or its normalised input
        # times a factor (ChatGLM's alpha): ModelDescription.residual.
        self.residual_of_normed = desc.residual == "normed"
        self.residual_scale = desc.residual_scale
        self.parallel = None  # zoo.parallel.TensorParallel, set by DecoderModel.use_tensor_parallel

    def _residual(self, normed, summed):
        return normed * self.residual_scale if self.residual_of_normed else summed

    def forward(self, hidden, residual, rope):
        """Returns (mlp output, its residual): the add is left to the next norm, which fuses it."""
        normed, hidden = add_norm(self.input_layernorm, hidden, residual)
        residual = self._residual(normed, hidden)
        attended = summed(self.parallel, self.self_attn(normed, rope))
        normed, hidden = add_norm(self.post_attention_layernorm, attended, residual)
        return summed(self.parallel, self.mlp(normed)), self._residual(normed, hidden)


class Backbone(nn.Module):
    def __init__(self, desc: ModelDescription):
        super().__init__()
        self.embed_tokens = nn.Embedding(desc.vocab_size, desc.hidden_size)
        self.embed_positions = (nn.Embedding(desc.max_position, desc.hidden_size)
                                if desc.position == "learned" else None)
        self.rotary = Rotary(desc) if desc.position == "rope" else None  # shared by all layers
        self.layers = nn.ModuleList(DecoderLayer(desc) for _ in range(desc.num_layers))
        self.norm = make_norm(desc)


class DecoderModel(nn.Module):
    def __init__(self, desc: ModelDescription, hooks=None):
        super().__init__()
        self.description = desc
        self.model = Backbone(desc)
        self.lm_head = nn.Linear(desc.hidden_size, desc.vocab_size, bias=False)
        if desc.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.hooks = hooks  # pluggy hook relay, for zoo_embed_modify
        self.captured_layers: frozenset[int] = frozenset()  # layers whose outputs step results carry
        self.fused = False  # set by use_fused_ops
        self.parallel = None  # set by use_tensor_parallel
        self._sums_buffers: list[torch.Tensor] = []  # every float32 sums buffer use_fused_ops has made

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm, ``[num_tokens, hidden_size]``, for the forward context's step."""
        context = get_forward_context()
        hidden = self.token_embeddings(input_ids)
        if self.model.embed_positions is not None:
            hidden = hidden + self.model.embed_positions(positions[0])
        if self.hooks is not None:
            self.hooks.zoo_embed_modify(hidden=hidden, context=context, model=self)
        rotary = self.model.rotary
        rope = (rotary, rotary.prepare(positions, hidden.dtype)) if rotary is not None else None
        residual = None
        for i, layer in enumerate(self.model.layers):
            hidden, residual = layer(hidden, residual, rope)
            if i in self.captured_layers:
                context.layer_outputs[i] = (hidden.rounded() if isinstance(hidden, MLPSums) else hidden) + residual
        return add_norm(self.model.norm, hidden, residual)[0]

    def token_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Ids past the vocabulary are rows of a per-request table (prompt tuning's virtual tokens, TensorRT-LLM's
        # convention): an in-range embedding stands in until zoo_embed_modify writes the row.
        rows = self.model.embed_tokens.num_embeddings
        if self.parallel is None:
            embed = self.model.embed_tokens
            if self.fused and fused_ops.STEP_INPUT_KERNELS and type(embed) is nn.Embedding and embed.max_norm is None:
                return fused_ops.embedding(input_ids, embed.weight)
            return embed(input_ids.clamp(max=rows - 1))
        # This rank holds vocabulary rows [start, start + rows): the others' ids embed to zero, and the
        # all-reduce puts every row together.
        local = input_ids - self.parallel.vocab_start(rows)
        mine = (local >= 0) & (local < rows)
        embed = self.model.embed_tokens
        hidden = embed(local.clamp(0, rows - 1)) * mine[:, None].to(embed.weight.dtype)
        return self.parallel.all_reduce(hidden)

    def lm_head_weight(self) -> torch.Tensor:
        """The whole LM head ``[vocab, hidden]``, gathered from the ranks under tensor parallelism (for plugins
        that start their own heads from it)."""
        weight = self.lm_head.weight
        return weight if self.parallel is None else self.parallel.gather_vocab_rows(weight.detach())

    def use_tensor_parallel(self, parallel) -> None:
        """Run as one rank of a tensor-parallel split (``zoo.parallel``): the weights are this rank's slices."""
        self.parallel = parallel
        for layer in self.model.layers:
            layer.parallel = parallel

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up into single matrix products where the layers are still plain."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def use_fused_ops(self, on: bool = True) -> None:
        """Run RMSNorm(+add), rotary with the cache write and SiLU-and-mul as Triton kernels (GPU)."""
        desc = self.description
        head_ok = desc.head_dim % 2 == 0 and (desc.head_dim // 2) & (desc.head_dim // 2 - 1) == 0
        self.fused = on
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, FusedLinear, Rotary)):
                module.fused = on
            elif isinstance(module, Attention):
                module.fused = on and head_ok
                module.fused_projections = on
        # The decoder's own layers: each one's output goes to the next layer's norm or the final one. Under tensor
        # parallelism the MLP's output is all-reduced first, as the model dtype.
        # CUDA graphs captured earlier add into the buffer they were captured with: a buffer once made is kept for
        # the model's life (freed, its memory could become another tensor's), and a later call reuses it.
        sums = None
        if on and fused_ops.MLP_SPLIT_K and self.parallel is None:
            rows = fused_ops.PROJECTION_GEMV_MAX_ROWS
            sums = next((kept for kept in self._sums_buffers if kept.shape[0] >= rows), None)
            if sums is None:
                sums = torch.zeros(rows, desc.hidden_size, dtype=torch.float32, device=self.lm_head.weight.device)
                self._sums_buffers.append(sums)
        for layer in self.model.layers:
            layer.mlp.sums = sums

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.parallel is not None:  # this rank's vocabulary columns, then all of them on every rank
            return self.parallel.gather_vocab(self.lm_head(hidden).float())
        # With fused ops, the weight-streaming kernel: 5% faster than cuBLAS on a 128k vocabulary at decode batch
        # sizes (bench/results/gpu/round2/gemv.txt), and the logits come out as float32 without another launch.
        if self.fused and type(self.lm_head) is nn.Linear:  # rounded to the model dtype, stored as float32
            return fused_ops.linear(hidden, self.lm_head.weight, self.lm_head.bias, out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.model.layers]
