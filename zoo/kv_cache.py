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


def plan_num_blocks(runtime, kv: KVCache, profile_step, useful_blocks: int) -> tuple[int, int | None]:
    """``(blocks, peak bytes of a full step or None)`` from ``runtime.num_kv_blocks`` or the memory budget.

    On CUDA ``profile_step()`` runs the largest step (weights, plugins' buffers and activations
    included) and returns its peak; the cache takes what is left of the budget.
    """
    if runtime["num_kv_blocks"]:
        return int(runtime["num_kv_blocks"]), None
    per_block = kv.bytes_per_block()
    peak = None
    if kv.device.type == "cuda":
        peak = profile_step()
        _, total = torch.cuda.mem_get_info(kv.device)
        budget = total * float(runtime["gpu_memory_utilization"]) - peak
        if budget < per_block:
            raise ZooError(f"no GPU memory left for the KV cache: a step peaks at {peak / 2**30:.2f} GiB; raise "
                           "runtime.gpu_memory_utilization or lower runtime.max_num_batched_tokens")
    else:
        budget = float(runtime["cpu_kv_cache_gb"]) * 2**30
    return max(1, min(int(budget // per_block), useful_blocks)), peak
