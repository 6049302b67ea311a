"""What plugins may add at engine start (``zoo_engine_start``), and the run's device and dtype."""

from __future__ import annotations

import ctypes
import platform

import torch
from torch import nn

from zoo.errors import ZooError
from zoo.step import BufferSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def device_and_dtype(runtime) -> tuple[torch.device, torch.dtype]:
    device_name = runtime["device"]
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtype_name = runtime["dtype"]
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    if dtype_name not in DTYPES:
        raise ZooError(f"runtime.dtype={dtype_name!r} is not one of {', '.join(DTYPES)} or auto")
    return device, DTYPES[dtype_name]


# glibc's mallopt parameters, and the largest mmap threshold it accepts on 64-bit (its DEFAULT_MMAP_THRESHOLD_MAX)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_SERVED_BYTES = 32 << 20


def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to serve blocks up to 32 MB from its heap and to keep what is freed there, for the process.

    A CPU step allocates and frees the same tensors every time: the gathered KV blocks, the activations. By default
    malloc maps blocks above its threshold fresh and unmaps them on free, and trims the heap's top: each step then
    touches new pages, a page fault each 4 KB, and the kernel zeroes them. With the embedded model at 64 sequences
    that was 110-190k faults per 16k tokens. Kept, one compute thread gave 8513 output tok/s against 6692, and two
    9524 against 9039 (medians of 3, bench/results/cpu_keep_freed_memory.txt). The cost: the process keeps its
    peak working set of such blocks instead of handing it back between steps. Returns whether it applied (not on
    musl, macOS or Windows)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(None)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_SERVED_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


class EngineSetup:
    """Handed to ``zoo_engine_start``: the model runner exists, the KV cache is not sized yet."""

    def __init__(self, runner):
        self.runner = runner
        self.cache_lookahead = 0

    def key_blocks_on_next_tokens(self, count: int) -> None:
        """Cached blocks also depend on the ``count`` tokens after them (a draft layer pairing each position
        with the next token): prefix caching then shares a block only where those tokens are equal too."""
        self.cache_lookahead = max(self.cache_lookahead, count)

    @property
    def limits(self):
        """The runner's :class:`zoo.model_runner.RunnerLimits` (tokens, sequences, blocks per step)."""
        return self.runner.limits

    def add_buffer(self, spec: BufferSpec) -> torch.Tensor:
        """A static per-step tensor of the largest shape; each step sees it cut to its size. Returns it whole."""
        try:
            self.runner.add_buffer(spec)
        except ValueError as exc:
            raise ZooError(str(exc)) from None
        return self.runner.buffers[spec.name]

    def add_graph_pass(self, name: str, stride: int, body, tree: bool = False) -> None:
        """A forward pass of the plugin's own (a draft model's) over the step buffers, ``stride`` rows per
        sequence; on CUDA it is captured as graphs per batch size next to the model's steps.

        ``body(context)`` runs under the forward context and returns a tuple of tensors; ``tree`` passes see
        draft ancestors through ``draft_visible``. Run it with :meth:`zoo.model_runner.ModelRunner.run_pass`.
        """
        from zoo.cuda_graphs import GraphFamily
        try:
            self.runner.graphs.add(GraphFamily(name, stride, tree, body))
        except ValueError as exc:
            raise ZooError(str(exc)) from None

    def add_graph_variant(self, name: str, when) -> None:
        """Capture the model's decode and verify graphs once more with ``context.graph_variant = name``;
        a step for which ``when(scheduled)`` holds replays those. For work inside the model that only some
        steps need (LoRA's products): the plain graphs skip it, so steps without it cost nothing extra."""
        try:
            self.runner.graphs.add_variant(name, when)
        except ValueError as exc:
            raise ZooError(str(exc)) from None

    def run_eagerly_when(self, when) -> None:
        """Steps for which ``when(scheduled)`` holds run eagerly, never as a graph: for work inside the model that
        reads the step's requests (``context.batch``, which is None in a graph), such as prompt embeddings a
        plugin replaces. Prompt steps and steps mixing prompts with decodes replay graphs too
        (``runtime.prompt_graph_tokens``, ``runtime.mixed_graph_tokens``), so such a plugin must say which steps
        carry its work."""
        self.runner.graphs.eager_when.append(when)

    def add_kv_layers(self, modules: list[nn.Module]) -> None:
        """Give attention modules (a draft model's) cache layers from the model's block pool.

        Each gets ``.kv_cache`` (``[2, blocks + 1, block_size, kv_heads, head_dim]``, re-set
        whenever the cache is allocated) and is addressed by the step's block tables and
        slot mapping, like the model's own layers; it counts in the cache's memory budget.
        """
        self.runner.kv.add_layers(list(modules))

    def capture_layers(self, indices) -> None:
        """Keep these decoder layers' outputs each step (``StepResults.layer_states``)."""
        num_layers = self.runner.description.num_layers
        bad = [i for i in indices if not (isinstance(i, int) and 0 <= i < num_layers)]
        if bad:
            raise ZooError(f"cannot capture layers {bad}: the model has layers 0..{num_layers - 1}")
        self.runner.model.captured_layers = self.runner.model.captured_layers | frozenset(indices)
