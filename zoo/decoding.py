"""Decoding methods: draft blocks proposed by one registered method, verified by the core.

``decoding=NAME`` picks the method a plugin registered under that name
(``zoo_decoding_methods``); ``none`` is plain decoding and allocates no draft
buffers. Before each step the method proposes a :class:`DraftBlock` per
decoding sequence; the core runs every sequence's block in the same forward
pass, keeps the longest path the target model agrees with, rolls back the KV
of the rest, and reports the outcome through ``zoo_step_results``.

Acceptance keeps the target distribution. Without draft probabilities the
target picks its token at each node (greedy, or sampled with the request's
generator) and a child holding that token is accepted. With them, a node's
children are tried in turn by rejection sampling (accept ``x`` with
probability ``min(1, p(x) / q(x))``, else continue with ``norm(max(p - q, 0))``),
which also accepts tokens the target would not have drawn itself.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zoo.errors import ZooError

if TYPE_CHECKING:
    from zoo.request import Request
    from zoo.sampler import Sampler


@dataclass(frozen=True)
class TreeShape:
    """What a tree's parent list implies, worked out once per distinct shape (a static tree repeats every step)."""

    depths: tuple[int, ...]
    ancestors: tuple[tuple[int, ...], ...]  # root to node, inclusive
    children: dict[int, list[int]]
    visible_pairs: tuple[torch.Tensor, torch.Tensor]  # (token, ancestor) index pairs, CPU int64


@lru_cache(maxsize=4096)
def tree_shape(parents: tuple[int, ...]) -> TreeShape:
    depths, ancestors, children = [], [], {}
    for i, parent in enumerate(parents):  # parents come before children
        depths.append(1 if parent < 0 else depths[parent] + 1)
        ancestors.append((ancestors[parent] if parent >= 0 else ()) + (i,))
        children.setdefault(parent, []).append(i)
    rows = torch.tensor([i for i, path in enumerate(ancestors) for _ in path], dtype=torch.int64)
    columns = torch.tensor([a for path in ancestors for a in path], dtype=torch.int64)
    return TreeShape(tuple(depths), tuple(ancestors), children, (rows, columns))


@dataclass
class DraftBlock:
    """Draft tokens proposed for one sequence.

    ``parents[i]`` is the draft index of token ``i``'s parent, or -1 for the last
    committed token; parents come before children. By default a token sees
    exactly its ancestors (the visibility mask of a tree); ``sees[i]``, when
    given, lists the earlier draft tokens token ``i`` sees instead (lookahead's
    window rows see other rows). Only a token that sees exactly its ancestors can be
    accepted: another one's K/V were not computed from the accepted path, so it
    is computed for its output alone. ``position_offsets[i]`` is its position
    relative to the last committed token's (default: its depth). ``probs[i]`` is
    the distribution token ``i`` was drawn from, for rejection sampling
    (``[len(tokens), vocab]``; None: acceptance by matching).
    """

    tokens: list[int]
    parents: list[int]
    position_offsets: list[int] | None = None
    probs: torch.Tensor | None = None
    sees: list[list[int]] | None = None

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> "DraftBlock":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), probs=probs)

    @cached_property
    def shape(self) -> TreeShape:
        return tree_shape(tuple(self.parents))

    @property
    def depths(self) -> tuple[int, ...]:
        """Each token's depth (1: a child of the last committed token)."""
        return self.shape.depths

    def depth(self, i: int) -> int:
        return self.shape.depths[i]

    def offset(self, i: int) -> int:
        return self.position_offsets[i] if self.position_offsets is not None else self.depth(i)

    def ancestors(self, i: int) -> list[int]:
        """Draft indices on the path from the root to ``i``, inclusive."""
        return list(self.shape.ancestors[i])

    def visible(self, i: int) -> list[int]:
        """The draft tokens token ``i`` attends to (itself included)."""
        return self.ancestors(i) if self.sees is None else sorted(set(self.sees[i]) | {i})

    def children(self, node: int) -> list[int]:
        """The tokens after ``node`` that may be accepted (those that see exactly their ancestors)."""
        if self.sees is None:
            return self.shape.children.get(node, [])
        return [i for i in self.shape.children.get(node, []) if self.visible(i) == self.ancestors(i)]

    def first(self, n: int) -> "DraftBlock | None":
        """The first ``n`` tokens (a tree still: parents come first), or None when ``n`` < 1."""
        if n < 1:
            return None
        if n >= len(self.tokens):
            return self
        return self._keep(list(range(n)))

    def within(self, max_offset: int) -> "DraftBlock | None":
        """The tokens whose path stays at position offsets <= ``max_offset`` (renumbered), or None."""
        deepest = len(self.tokens) if self.position_offsets is None else max(self.position_offsets, default=0)
        if self.tokens and deepest <= max_offset:  # every step but the last few of a request: nothing to cut
            return self
        keep = [i for i in range(len(self.tokens)) if all(self.offset(a) <= max_offset for a in self.ancestors(i))]
        return self._keep(keep) if keep else None

    def _keep(self, keep: list[int]) -> "DraftBlock":
        """The block of tokens ``keep`` (closed under parents), renumbered."""
        index = {old: new for new, old in enumerate(keep)}
        return DraftBlock([self.tokens[i] for i in keep], [index.get(self.parents[i], -1) for i in keep],
                          None if self.position_offsets is None else [self.position_offsets[i] for i in keep],
                          None if self.probs is None else self.probs[keep],
                          None if self.sees is None else [[index[j] for j in self.sees[i] if j in index]
                                                          for i in keep])


