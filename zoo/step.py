"""What one step is, as it travels from the runner to the engine and the plugins."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoo.decoding import DraftBlock
from zoo.model import AttentionMetadata
from zoo.request import Request
from zoo.scheduler import ScheduledRequest


@dataclass(frozen=True)
class BufferSpec:
    """A per-step tensor: ``shape`` is its largest size; dim ``step_dim`` is cut to the step."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.int64
    step_dim: int = 0  # which dimension follows the step's token (or sequence) count
    per: str = "token"  # "token" | "seq": what that dimension counts
    fill: float = 0


@dataclass
class StepBatch:
    """What one forward pass computes: the scheduled requests and where their tokens sit."""

    scheduled: list[ScheduledRequest]
    num_tokens: int
    token_offsets: list[int]  # first query token of each scheduled request
    logits_rows: list[list[int]] = field(default_factory=list)  # per request: rows of the step's logits
    logits_indices: list[int] = field(default_factory=list)  # token row of each logits row
    attention: AttentionMetadata | None = None  # None when a captured graph runs the step
    graph: tuple | None = None  # the captured (graph family, batch size[, variant]) it replays, or None
    # per request: logits rows of its prompt positions from its chunk's start (requests asking for them)
    prompt_logits_rows: list[list[int]] = field(default_factory=list)

    @property
    def sizes(self) -> dict[str, int]:
        return {"token": self.num_tokens, "seq": len(self.scheduled)}

    def per_token(self, values: list, fill=0) -> list:
        """One value per token row from one per scheduled request (its chunk and drafts); ``fill`` elsewhere.

        A step replayed as a verify graph pads every request to the same number of rows, so a plugin
        filling a per-token buffer should lay its values out through this rather than by concatenation.
        """
        out = [fill] * self.num_tokens
        for entry, offset, value in zip(self.scheduled, self.token_offsets, values):
            out[offset:offset + entry.num_query_tokens] = [value] * entry.num_query_tokens
        return out


@dataclass
class StepOutput:
    logits: torch.Tensor  # [rows, vocab] float32, rows in StepBatch.logits_rows order
    hidden: torch.Tensor  # [num_tokens (or graph size), hidden_size] after the final norm
    layer_outputs: dict[int, torch.Tensor]  # captured decoder layers' outputs, same rows as hidden
    # Each logits row's argmax, computed inside a replayed graph (None for eager steps): a greedy step then
    # launches nothing after the replay but the copy of its tokens.
    argmax: torch.Tensor | None = None


@dataclass
class SequenceResult:
    """One request's part of a step.

    ``rows`` are the step's token rows whose K/V the cache kept, in cache order from
    cache index ``first_index`` (a prefill chunk's tokens, or the last committed token
    and the accepted drafts). The hidden state of ``rows[-len(new_tokens) + i]`` is
    the one that predicted ``new_tokens[i]``. ``draft`` is the block the step verified (as
    scheduled: possibly cut), and ``draft_logits_rows[i]`` the row of ``StepOutput.logits``
    after its token ``i``.
    """

    request: Request
    new_tokens: list[int]
    rows: list[int]
    first_index: int
    draft: "DraftBlock | None" = None
    draft_logits_rows: list[int] = field(default_factory=list)


@dataclass
class StepResults:
    sequences: list[SequenceResult]
    output: StepOutput

    def hidden_states(self, rows: list[int]) -> torch.Tensor:
        """Final hidden states of token ``rows``, ``[len(rows), hidden_size]``, on the device."""
        return self.output.hidden[torch.tensor(rows, device=self.output.hidden.device)]

    def logits(self, logits_rows: list[int]) -> torch.Tensor:
        """Raw next-token logits ``[len(logits_rows), vocab]`` (float32, on the device)."""
        return self.output.logits[torch.tensor(logits_rows, device=self.output.logits.device)]

    def layer_states(self, layer: int, rows: list[int]) -> torch.Tensor:
        """Outputs of decoder layer ``layer`` (captured at engine start) at token ``rows``."""
        if layer not in self.output.layer_outputs:
            raise KeyError(f"layer {layer} is not captured: ask for it with setup.capture_layers at engine start")
        states = self.output.layer_outputs[layer]
        return states[torch.tensor(rows, device=states.device)]
