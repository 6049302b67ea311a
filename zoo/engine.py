"""The engine: start-up wiring, then ``step()`` = propose -> schedule -> prepare -> run -> commit -> report."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from zoo import fused_ops, parallel
from zoo.adapters import Adapters
from zoo.beam_search import BeamSearch
from zoo.block_manager import BlockManager
from zoo.commit import Committer
from zoo.decoding import choose_method, draft_limit, fit_drafts
from zoo.engine_setup import EngineSetup, device_and_dtype, keep_freed_host_memory
from zoo.errors import ZooError
from zoo.intake import RequestIntake
from zoo.kv_cache import plan_num_blocks
from zoo.loader import load_model, open_checkpoint
from zoo.model_runner import ModelRunner, RunnerLimits
from zoo.plugins import architecture_owners, load_plugins, select_plugins
from zoo.request import Request
from zoo.sampler import Sampler
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest, Scheduler
from zoo.settings import check_settings
from zoo.stats import EngineStats, summary
from zoo.step import StepBatch, StepResults
from zoo.step_inputs import int64_tensor


def check_model_option(model, architecture: str, plugin_manager) -> None:
    """A model option other than ``llama`` names the plugin of its architectures (``plugin`` in its yaml): a
    checkpoint of another plugin's architecture is an error, not a silent switch."""
    expected = model.get("plugin") if hasattr(model, "get") else None
    owner = architecture_owners(plugin_manager).get(architecture, (None,))[0]
    if expected and model.get("path") and owner != expected:
        raise ZooError(f"model={model.get('name')} is for checkpoints of plugin {expected}, but {model.get('path')} "
                       f"holds {architecture} (plugin {owner}); leave out model= (model=llama takes any "
                       f"architecture) or choose the option for it")


@dataclass
class InFlight:
    """A step of plain decodes launched but not committed: its argmax on its way to the host."""

    batch: StepBatch
    output: object  # StepOutput; a graph's outputs, which the next replay overwrites
    tokens: torch.Tensor  # [rows] on the device
    host_tokens: torch.Tensor  # the same, copied to (pinned) host memory
    copied: object  # CUDA event after the copy, None on CPU
    unrecorded_s: float  # host time spent launching it, counted when it is committed