class DecodingMethod:
    """A way to propose drafts; plugins subclass it and register a factory in ``zoo_decoding_methods``.

    A method may define ``accept(target_probs, child_tokens) -> index or None`` to choose, for
    sampled requests, which child of a node to accept under the target distribution of that
    node, instead of the core's distribution-preserving rules (Medusa's typical acceptance,
    which accepts more and no longer samples exactly from the target).

    ``max_draft_tokens`` is the largest block the method proposes for one sequence;
    the runner sizes its draft buffers from it once. The chosen method is also
    registered as a plugin of its engine, so it may implement hooks itself
    (``zoo_step_results`` to keep the hidden states it drafts from,
    ``zoo_engine_start``, ``zoo_request_finished``), called for that engine only.
    """

    name = "method"
    max_draft_tokens = 0
    # Whether the method runs under tensor parallelism (runtime.tensor_parallel_size > 1): every rank proposes
    # the same drafts, so a method that reads only tokens can; one with draft weights of its own must split them.
    splits_over_ranks = False

    def propose(self, requests: list["Request"]) -> dict[int, DraftBlock]:
        """Draft blocks by request id for some of ``requests`` (each about to decode one token)."""
        raise NotImplementedError

    def trainer(self, model) -> "HeadsTrainer":
        """For a method with weights: what ``python -m zoo.train`` optimises over the target ``model``."""
        raise ZooError(f"decoding={self.name} has no weights to train")


CHECKPOINT_HEADS = "zoo_heads"  # <checkpoint>/zoo_heads/<method>/: the heads a method uses by default


def heads_folder(engine, method: str) -> Path | None:
    """``decoding.heads``, else the checkpoint's own heads for ``method`` if it has them, else None (fresh)."""
    setting = engine.config["decoding"]["heads"]
    if setting:
        return Path(str(setting)).expanduser()
    checkpoint = getattr(engine, "checkpoint", None)
    folder = checkpoint.folder / CHECKPOINT_HEADS / method if checkpoint and checkpoint.folder else None
    if folder is None or not folder.is_dir():
        return None
    print(f"note: decoding={method} uses the checkpoint's own heads ({folder}); decoding.heads=DIR picks others",
          file=sys.stderr)
    return folder


