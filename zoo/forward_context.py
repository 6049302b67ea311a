"""The step a forward pass is computing, reachable from any module while it runs.

The model runner sets the context around every forward pass (and around CUDA
graph capture), so a module deep inside the model (an adapter-wrapped Linear,
a draft head, an extra attention layer) reads the step's metadata and buffers
without arguments threaded through the model:

    from zoo.forward_context import get_forward_context

    def forward(self, x):
        adapter = get_forward_context().buffers["adapter_index"]   # [num_tokens]

Everything in it is a view of a static buffer, so a graph captured once reads
each replay's values: use tensor operations on it, never Python values taken
from it (``context.batch`` is ``None`` inside a captured graph).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

if TYPE_CHECKING:
    from zoo.model import AttentionMetadata
    from zoo.step import StepBatch


@dataclass
class ForwardContext:
    attention: "AttentionMetadata"  # slot mapping, block tables, context lengths, query layout, mask
    buffers: dict[str, torch.Tensor]  # every core and plugin buffer, cut to the step's size
    batch: "StepBatch | None"  # the scheduled requests; None while a CUDA graph is captured
    # Outputs of the decoder layers that plugins asked for at engine start, by layer index.
    layer_outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    graph_variant: str | None = None  # while a graph is captured: the variant it is for (zoo.cuda_graphs)

    @property
    def positions(self) -> torch.Tensor:
        return self.buffers["positions"]  # [position_rows, num_tokens]

    @property
    def num_tokens(self) -> int:
        return self.buffers["input_ids"].shape[0]


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, context
    try:
        yield context
    finally:
        _current = previous


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward pass is running: the forward context exists only inside one")
    return _current
