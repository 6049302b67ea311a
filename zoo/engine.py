"""The engine: one ``step()`` is schedule -> prepare -> run -> sample -> commit."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

from zoo.block_manager import BlockManager
from zoo.errors import RequestError, ZooError
from zoo.loader import LoadedModel, build_embedded, load_checkpoint
from zoo.model_runner import ModelRunner, RunnerLimits
from zoo.plugins import load_plugins
from zoo.request import Request, Status
from zoo.sampler import Sampler
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest, Scheduler

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # computed, i.e. prompt tokens not served from the prefix cache (plus recomputes)
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    max_blocks_used: int = 0
    time_to_first_token: list[float] = field(default_factory=list)


def _device_and_dtype(runtime) -> tuple[torch.device, torch.dtype]:
    device_name = runtime.get("device", "auto")
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    dtype_name = runtime.get("dtype", "auto")
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    if dtype_name not in DTYPES:
        raise ZooError(f"runtime.dtype={dtype_name!r} is not one of {', '.join(DTYPES)} or auto")
    return device, DTYPES[dtype_name]


class Engine:
    def __init__(self, config, extra_plugins=()):
        """``config`` is the composed run config (OmegaConf or plain dicts)."""
        self.config = config
        runtime = config["runtime"]
        plugins = config.get("plugins") or {}
        self.plugin_manager = load_plugins(disable=plugins.get("disable") or (), extra=extra_plugins)
        self.hooks = self.plugin_manager.hook
        self.device, self.dtype = _device_and_dtype(runtime)
        model_cfg = config["model"]
        if model_cfg.get("path"):
            loaded = load_checkpoint(str(model_cfg["path"]), self.hooks, self.dtype, self.device)
        else:
            embedded = model_cfg.get("embedded")
            if not embedded:
                raise ZooError(f"model option {model_cfg.get('name')!r} has no embedded default: set model.path")
            loaded = build_embedded(dict(embedded), self.hooks, self.dtype, self.device)
        self.loaded: LoadedModel = loaded
        self.model, self.description, self.tokenizer = loaded.model, loaded.description, loaded.tokenizer
        self.hooks.zoo_model_modify(model=self.model, description=self.description, config=config)

        self.max_model_len = min(self.description.max_position, runtime.get("max_model_len") or 1 << 62)
        self.block_size = int(runtime["block_size"])
        max_num_seqs = int(runtime["max_num_seqs"])
        max_tokens = int(runtime["max_num_batched_tokens"])
        max_draft = int(runtime.get("max_draft_tokens", 0))
        blocks_per_seq = -(-(self.max_model_len + max_draft) // self.block_size)
        self.num_blocks = self._num_kv_blocks(runtime, blocks_per_seq * max_num_seqs)
        limits = RunnerLimits(max_tokens + max_num_seqs * max_draft, max_num_seqs,
                              min(blocks_per_seq, self.num_blocks), self.block_size, max_draft)
        self.runner = ModelRunner(self.model, self.description, limits, self.num_blocks,
                                  self.dtype, self.device, self.hooks)
        self.blocks = BlockManager(self.num_blocks, self.block_size, bool(runtime.get("enable_prefix_caching", True)))
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_tokens)
        self.sampler = Sampler(self.hooks, self, int(runtime.get("seed", 0)), self.device)
        self.stats = EngineStats()
        self._next_id = 0
        self._start_times: dict[int, float] = {}

    def _num_kv_blocks(self, runtime, useful_blocks: int) -> int:
        explicit = runtime.get("num_kv_blocks")
        if explicit:
            return int(explicit)
        per_block = ModelRunner.kv_bytes_per_block(self.description, self.block_size, self.dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * float(runtime.get("gpu_memory_utilization", 0.9))
        else:
            budget = float(runtime.get("cpu_kv_cache_gb", 1.0)) * 2**30
        return max(1, min(int(budget // per_block), useful_blocks))

    # ---------------------------------------------------------------- requests

    def add_request(self, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None, extras: dict | None = None) -> Request:
        """Queue a request; an invalid one comes back already finished with an error."""
        request = Request(self._next_id, [], params or SamplingParams(), prompt=prompt, extras=dict(extras or {}))
        self._next_id += 1
        try:
            self._validate(request, prompt, prompt_token_ids)
        except ZooError as exc:
            request.finish("error", str(exc))
            return request
        if request.params.seed is not None:
            request.generator = None  # made lazily on the sampler's device
        self.hooks.zoo_request_admit(request=request, engine=self)
        if request.is_finished:  # a plugin rejected it while admitting
            return request
        self._start_times[request.request_id] = time.perf_counter()
        self.stats.prompt_tokens += len(request.prompt_token_ids)
        self.scheduler.add(request)
        return request

    def reject(self, message: str, extras: dict | None = None) -> Request:
        """A request that never enters the scheduler: finished with ``error``."""
        request = Request(self._next_id, [], SamplingParams(), extras=dict(extras or {}))
        self._next_id += 1
        request.finish("error", message)
        return request

    def _validate(self, request: Request, prompt, prompt_token_ids) -> None:
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise RequestError("a request needs `prompt` (text) or `prompt_ids` (list of token ids)")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
            raise RequestError("prompt_ids must be a list of integers")
        if not prompt_token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.description.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(prompt_token_ids)} tokens; the model's limit is "
                               f"{self.max_model_len} tokens including at least one generated")
        request.params.validate(vocab)
        request.prompt_token_ids = list(prompt_token_ids)
        needed = self.blocks.blocks_needed(min(len(prompt_token_ids) + request.params.max_new_tokens,
                                               self.max_model_len))
        if needed > self.num_blocks:
            raise RequestError(f"the request needs {needed} KV blocks of {self.block_size} tokens, the cache has "
                               f"{self.num_blocks}; raise runtime.num_kv_blocks or lower max_new_tokens")
        errors = [e for e in self.hooks.zoo_request_validate(request=request, description=self.description) if e]
        if errors:
            raise RequestError("; ".join(errors))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---------------------------------------------------------------- step

    def step(self) -> list[tuple[Request, list[int]]]:
        """Run one forward pass; returns ``(request, new_token_ids)`` for requests that advanced."""
        decoding = self.scheduler.decoding_requests()
        drafts = self.hooks.zoo_decoding_propose(requests=decoding, engine=self) if decoding else None
        for draft in (drafts or {}).values():
            if len(draft.tokens) > self.runner.limits.max_draft_tokens:
                raise ZooError(f"the decoding plugin proposed {len(draft.tokens)} draft tokens; "
                               f"runtime.max_draft_tokens is {self.runner.limits.max_draft_tokens}")
        scheduled = self.scheduler.schedule(drafts)
        if not scheduled:
            if self.scheduler.has_work():
                raise RuntimeError("the scheduler could not place any request; this is a bug")
            return []
        start = time.perf_counter()
        batch = self.runner.prepare(scheduled)
        output = self.runner.run(batch)
        events = []
        for entry, rows in zip(scheduled, batch.logits_rows):
            new_tokens = self._advance(entry, output.logits[rows])
            if new_tokens:
                events.append((entry.request, new_tokens))
        elapsed = time.perf_counter() - start
        prefill = sum(e.num_tokens for e in scheduled if e.num_tokens > 1 or not e.samples)
        self.stats.prefill_tokens += prefill
        if prefill:
            self.stats.prefill_seconds += elapsed
        else:
            self.stats.decode_seconds += elapsed
        self.stats.steps += 1
        self.stats.max_blocks_used = max(self.stats.max_blocks_used, self.blocks.num_used_blocks)
        return events

    def _stop_ids(self, request: Request) -> set[int]:
        ids = set(request.params.stop_token_ids)
        if not request.params.ignore_eos:
            ids.update(self.description.eos_token_ids)
        return ids

    def _advance(self, entry: ScheduledRequest, logits: torch.Tensor) -> list[int]:
        request = entry.request
        request.num_computed_tokens = entry.start + entry.num_tokens
        if not entry.samples:
            self.blocks.register_full_blocks(request)
            return []
        stop_ids = self._stop_ids(request)
        history = list(request.token_ids)
        committed: list[int] = []
        if entry.draft is None:
            token = self._choose(request, logits[0], history, stop_ids)
            tokens, raw_rows = [token], [logits[0]]
        else:
            accepted, token = self._verify(request, entry.draft, logits, history, stop_ids)
            tokens = [entry.draft.tokens[i] for i in accepted] + [token]
            raw_rows = [logits[0]] + [logits[1 + i] for i in accepted]
            first = entry.start + entry.num_tokens
            self.runner.move_cache_entries(request, [first + i for i in accepted],
                                           [first + m for m in range(len(accepted))])
            request.num_computed_tokens = first + len(accepted)
        for token, raw in zip(tokens, raw_rows):
            self._commit(request, token, raw, stop_ids)
            committed.append(token)
            if request.is_finished:
                break
        # A draft token kept after a stop was never part of the output: forget its K/V too.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        if request.is_finished:
            self._finish(request)
        else:
            self.blocks.trim(request, request.num_tokens)
            self.blocks.register_full_blocks(request)
        return committed

    def _choose(self, request, raw_row, history, stop_ids) -> int:
        generated = len(history) - len(request.prompt_token_ids)
        processed = self.sampler.process(raw_row, request, history, generated, stop_ids)
        return self.sampler.choose(processed, request)

    def _verify(self, request, draft, logits, history, stop_ids):
        result = self.hooks.zoo_decoding_verify(request=request, draft=draft, logits=logits, sampler=self.sampler)
        if result is not None:
            return result
        # Walk the tree: keep a draft token while it equals what the sampler picks after its parent.
        accepted, node, history = [], -1, list(history)
        while True:
            token = self._choose(request, logits[node + 1], history, stop_ids)
            child = next((i for i, p in enumerate(draft.parents) if p == node and draft.tokens[i] == token), None)
            if child is None:
                return accepted, token
            accepted.append(child)
            history.append(token)
            node = child

    def _commit(self, request: Request, token: int, raw_logits: torch.Tensor, stop_ids: set[int]) -> None:
        request.output_token_ids.append(token)
        self.stats.generated_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = time.perf_counter()
            self.stats.time_to_first_token.append(request.first_token_time - self._start_times[request.request_id])
        if request.params.logprobs is not None:
            request.output_logprobs.append(Sampler.logprobs(raw_logits, token, request.params.logprobs))
        params = request.params
        generated = len(request.output_token_ids)
        if token in stop_ids and generated >= params.min_new_tokens:
            request.finish("stop")
        elif any(self.hooks.zoo_token_generated(request=request, token_id=token)):
            request.finish("stop")
        elif params.stop and self._cut_at_stop_string(request):
            request.finish("stop")
        elif generated >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            request.finish("length")

    def _cut_at_stop_string(self, request: Request) -> bool:
        text = self.tokenizer.decode(request.output_token_ids)
        hits = [(text.find(s), s) for s in request.params.stop if s in text]
        if not hits:
            return False
        request.output_text = text[:min(hits)[0]]
        return True

    def _finish(self, request: Request) -> None:
        self.scheduler.finish(request)
        if not request.output_text:
            request.output_text = self.tokenizer.decode(request.output_token_ids)
        self.hooks.zoo_request_finished(request=request)

    # ---------------------------------------------------------------- loops

    def run_until_done(self, on_tokens=None) -> None:
        while self.has_work():
            for request, tokens in self.step():
                if on_tokens is not None:
                    on_tokens(request, tokens)

    def summary(self) -> str:
        s = self.stats
        ttft = sorted(s.time_to_first_token)
        ttft_text = f"{1000 * ttft[len(ttft) // 2]:.1f} ms median" if ttft else "n/a"
        prefill_rate = s.prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0
        decode_tokens = s.generated_tokens
        decode_rate = decode_tokens / (s.prefill_seconds + s.decode_seconds) if s.steps else 0.0
        return (f"requests: {self._next_id}  prompt tokens: {s.prompt_tokens} "
                f"(prefix-cache hits: {self.blocks.prefix_hit_tokens})  generated tokens: {s.generated_tokens}\n"
                f"time to first token: {ttft_text}  prefill: {prefill_rate:.1f} tok/s  "
                f"generation: {decode_rate:.1f} tok/s over {s.steps} steps\n"
                f"KV blocks: {s.max_blocks_used} of {self.num_blocks} used at peak (block size {self.block_size})"
                f"  preemptions: {self.scheduler.num_preemptions}")


def print_error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