class HeadsTrainer:
    """A method's weights under self-distillation from its target (``python -m zoo.train``).

    ``module`` holds the parameters to optimise (float32, on the target's device). ``loss(tokens,
    features)`` takes ``tokens`` ``[B, L]``, text the target wrote itself, and ``features``
    ``[B, L - 1, hidden]``, the target's final hidden states at positions ``0..L-2`` (each the one that
    predicted the next token), and returns a scalar. ``save(folder, dtype)`` writes the layout that
    ``decoding.heads=folder`` loads, its tensors in ``dtype``.
    """

    module: "torch.nn.Module"

    def loss(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def save(self, folder, dtype: torch.dtype) -> None:
        raise NotImplementedError


def draft_limit(settings, key: str) -> int:
    """A load policy of ``decoding`` (null or absent: no limit):

    - ``disable_by_batch_size`` (vLLM's name): above this many decoding requests a step drafts nothing;
    - ``draft_tokens_per_step``: the draft tokens of one step, shared evenly by its decoding requests, so
      a verify step stays about as cheap as a plain one as the batch grows.
    """
    limit = settings.get(key) if hasattr(settings, "get") else None
    if limit is None:
        return 1 << 62
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise ZooError(f"decoding.{key}={limit!r} must be an integer >= 0 or null")
    return limit


def choose_method(plugin_manager, name: str, engine) -> DecodingMethod | None:
    """The method ``decoding=name`` selects, built once and registered as a plugin; None for plain decoding."""
    from zoo.plugins import left_out_note, registered_names

    registry = registered_names(plugin_manager.hook.zoo_decoding_methods, "decoding method")
    if name in (None, "none"):
        return None
    if name not in registry:
        known = sorted(set(registry) | {m for s in getattr(engine, "plugins", ()) for m in s.decoding_methods})
        raise ZooError(f"decoding={name}: no plugin that takes part registers it (methods: "
                       f"{', '.join(known) or 'none'}; decoding=NAME chooses a method's own option)"
                       + left_out_note(plugin_manager))
    method = registry[name][1](engine)
    if not isinstance(method.max_draft_tokens, int) or method.max_draft_tokens < 1:
        raise ZooError(f"decoding method {name!r} declares max_draft_tokens={method.max_draft_tokens!r}; "
                       "it must be a positive integer")
    if not plugin_manager.is_registered(method):
        plugin_manager.register(method, name=f"decoding method {name}")
    return method


def fit_drafts(method: DecodingMethod, drafts: dict[int, DraftBlock], requests: list["Request"],
               max_model_len: int, share: int = 1 << 62) -> dict[int, DraftBlock]:
    """Check a method's drafts and cut them to their first ``share`` tokens and where they would pass the
    model's last position."""
    fitted = {}
    for request in requests:
        draft = drafts.get(request.request_id)
        if draft is None:
            continue
        if len(draft.tokens) > method.max_draft_tokens:
            raise ZooError(f"decoding method {method.name!r} proposed {len(draft.tokens)} draft tokens; "
                           f"its max_draft_tokens is {method.max_draft_tokens}")
        # A draft token at offset d sits at position num_tokens - 1 + d.
        draft = draft.first(share)
        draft = draft and draft.within(max_model_len - request.num_tokens)
        if draft is not None:
            fitted[request.request_id] = draft
    return fitted


def verify(request: "Request", draft: DraftBlock, logits: torch.Tensor, sampler: "Sampler",
           method: DecodingMethod | None = None, greedy: list[int] | None = None) -> tuple[list[int], int]:
    """``(accepted draft indices along one path, the next token after them)``.

    ``logits`` are ``[1 + len(draft), vocab]``: row 0 after the last committed
    token, row ``1 + i`` after draft token ``i``. A sampled request of a method
    with its own ``accept`` rule (Medusa's typical acceptance) is verified by it.
    ``greedy``, when given, is the argmax of every row, taken for the whole step at
    once (a greedy request with nothing to process): the walk then needs no device work.
    """
    if greedy is not None:
        accepted, node = [], -1
        while True:
            token = greedy[node + 1]
            child = next((c for c in draft.children(node) if draft.tokens[c] == token), None)
            if child is None:
                return accepted, token
            accepted.append(child)
            node = child
    accepted, node, history = [], -1, list(request.token_ids)
    sampled = request.params.temperature > 0
    rejection = draft.probs is not None and sampled
    own_rule = getattr(method, "accept", None) if sampled else None
    while True:
        row = logits[node + 1:node + 2]
        children = draft.children(node)
        if own_rule is not None and children:
            target = sampler.probs(row, [request], [history])[0]
            child = own_rule(target, [draft.tokens[c] for c in children])
            child = None if child is None else children[child]
            token = draft.tokens[child] if child is not None else sampler.draw(target, request)
        elif rejection and children:
            child, token = _rejection_step(request, draft, children, sampler.probs(row, [request], [history])[0],
                                           sampler)
        else:
            token = sampler.select(row, [request], [history])[0]
            child = next((c for c in children if draft.tokens[c] == token), None)
        if child is None:
            return accepted, token
        accepted.append(child)
        history.append(token)
        node = child


def _rejection_step(request, draft: DraftBlock, children: list[int], target: torch.Tensor, sampler):
    """Try ``children`` in turn against the target distribution: (accepted child or None, token)."""
    for child in children:
        token, proposal = draft.tokens[child], draft.probs[child].to(target)
        if sampler.uniform(request) * float(proposal[token]) < float(target[token]):
            return child, token
        residual = (target - proposal).clamp(min=0)
        if float(residual.sum()) > 0:  # else the two agree everywhere: keep the target as it is
            target = residual / residual.sum()
    return None, sampler.draw(target, request)
