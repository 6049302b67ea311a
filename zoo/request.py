"""One request's state as it moves through the engine."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zoo.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    input_token_ids: list[int] | None = None  # the prompt as the user sent it (zoo_prompt_transform may extend it)
    extras: dict[str, Any] = field(default_factory=dict)  # request fields plugins read (images, adapter...)
    output_id: Any = None  # the caller's id for this request (JSONL `id`, else its line number or index)
    source_dir: Path | None = None  # relative file paths in its fields (images) are read from here (None: cwd)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token (None for the first); with params.return_logits:
    # the logits at each prompt position [prompt, vocab] and of each generated token (CPU float32).
    prompt_logprobs: list[dict | None] | None = None
    context_logits: torch.Tensor | None = None
    generation_logits: list[torch.Tensor] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # of those, how many came from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    output_text: str = ""
    generator: torch.Generator | None = None  # made by the sampler on first use when params.seed is set
    plugin_state: dict[str, Any] = field(default_factory=dict)
    # Tokens 0..n-1 attend to each other in both directions (GLM's context): set by the engine from
    # zoo_request_bidirectional_prefix. The scheduler computes them in one step.
    bidirectional_prefix: int = 0
    # Everything besides its tokens that the request's K/V depends on, composed by the engine at
    # admission (the bidirectional prefix, zoo_request_cache_key parts). Cached blocks are shared
    # only between requests with equal keys; () shares by tokens alone.
    cache_key: tuple = ()
    stop_token_set: set[int] | None = None  # Sampler.stop_ids, computed once
    arrival_time: float = 0.0
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_steps: int = 0  # forward passes that produced this request's generated tokens
    seats: int = 1  # running sequences it takes: a beam search's whole width until it forks into its beams
    beam_hypotheses: list[dict] | None = None  # beam search: every beam's result, best first (zoo.beam_search)
    # Parallel samples (``params.n`` > 1): the first request is the group's; it lists every sample, itself
    # first, and each later sample names it and its index. See RequestIntake.add.
    samples: list["Request"] = field(default_factory=list)
    first_sample: "Request | None" = None
    sample_index: int = 0

    @property
    def group(self) -> "Request":
        """The request a caller holds for this one: the first sample of its group, or itself."""
        return self.first_sample or self

    @property
    def group_finished(self) -> bool:
        return all(r.is_finished for r in self.group.samples) if self.group.samples else self.is_finished

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < prompt else self.output_token_ids[index - prompt]

    def token_slice(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        prompt = len(self.prompt_token_ids)
        if end <= prompt:
            return self.prompt_token_ids[start:end]
        if start >= prompt:
            return self.output_token_ids[start - prompt:end - prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def last_logprobs(self, count: int) -> list[dict] | None:
        """The log-prob entries of the last ``count`` output tokens, where the request asks for log-probs: those a
        stream sends, which go out in order, so that its pieces join to the output's."""
        if self.params.logprobs is None or self.error or not count:
            return None
        return self.output_logprobs[-count:]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error


class TokenHistories(Sequence):
    """``histories[i]`` is ``requests[i].token_ids``, built only when read.

    Most steps run no processor that looks at histories; building every
    request's full token list each step cost more than sampling at batch 64.
    """

    def __init__(self, requests: list[Request]):
        self.requests = requests

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [r.token_ids for r in self.requests[i]]
        return self.requests[i].token_ids
