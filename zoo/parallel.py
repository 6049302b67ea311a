"""Tensor parallelism over torch.distributed (Megatron-style): one model split across processes.

Every rank holds a slice of each layer: q/k/v and gate/up by output rows (heads, intermediate columns), o and
down by input columns, the embedding and LM head by vocabulary rows, so each layer's two products end in one
all-reduce and the logits in one all-gather. A rank's KV cache holds only its KV heads (all of them are kept
when there are fewer KV heads than ranks: each rank then holds the one its query heads read).

The processes come from ``torchrun`` (or any launcher that sets the usual RANK / WORLD_SIZE / MASTER_ADDR
environment); gloo on CPU, NCCL on GPUs. Every rank runs the same engine on the same requests, but only rank 0's
scheduler decides: besides the model's own collectives, one small all-gather per step hands its decisions to the
other ranks, which replay them, and compares the ranks' scheduler fingerprints (``share_schedule``).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from zoo.description import ModelDescription
from zoo.errors import ZooError
from zoo.scheduler import LOG_WIDTH

COLLECTIVE_TIMEOUT_S = 300  # a rank that dies or hangs ends the others' collectives with an error, not a hang


@dataclasses.dataclass
class TensorParallel:
    rank: int
    world: int
    vocab_size: int  # the whole vocabulary, before padding to a multiple of the ranks
    device: torch.device  # where the collectives' own small tensors live (NCCL reduces only GPU tensors)
    hooks: object = None  # the plugins' zoo_tensor_parallel_split rules, consulted before the core's

    def all_reduce(self, x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        with self._collective("all-reduce"):
            dist.all_reduce(x, op=op)
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor:
        """``[rows, vocab / ranks]`` on each rank -> ``[rows, vocab]`` on every rank."""
        return self._all_gather(local, dim=-1)[:, :self.vocab_size]

    def gather_vocab_rows(self, local: torch.Tensor) -> torch.Tensor:
        """``[vocab / ranks, hidden]`` rows on each rank -> the whole ``[vocab, hidden]`` on every rank."""
        return self._all_gather(local, dim=0)[:self.vocab_size]

    def _all_gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(self.world)]
        with self._collective("all-gather"):
            dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=dim)

    def share_schedule(self, scheduler, drafts: dict):
        """This step's entries, as rank 0's scheduler decides them. One all-gather of a fixed-size row per rank:
        rank 0's holds its scheduler's fingerprint before the step and its decisions (``Scheduler.schedule``'s
        log), the others' their fingerprints; they replay the decisions on their own copies of the requests. Ranks
        whose state differs from rank 0's stop, all of them, with a clear error, not a collective of mismatched
        sizes later."""
        # At most: a preemption and an entry per running request, one reset, the closing count.
        width = 2 + LOG_WIDTH * (2 * scheduler.max_num_seqs + 2)
        row, log = [scheduler.fingerprint()], []
        scheduled = scheduler.schedule(drafts, log=log) if self.rank == 0 else None
        row += [len(log), *log]
        if len(row) > width:
            raise RuntimeError(f"a schedule log of {len(log)} integers outgrew its row of {width}; this is a bug")
        rows = torch.zeros(self.world, width, dtype=torch.int64, device=self.device)
        mine = torch.tensor(row + [0] * (width - len(row)), dtype=torch.int64, device=self.device)
        with self._collective("all-gather"):
            dist.all_gather(list(rows.unbind(0)), mine)
        rows = rows.tolist()
        if any(r[0] != rows[0][0] for r in rows):
            raise ZooError(f"tensor-parallel rank {self.rank} of {self.world}: the ranks disagree on this step's "
                           f"schedule; every rank must be given the same requests in the same order")
        if scheduled is None:
            scheduled = scheduler.replay(rows[0][2:2 + rows[0][1]], drafts)
        return scheduled

    def from_rank0(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank: what only rank 0 reads, such as the input."""
        box = [value]
        with self._collective("broadcast"):
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree_on_min(self, value: int) -> int:
        """The smallest of the ranks' values (KV blocks: every rank must schedule the same cache)."""
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64, device=self.device),
                                   op=dist.ReduceOp.MIN)[0])

    @contextlib.contextmanager
    def _collective(self, what: str):
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:  # a rank died, hung past the timeout, or failed
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ZooError(f"tensor-parallel rank {self.rank} of {self.world}: the {what} failed, so another "
                           f"rank has stopped or failed ({first[:200]})") from None

    def vocab_start(self, local_vocab: int) -> int:
        return self.rank * local_vocab


def summed(parallel: TensorParallel | None, partial: torch.Tensor) -> torch.Tensor:
    """A row-split product's output (o, down: each rank holds a partial sum) made whole; as is without a split."""
    return partial if parallel is None else parallel.all_reduce(partial)


def start(size: int, device: torch.device, vocab_size: int, hooks=None) -> TensorParallel | None:
    """The rank's place in a ``size``-way split, joining the launcher's process group; None for size 1."""
    if size == 1:
        return None
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise ZooError(f"runtime.tensor_parallel_size={size} runs one process per rank: launch with "
                           f"torchrun --nproc-per-node {size} -m zoo.run ... (or -m your script)")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        atexit.register(leave)
    if dist.get_world_size() != size:
        raise ZooError(f"runtime.tensor_parallel_size={size}, but the launcher started {dist.get_world_size()} "
                       f"processes")
    return TensorParallel(dist.get_rank(), size, vocab_size, device, hooks)


