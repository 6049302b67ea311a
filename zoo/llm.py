"""The Python API: ``zoo.LLM``."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from zoo.config import compose_config, to_plain
from zoo.engine import Engine
from zoo.errors import ZooError
from zoo.request import Request
from zoo.sampling_params import SamplingParams

_REQUEST_KEYS = {"prompt", "prompt_ids", "id", "sampling"}


@dataclass
class RequestOutput:
    id: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    logprobs: list[dict] | None = None
    num_steps: int = 0  # forward passes that produced these tokens (fewer than tokens when drafts are accepted)
    # With sampling n > 1: every completion, in order (the fields above are the first one's).
    samples: list["SampleOutput"] | None = None
    prompt_logprobs: list[dict | None] | None = None  # with prompt_logprobs: per prompt token, None for the first
    context_logits: Any = None  # with return_logits: [prompt tokens, vocab] float32 tensor
    generation_logits: Any = None  # with return_logits: [generated tokens, vocab] float32 tensor
    # beam search: every beam's hypothesis, best first (token_ids, text, score, cumulative_logprob, finish_reason)
    beams: list[dict] | None = None

    def to_json(self) -> dict:
        record = {"id": self.id, "prompt_token_ids": self.prompt_token_ids, "token_ids": self.token_ids,
                  "text": self.text, "finish_reason": self.finish_reason, "num_steps": self.num_steps}
        if self.error is not None:
            record["error"] = self.error
        if self.logprobs is not None:
            record["logprobs"] = self.logprobs
        if self.samples is not None:
            record["samples"] = [asdict(sample) for sample in self.samples]
        if self.beams is not None:
            record["beams"] = self.beams
        if self.prompt_logprobs is not None:
            record["prompt_logprobs"] = self.prompt_logprobs
        if self.context_logits is not None:
            record["context_logits"] = self.context_logits.tolist()
            record["generation_logits"] = self.generation_logits.tolist()
        return record


@dataclass
class SampleOutput:
    """One of a prompt's ``n`` completions."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    logprobs: list[dict] | None = None


@dataclass
class TokenEvent:
    """One step's new tokens for one request, as yielded by :meth:`LLM.stream`."""

    index: int  # position of the request in the input list
    token_ids: list[int]
    finished: bool  # this sample ended
    finish_reason: str | None = None
    output: RequestOutput | None = field(default=None, repr=False)  # set when the request (all samples) ended
    text: str = ""  # the text these tokens add (held back while a character is still incomplete)
    sample: int = 0  # which of the request's n completions
    logprobs: list[dict] | None = None  # these tokens' entries of the output's ``logprobs``, where asked for


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``stops``."""
    return max((k for stop in stops for k in range(1, min(len(stop), len(text)) + 1)
                if stop.startswith(text[-k:])), default=0)


@dataclass
class _Detokenized:
    """A request's text so far, decoded a few tokens at a time."""

    text: str = ""  # the settled text of output_token_ids[:read]
    prefix: int = 0  # where the decoded window begins: tokens settled last time, the new ones' context
    read: int = 0  # tokens whose text is in ``text``
    sent: int = 0  # characters of ``text`` already given