class Engine:
    def __init__(self, config, extra_plugins=()):
        """``config`` is the composed run config (``conf/``: every key has its default there)."""
        check_settings(config)
        self.config = config
        runtime = config["runtime"]
        self.plugin_manager = load_plugins(disable=config["plugins"]["disable"] or (), extra=extra_plugins)
        self.hooks = self.plugin_manager.hook
        self.device, self.dtype = device_and_dtype(runtime)
        if self.device.type == "cpu" and runtime["cpu_keep_freed_memory"]:
            keep_freed_host_memory()
        # What the process held before this engine: not counted in its gpu_memory_utilization share.
        self.allocated_before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        self.checkpoint = open_checkpoint(config["model"], self.plugin_manager)
        self.description, self.tokenizer = self.checkpoint.description, self.checkpoint.tokenizer
        check_model_option(config["model"], self.description.architecture, self.plugin_manager)
        if runtime["sliding_window"]:
            self.description.sliding_window = int(runtime["sliding_window"])
        if runtime["attention_sinks"]:
            if not self.description.sliding_window:
                raise ZooError("runtime.attention_sinks needs a sliding window: the model's own or "
                               "runtime.sliding_window=N")
            self.description.attention_sinks = int(runtime["attention_sinks"])
        # From here on only the plugins that take part in this run are called.
        self.plugins = select_plugins(self.plugin_manager, config, self.description.architecture)
        # Before the weights load, so that a bad decoding setting costs no loading time.
        self.draft_batch_limit = draft_limit(config["decoding"], "disable_by_batch_size")
        self.draft_step_tokens = draft_limit(config["decoding"], "draft_tokens_per_step")
        self.decoding = choose_method(self.plugin_manager, config["decoding"]["name"], self)
        if (self.decoding is not None and int(runtime["tensor_parallel_size"]) > 1
                and not getattr(self.decoding, "splits_over_ranks", False)):
            raise ZooError(f"decoding={self.decoding.name} does not split over tensor-parallel ranks yet "
                           f"(runtime.tensor_parallel_size > 1)")
        self.adapters = Adapters(self.plugin_manager, self)
        self.parallel = parallel.start(int(runtime["tensor_parallel_size"]), self.device,
                                       self.description.vocab_size, self.hooks)
        self.model = load_model(self.checkpoint, self.hooks, self.dtype, self.device, self.parallel)
        self.hooks.zoo_model_modify(model=self.model, description=self.description, config=config)
        self.model.fuse_projections()
        self.uses_fused_ops = self.device.type == "cuda" and fused_ops.available() and bool(runtime["fused_ops"])
        self.model.use_fused_ops(self.uses_fused_ops)
        self.max_model_len = min(self.description.max_position, runtime["max_model_len"] or 1 << 62)
        self.block_size = int(runtime["block_size"])
        self.runner = self._start_runner(runtime)
        self.blocks = BlockManager(self.num_blocks, self.block_size, bool(runtime["enable_prefix_caching"]),
                                   self.setup.cache_lookahead)
        self.scheduler = Scheduler(self.blocks, int(runtime["max_num_seqs"]), int(runtime["max_num_batched_tokens"]),
                                   step_resource=self.adapters.step_resource,
                                   # Holding arrivals back pays only where decode steps replay CUDA graphs and
                                   # prompt steps do not; eager, every step costs alike (on CPU it lost 10-20%).
                                   admission_interval=int(runtime["admission_interval"]) if self.uses_cuda_graphs
                                   else 1)
        self.sampler = Sampler(self.hooks, self, int(runtime["seed"]), self.device, self.description.eos_token_ids)
        self.stats = EngineStats()
        self.intake = RequestIntake(self)
        self.beam_search = BeamSearch(self)
        self.committer = Committer(self)
        self.draft_failures = 0  # steps whose drafts the decoding method failed to propose
        # Overlapped steps: a plain decode step's successor is launched before the step is committed, so the
        # host's commit (and the next layout) runs while the GPU computes. See _launch_next.
        self.overlap_steps = bool(runtime["overlap_steps"])
        self.step_result_hooks = bool(self.hooks.zoo_step_results.get_hookimpls())
        self.inflight: InFlight | None = None
        self.held_samples: dict[int, list[Request]] = {}  # first sample's id -> the samples waiting for its prompt
        self.overlapped_steps = 0
        self.advanced_in_place = 0  # overlapped steps whose inputs the device advanced from the step before
        self._token_buffers = ([torch.empty(int(runtime["max_num_seqs"]), dtype=torch.int64, pin_memory=True)
                                for _ in range(2)] if self.overlap_steps and self.device.type == "cuda" else None)
        self._next_buffer = 0

    def _start_runner(self, runtime) -> ModelRunner:
        """The runner, what plugins add at engine start, the KV cache sized around both, then graphs."""
        max_num_seqs, max_tokens = int(runtime["max_num_seqs"]), int(runtime["max_num_batched_tokens"])
        max_draft = self.decoding.max_draft_tokens if self.decoding else 0
        blocks_per_seq = -(-(self.max_model_len + max_draft) // self.block_size)
        limits = RunnerLimits(max_tokens + max_num_seqs * max_draft, self.max_model_len, max_num_seqs,
                              blocks_per_seq, self.block_size, max_draft)
        try:
            # The model's own description: under tensor parallelism, this rank's heads (its KV cache's shape).
            runner = ModelRunner(self.model, self.model.description, limits, self.dtype, self.device, self.hooks,
                                 attention_backend=str(runtime["attention_backend"]))
        except ValueError as exc:
            raise ZooError(str(exc)) from None
        self.setup = EngineSetup(runner)
        self.hooks.zoo_engine_start(engine=self, setup=self.setup)
        self.num_blocks, self.profile_peak_bytes = plan_num_blocks(runtime, runner.kv, runner.profile_peak_memory,
                                                                   blocks_per_seq * max_num_seqs, self.allocated_before)
        if self.parallel is not None:  # the same schedule on every rank needs the same cache
            self.num_blocks = self.parallel.agree_on_min(self.num_blocks)
        runner.kv.allocate(self.num_blocks)
        self.uses_cuda_graphs = (self.device.type == "cuda" and bool(runtime["cuda_graphs"])
                                 and not runtime["enforce_eager"] and runner.decode_kernel)
        if self.uses_cuda_graphs:
            runner.graphs.capture(prompt_tokens=int(runtime["prompt_graph_tokens"]),
                                  mixed_tokens=int(runtime["mixed_graph_tokens"]))
        return runner

    # ---------------------------------------------------------------- requests

    def add_request(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, extras: dict | None = None,
                    source_dir=None) -> Request:
        """Queue a request; an invalid one comes back already finished with an error. ``source_dir``: the
        folder its relative file paths are read from (the input file's), else the working directory."""
        return self.intake.add(prompt, prompt_token_ids, params or SamplingParams(), extras or {}, source_dir)

    def reject(self, message: str, output_id=None) -> Request:
        """A request that never enters the scheduler: finished with ``error``."""
        return self.intake.reject(message, output_id=output_id)

    def has_work(self) -> bool:
        return self.inflight is not None or self.scheduler.has_work() or bool(self.held_samples)

    def abort(self, request: Request) -> None:
        """End ``request`` now (its client went away): it and its samples or beams leave the scheduler and
        give back their blocks; a step already launched for it has its tokens dropped at commit."""
        group = request.group
        members = list(group.samples or [group]) + self.beam_search.forget(group)
        self.held_samples.pop(group.request_id, None)
        for member in members:
            if not member.is_finished:
                member.finish("abort")
                self.finish(member)

    def finish(self, request: Request) -> None:
        if request.request_id in self.held_samples:  # ended before its first token: its samples go on alone
            self.intake.release_samples(request)
        self.scheduler.finish(request)
        if not request.output_text:
            request.output_text = self.tokenizer.decode(request.output_token_ids)
        self.hooks.zoo_request_finished(request=request)

    # ---------------------------------------------------------------- step

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one forward pass; returns ``(request, new_token_ids)`` for requests that advanced.

        With ``runtime.overlap_steps``, a step of plain decodes is committed one call later: the call that
        launches it returns nothing, and each later call launches the next step before committing this one.
        """
        start = time.perf_counter()
        if self.held_samples and not self.scheduler.has_work() and self.inflight is None:
            for first in [r for held in self.held_samples.values() for r in held[:1]]:
                self.intake.release_samples(first.first_sample)  # their first samples ended without a step
        if self.inflight is not None:
            pending = self.inflight
            self.inflight = self._launch_next(pending)
            return self._commit(pending.batch, pending.output, start - pending.unrecorded_s,
                                self._host_tokens(pending))
        decoding = self.scheduler.decoding_requests() if self.decoding else []
        if len(decoding) > self.draft_batch_limit:  # under load a verify step costs more than its drafts gain
            decoding = []
        drafts = self._drafts(decoding) if decoding else {}
        # Under tensor parallelism rank 0 decides and the other ranks replay its decisions.
        scheduled = (self.scheduler.schedule(drafts) if self.parallel is None
                     else self.parallel.share_schedule(self.scheduler, drafts))
        if not scheduled:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not place any request; this is a bug")
            return []
        batch = self.runner.prepare(scheduled)
        output = self.runner.run(batch)
        if self._overlappable(batch):
            self.inflight = self._in_flight(batch, output, time.perf_counter() - start)
            return []
        return self._commit(batch, output, start)

    def _commit(self, batch, output, start: float, tokens: list[int] | None = None) -> list:
        generated_before = self.stats.generated_tokens
        sequences = self.committer.commit_step(batch, output, tokens)
        if self.held_samples:
            for s in sequences:
                if s.new_tokens and s.request.request_id in self.held_samples:  # (one that ended: Engine.finish)
                    self.intake.release_samples(s.request)
        self.hooks.zoo_step_results(results=StepResults(sequences, output))
        prefill = sum(e.num_tokens for e in batch.scheduled if e.num_tokens > 1 or not e.samples)
        self.stats.record_step(prefill, self.stats.generated_tokens - generated_before, time.perf_counter() - start,
                               self.blocks.num_used_blocks)
        return [(s.request, s.new_tokens) for s in sequences if s.new_tokens]

    # ---------------------------------------------------------------- overlapped steps

    def _overlappable(self, batch) -> bool:
        """Plain decodes whose next step needs nothing from the host but their tokens: greedy with nothing
        applied to the logits, no log-probs, no drafting method, no plugin reading positions or step outputs
        (the next replay overwrites a graph's outputs before this step is committed)."""
        return (self.overlap_steps and self.decoding is None and not self.step_result_hooks
                and not self.runner.position_hooks
                and all(e.num_tokens == 1 and e.samples and e.draft is None and e.request.params.logprobs is None
                        and not e.request.params.wants_prompt_logits
                        and self.sampler.plain_greedy(e.request) for e in batch.scheduled))

    def _in_flight(self, batch, output, unrecorded_s: float) -> InFlight:
        """Start the step's argmax and its copy to the host; nothing waits for them here."""
        rows = len(batch.scheduled)
        tokens = output.logits[:rows].argmax(-1) if output.argmax is None else output.argmax[:rows]
        if self._token_buffers is None:
            return InFlight(batch, output, tokens, tokens, None, unrecorded_s)
        host = self._token_buffers[self._next_buffer][:rows]  # two buffers: the step in flight and the next
        self._next_buffer ^= 1
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return InFlight(batch, output, tokens, host, copied, unrecorded_s)

    @staticmethod
    def _host_tokens(pending: InFlight) -> list[int]:
        if pending.copied is not None:
            pending.copied.synchronize()  # this step's tokens only: the next step keeps running
        return pending.host_tokens.tolist()

    def _launch_next(self, pending: InFlight) -> InFlight | None:
        """The step after ``pending``, for the same requests, launched before ``pending`` is committed: each
        request's next input is its token of ``pending``, copied on the device. None where the scheduler must
        decide instead: requests waiting that it would let in now, no free block, or every request ending with
        ``pending`` for sure.
        A request that ``pending`` turns out to finish (a stop token) has its extra token dropped at commit."""
        if self.scheduler.waiting and self.scheduler.admits_waiting():
            return None
        entries, rows, new_blocks = [], [], []
        max_model_len, block_size = self.max_model_len, self.block_size
        for row, entry in enumerate(pending.batch.scheduled):
            request = entry.request
            num_tokens = request.num_tokens  # pending's token not yet among them: the next step writes it
            if (request.is_finished or len(request.output_token_ids) + 1 >= request.params.max_new_tokens
                    or num_tokens + 1 >= max_model_len):
                continue  # ends with pending's token
            held = len(request.block_ids)
            if held * block_size <= num_tokens:  # its slot starts a block
                if not self.blocks.ensure_slots(request, num_tokens + 1):
                    return None
                new_blocks += [(row, col, request.block_ids[col]) for col in range(held, len(request.block_ids))]
            entries.append(ScheduledRequest(request, num_tokens, 1, token_on_device=True))
            rows.append(row)
        if not entries:
            return None
        self.scheduler.defer_admission()  # a step the waiting requests sit out, as in Scheduler.schedule
        start = time.perf_counter()
        tokens = pending.tokens
        if len(entries) == len(pending.batch.scheduled):  # the same rows: advance pending's inputs in place
            batch = self.runner.advance_decode(pending.batch, entries, new_blocks)
            self.advanced_in_place += 1
        else:
            batch = self.runner.prepare(entries)
            # rows through a non-blocking copy: torch.tensor(rows, device=...) waits for the GPU to drain, which
            # the sync census of bench/profile_gpu_step.py --host-profile found here in 62 of 129 steps
            tokens = tokens[int64_tensor(rows).to(tokens.device, non_blocking=True)]
        self.runner.buffers["input_ids"][:len(entries)].copy_(tokens)
        output = self.runner.run(batch)
        self.overlapped_steps += 1
        return self._in_flight(batch, output, time.perf_counter() - start)

    def _drafts(self, decoding: list[Request]) -> dict:
        """The method's draft blocks; a failing method costs this step its drafts, never a token."""
        try:
            proposed = self.decoding.propose(decoding)
        except Exception as exc:  # noqa: BLE001 - whatever a draft model raises, the target decodes on
            if not self.draft_failures:
                print(f"warning: decoding method {self.decoding.name!r} failed to propose drafts "
                      f"({type(exc).__name__}: {exc}); these steps decode without drafts", file=sys.stderr)
            self.draft_failures += 1
            return {}
        return fit_drafts(self.decoding, proposed, decoding, self.max_model_len,
                          share=self.draft_step_tokens // len(decoding))

    # ---------------------------------------------------------------- loops

    def run_until_done(self, on_tokens=None) -> None:
        while self.has_work():
            for request, tokens in self.step():
                if on_tokens is not None:
                    on_tokens(request, tokens)

    def summary(self) -> str:
        return summary(self)