def leave() -> None:
    """Leave the process group cleanly: wait for every rank, then close it. A rank whose peers close their
    connections while it is still in the group can die in gloo's threads ("terminate called without an active
    exception"). Runs at exit; processes that skip exit handlers (multiprocessing's) call it themselves."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a rank already gone: close this one's side anyway
        pass
    dist.destroy_process_group()


def end_rank(status: int) -> None:
    """End this process with ``status`` if it is a rank of a process group, once its work is written: leave the
    group, flush, and exit without the interpreter's teardown; return otherwise.

    Twice in CI a rank died of SIGABRT at the end of its run ("terminate called without an active exception": a C++
    thread object destroyed while its thread runs, presumably gloo's): a test's rank 0, and ``zoo.run``'s rank 1
    under torchrun, which turned the run's exit status into 1. Neither came back in 50 targeted runs, so which step
    of the teardown races is not known. Exiting here skips the interpreter's finalization and the C++ destructors,
    where such a thread would be destroyed."""
    if not dist.is_initialized():
        return
    leave()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


def split_description(desc: ModelDescription, world: int) -> ModelDescription:
    """The shapes one rank holds: its heads, KV heads, intermediate columns and vocabulary rows."""
    problems = []
    if desc.num_heads % world:
        problems.append(f"{desc.num_heads} attention heads")
    if desc.num_kv_heads % world and world % desc.num_kv_heads:
        problems.append(f"{desc.num_kv_heads} KV heads")
    if desc.intermediate_size % world:
        problems.append(f"intermediate size {desc.intermediate_size}")
    if problems:
        raise ZooError(f"runtime.tensor_parallel_size={world} does not divide this model's "
                       + " or ".join(problems))
    return dataclasses.replace(desc, num_heads=desc.num_heads // world,
                               num_kv_heads=max(1, desc.num_kv_heads // world),
                               intermediate_size=desc.intermediate_size // world,
                               vocab_size=-(-desc.vocab_size // world), head_dim=desc.head_dim)


def shard_of(name: str, full: ModelDescription, parallel: TensorParallel):
    """How a rank reads the tensor of zoo parameter ``name``:
    ``(dim, start, length)`` for a slice, "zeros" for a row-parallel bias on ranks past 0 (the all-reduce adds
    rank 0's), or None for a replicated tensor."""
    r, w, d = parallel.rank, parallel.world, full.head_dim
    if parallel.hooks is not None:
        declared = parallel.hooks.zoo_tensor_parallel_split(name=name, description=full, rank=r, world=w)
        if declared is not None:
            return None if declared == "whole" else declared
    if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
        heads = full.num_heads // w
        return 0, r * heads * d, heads * d
    if any(name.endswith(f"self_attn.{p}.{kind}") for p in ("k_proj", "v_proj") for kind in ("weight", "bias")):
        if full.num_kv_heads >= w:
            heads = full.num_kv_heads // w
            return 0, r * heads * d, heads * d
        return 0, (r * full.num_kv_heads // w) * d, d  # fewer KV heads than ranks: the one this rank's queries read
    if any(name.endswith(f"mlp.{p}.{kind}") for p in ("gate_proj", "up_proj") for kind in ("weight", "bias")):
        cols = full.intermediate_size // w
        return 0, r * cols, cols
    if name.endswith("self_attn.o_proj.weight"):
        heads = full.num_heads // w
        return 1, r * heads * d, heads * d
    if name.endswith("mlp.down_proj.weight"):
        cols = full.intermediate_size // w
        return 1, r * cols, cols
    if name.endswith("self_attn.o_proj.bias") or name.endswith("mlp.down_proj.bias"):
        return None if r == 0 else "zeros"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        rows = -(-full.vocab_size // w)
        return 0, r * rows, rows
    return None


def take_shard(source, shape: tuple, zoo_name: str, full: ModelDescription, parallel: TensorParallel,
               target_shape: tuple) -> torch.Tensor:
    """This rank's part of ``source`` (a tensor, or a safetensors slice, which reads only what is indexed)."""
    rule = shard_of(zoo_name, full, parallel)
    if rule is None:
        return source[:]
    if rule == "zeros":
        return torch.zeros(target_shape)
    dim, first, length = rule
    last = min(first + length, shape[dim])
    tensor = source[first:last] if dim == 0 else source[:, first:last]
    if tensor.shape[dim] < length:  # the vocabulary's last rows: padded with zeros to the shard size
        pad = list(tensor.shape)
        pad[dim] = length - tensor.shape[dim]
        tensor = torch.cat([tensor, tensor.new_zeros(pad)], dim=dim)
    return tensor


def read_shard(reader, name: str, full: ModelDescription, parallel: TensorParallel,
               target_shape: tuple) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``name`` (named as the model's parameter), read without the rest."""
    piece = reader.get_slice(name)
    return take_shard(piece, tuple(piece.get_shape()), name, full, parallel, target_shape)


def split_module(module: torch.nn.Module, build, full: ModelDescription, parallel: TensorParallel,
                 whole: tuple[str, ...] = ()) -> torch.nn.Module:
    """``build(this rank's description)`` holding this rank's slices of ``module``'s parameters (same names, the
    target's rules: a plugin's decoder layer, such as EAGLE's draft, splits as the model's layers do). Names in
    ``whole`` stay whole on every rank (a draft's own head); buffers are copied as they are."""
    local = build(split_description(full, parallel.world))
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, param in local.named_parameters():
            source = params[name]
            param.copy_(source if name in whole else
                        take_shard(source, tuple(source.shape), name, full, parallel, tuple(param.shape)))
        buffers = dict(module.named_buffers())
        for name, buffer in local.named_buffers():
            if name in buffers and buffers[name].shape == buffer.shape:
                buffer.copy_(buffers[name])
    return local
