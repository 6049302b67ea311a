"""The paged KV cache: one tensor, one block pool, for every attention layer.

The model's layers and any a plugin adds at engine start (a draft model's)
index the same blocks through the same block tables and slots, so a
sequence's blocks hold K/V for all of them. One scratch block past the pool
takes the writes of padded CUDA-graph rows.
"""

from __future__ import annotations

import torch
from torch import nn

from zoo.description import ModelDescription
from zoo.errors import ZooError


class KVCache:
    def __init__(self, description: ModelDescription, block_size: int, dtype: torch.dtype, device: torch.device):
        self.description = description
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.layers: list[nn.Module] = []  # attention modules; each gets .kv_cache, [2, blocks + 1, block, Hkv, D]
        self.tensor: torch.Tensor | None = None
        self.num_blocks = 0
        self.scratch_block = 0

    def add_layers(self, modules: list[nn.Module]) -> None:
        """Attention modules (``num_kv_heads``, ``head_dim`` as the model's) that read and write the cache."""
        desc = self.description
        for module in modules:
            shape = (getattr(module, "num_kv_heads", None), getattr(module, "head_dim", None))
            if shape != (desc.num_kv_heads, desc.head_dim):
                raise ZooError(f"a KV-cache layer needs {desc.num_kv_heads} KV heads of size {desc.head_dim} "
                               f"(the model's); {type(module).__name__} has {shape}")
            self.layers.append(module)

    def bytes_per_block(self) -> int:
        desc = self.description
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * desc.num_kv_heads * desc.head_dim * itemsize

    def allocate(self, num_blocks: int) -> None:
        """Blocks ``0..num_blocks-1`` for requests, plus the scratch block after them."""
        self.release()
        desc = self.description
        self.tensor = torch.zeros(len(self.layers), 2, num_blocks + 1, self.block_size, desc.num_kv_heads,
                                  desc.head_dim, dtype=self.dtype, device=self.device)
        self.num_blocks = self.scratch_block = num_blocks
        for i, module in enumerate(self.layers):
            module.kv_cache = self.tensor[i]

    def release(self) -> None:
        self.tensor = None
        for module in self.layers:
            module.kv_cache = None

    def slots(self, block_ids: list[int], indices: list[int]) -> list[int]:
        """Flat cache slots of a sequence's cache indices."""
        bs = self.block_size
        return [block_ids[i // bs] * bs + i % bs for i in indices]

    def move_slots(self, sources: list[int], targets: list[int]) -> None:
        """Copy K/V of slots ``sources`` to ``targets`` in every layer (compacting accepted drafts): all reads
        happen before any write, so one call serves a whole step."""
        if not sources:
            return
        flat = self.tensor.view(self.tensor.shape[0], 2, -1, *self.tensor.shape[-2:])
        flat[:, :, torch.tensor(targets, device=self.device)] = flat[:, :, torch.tensor(sources, device=self.device)]

    def copy_blocks(self, sources: list[int], targets: list[int]) -> None:
        """Copy whole blocks' K/V in every layer (a forked beam's copy of a block it shares)."""
        if sources:
            index = torch.tensor(sources, device=self.device)
            self.tensor[:, :, torch.tensor(targets, device=self.device)] = self.tensor[:, :, index]


def plan_num_blocks(runtime, kv: KVCache, profile_step, useful_blocks: int,
                    allocated_before: int = 0) -> tuple[int, int | None]:
    """``(blocks, peak bytes of a full step or None)`` from ``runtime.num_kv_blocks`` or the memory budget.

    On CUDA the cache takes what is left of ``gpu_memory_utilization`` x the device's memory once this
    engine's own peak is counted: ``profile_step()`` runs the largest step (weights, plugins' buffers and
    activations included) and returns the process's peak, of which ``allocated_before`` (tensors that
    were there before this engine started, another engine's for one) is not this engine's. Like vLLM,
    the cache is not capped by what ``max_num_seqs`` sequences of ``max_model_len`` can use: more blocks
    keep more prefixes cached. It never takes more than is free: an engine started beside another (or
    beside another process) gets what is left, and one error line when that is not one block, instead
    of running out of memory in a step.
    On CPU ``cpu_kv_cache_gb`` is the budget, capped at ``useful_blocks``.
    """
    if runtime["num_kv_blocks"]:
        return int(runtime["num_kv_blocks"]), None
    per_block = kv.bytes_per_block()
    if kv.device.type != "cuda":
        budget = float(runtime["cpu_kv_cache_gb"]) * 2**30
        return max(1, min(int(budget // per_block), useful_blocks)), None
    peak = profile_step()
    own_peak = peak - allocated_before
    activations = peak - torch.cuda.memory_allocated(kv.device)  # needed again by every full step
    free, total = torch.cuda.mem_get_info(kv.device)
    unused_reserved = torch.cuda.memory_reserved(kv.device) - torch.cuda.memory_allocated(kv.device)
    share = total * float(runtime["gpu_memory_utilization"]) - own_peak
    budget = min(share, free + unused_reserved - activations)
    if budget < per_block:
        raise ZooError(f"no GPU memory left for the KV cache: this engine peaks at {own_peak / 2**30:.2f} GiB "
                       f"of its {total * float(runtime['gpu_memory_utilization']) / 2**30:.2f} GiB share "
                       f"(runtime.gpu_memory_utilization), {free / 2**30:.2f} GiB free on the device; raise "
                       "runtime.gpu_memory_utilization, lower runtime.max_num_batched_tokens or free the device")
    return int(budget // per_block), peak