class TextDeltas:
    """The text each step adds to each request, so that a request's deltas concatenate to its final text:
    an incomplete multi-byte character, and what may be the start of a stop string (cut later), are held back
    until they are settled.

    Each call decodes only the tokens settled last time, alone and followed by the new ones (the way vLLM and
    TGI stream), not the whole output: a whole decode per token made a 256-token stream quadratic, and at 64
    streams it took longer than the H200's step. The difference of the two is the new text; what a tokenizer
    does at the start of what it decodes (a dropped leading space) is in both, so it cancels out. A longer
    window with its text kept would save one of the two decodes, but a decode costs about its length (0.5 us
    a token for a 128k-word vocabulary), so two short ones are cheaper."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.state: dict[int, _Detokenized] = {}  # request id -> its text so far

    def delta(self, request: Request, final_text: str | None = None) -> str:
        """``final_text``: the request's text once it is finished (everything left is given)."""
        return self.delta_of(request.request_id, request.output_token_ids, request.params.stop, final_text)

    def delta_of(self, key, ids: list[int], stops: list[str], final_text: str | None = None) -> str:
        """The same for a stream known only by ``key``, its tokens so far and its stop strings (the server's
        HTTP process detokenizes its streams this way, away from the engine's process)."""
        state = self.state.setdefault(key, _Detokenized())
        if final_text is not None:
            del self.state[key]
            return final_text[state.sent:]
        if len(ids) > state.read:
            before = self.tokenizer.decode(ids[state.prefix:state.read]) if state.read > state.prefix else ""
            after = self.tokenizer.decode(ids[state.prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):  # else a character is not complete yet
                state.text += after[len(before):]
                state.prefix, state.read = state.read, len(ids)
        text = state.text[:len(state.text) - _stop_prefix_overlap(state.text, stops)]
        delta = text[state.sent:]
        state.sent = max(state.sent, len(text))
        return delta

    def forget(self, request: Request) -> None:
        """A request that will not be asked about again (aborted)."""
        self.state.pop(request.request_id, None)


class LLM:
    """Generate with zoo from Python.

    ``LLM()`` runs the embedded random-init Llama; ``LLM("path/or/org-name")`` a
    checkpoint. ``model`` picks the config option of ``conf/model`` and
    ``decoding`` one of ``conf/decoding`` (``"medusa"``); keyword arguments set
    ``runtime.*`` keys; ``overrides`` are Hydra overrides as on the command line;
    ``plugins`` are extra plugin objects to register; ``adapters`` maps names to
    PEFT adapter folders (LoRA, prompt tuning) that requests select with
    ``{"adapter": name}``.
    """

    def __init__(self, path: str | None = None, *, model: str = "llama", decoding: str = "none",
                 overrides: list[str] = (), plugins: list = (), config=None, adapters: dict | None = None,
                 **runtime):
        if config is None:
            items = [f"model={model}", f"decoding={decoding}"]
            if path is not None:
                items.append(f"model.path={path}")
            items += [f"+adapters.{name}={folder}" for name, folder in (adapters or {}).items()]
            items += [f"runtime.{k}={'null' if v is None else v}" for k, v in runtime.items()]
            config = compose_config(items + list(overrides))
        self.config = config
        self.engine = Engine(config, extra_plugins=plugins)
        self.tokenizer = self.engine.tokenizer
        self.default_params = SamplingParams.from_dict(to_plain(config.get("sampling") or {}))

    def add_adapter(self, name: str, path) -> None:
        """Load a PEFT adapter folder under ``name`` while the engine runs; a ZooError says what is wrong."""
        self.engine.adapters.add(name, path)

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter; refused while a request that names it is waiting or running."""
        self.engine.adapters.remove(name)

    def _submit(self, prompts, sampling_params) -> list[Request]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_request = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        requests = []
        for index, (item, params) in enumerate(zip(prompts, per_request)):
            requests.append(self._add(item, params, index))
        return requests

    def _add(self, item, params, index, source_dir=None) -> Request:
        base = params if isinstance(params, SamplingParams) else self.default_params
        overrides = params if isinstance(params, dict) else {}
        if isinstance(item, dict):
            overrides = {**overrides, **(item.get("sampling") or {}),
                         **{k: v for k, v in item.items() if k in SamplingParams.__dataclass_fields__}}
            extras = {k: v for k, v in item.items()
                      if k not in _REQUEST_KEYS and k not in SamplingParams.__dataclass_fields__}
            prompt, prompt_ids, rid = item.get("prompt"), item.get("prompt_ids"), item.get("id", index)
        else:
            extras, rid = {}, index
            prompt, prompt_ids = (item, None) if isinstance(item, str) else (None, item)
        try:
            request_params = base.merged(overrides)
        except ZooError as exc:  # an invalid override rejects this request only
            request = self.engine.reject(str(exc))
        else:
            request = self.engine.add_request(prompt, prompt_ids, request_params, extras, source_dir)
        request.output_id = rid
        return request

    def text_of(self, request: Request) -> str:
        return request.output_text or (self.tokenizer.decode(request.output_token_ids)
                                       if request.output_token_ids else "")

    def output_of(self, request: Request) -> RequestOutput:
        request = request.group
        samples = None
        if request.samples:
            samples = [SampleOutput(r.sample_index, list(r.output_token_ids), self.text_of(r),
                                    r.finish_reason or "length", r.error, self._logprobs(r))
                       for r in request.samples]
        return RequestOutput(
            id=request.output_id,
            prompt_token_ids=request.input_token_ids or request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=self.text_of(request),
            finish_reason=request.finish_reason or "length",
            error=request.error,
            logprobs=self._logprobs(request),
            num_steps=request.num_steps,
            samples=samples,
            beams=request.beam_hypotheses,
            prompt_logprobs=request.prompt_logprobs if not request.error else None,
            context_logits=request.context_logits if not request.error else None,
            generation_logits=(torch.stack(request.generation_logits) if request.generation_logits
                               else torch.zeros(0, self.engine.description.vocab_size))
            if request.context_logits is not None and not request.error else None,
        )

    @staticmethod
    def _logprobs(request: Request) -> list[dict] | None:
        return request.output_logprobs if request.params.logprobs is not None and not request.error else None

    def generate(self, prompts, sampling_params=None) -> list[RequestOutput]:
        """Run ``prompts`` (text, token-id lists or request dicts) to completion; outputs in input order."""
        requests = self._submit(prompts, sampling_params)
        self.engine.run_until_done()
        return [self.output_of(r) for r in requests]

    def stream(self, prompts, sampling_params=None) -> Iterator[TokenEvent]:
        """Yield new tokens as each step produces them."""
        requests = self._submit(prompts, sampling_params)
        index = {r.request_id: i for i, r in enumerate(requests)}
        for i, r in enumerate(requests):
            if r.is_finished:  # rejected up front
                yield TokenEvent(i, [], True, r.finish_reason, self.output_of(r))
        deltas = TextDeltas(self.tokenizer)
        while self.engine.has_work():
            for request, tokens in self.engine.step():
                done = request.is_finished
                output = self.output_of(request) if request.group_finished else None
                delta = deltas.delta(request, self.text_of(request) if done else None)
                yield TokenEvent(index[request.group.request_id], tokens, done, request.finish_reason, output, delta,
                                 request.sample_index, request.last_logprobs(len(tokens)))
