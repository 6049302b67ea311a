"""A zoo plugin that forbids repeating n-grams (``processor=no_repeat_ngram``).

The plugin takes part only when the run config selects
``processor=no_repeat_ngram`` (``zoo_scope``); then every token that
would complete an n-gram of ``processor.ngram_size`` tokens already present in
the request's sequence (prompt plus the tokens generated so far) gets logit
``-inf``, as transformers' ``no_repeat_ngram_size`` does.

Hooks used:

* ``zoo_config_register``: adds the option ``no_repeat_ngram`` to the Hydra
  group ``processor``.
* ``zoo_engine_start``: reads ``processor.ngram_size`` once and rejects a bad
  one before any request runs.
* ``zoo_logits_process``: masks the banned tokens of each logits row.
* ``zoo_request_finished``: drops the request's n-gram index.
"""

from __future__ import annotations

import torch

from zoo import Scope, ZooError, hookimpl

NAME = "no_repeat_ngram"
zoo_scope = Scope(option=f"processor={NAME}")
DEFAULT_NGRAM_SIZE = 3


class NgramIndex:
    """The n-grams of one request's token sequence, grouped by their first n-1 tokens.

    A request's tokens only ever grow (prompt, then committed outputs), so the
    index is extended with the new n-grams at each call instead of rebuilt.
    """

    __slots__ = ("size", "followers", "indexed")

    def __init__(self, size: int):
        self.size = size
        self.followers: dict[tuple[int, ...], set[int]] = {}
        self.indexed = 0  # n-grams starting at positions < indexed are in `followers`

    def banned(self, tokens: list[int]) -> set[int]:
        """Tokens that, appended to ``tokens``, would repeat one of its n-grams."""
        n = self.size
        for start in range(self.indexed, len(tokens) - n + 1):
            self.followers.setdefault(tuple(tokens[start:start + n - 1]), set()).add(tokens[start + n - 1])
        self.indexed = max(self.indexed, len(tokens) - n + 1)
        if len(tokens) < n - 1:
            return set()
        return self.followers.get(tuple(tokens[len(tokens) - n + 1:]), set())


def _ngram_size(engine) -> int:
    return engine.config["processor"].get("ngram_size", DEFAULT_NGRAM_SIZE)


@hookimpl
def zoo_config_register(config_store):
    config_store.store(group="processor", name=NAME, node={"name": NAME, "ngram_size": DEFAULT_NGRAM_SIZE})


@hookimpl
def zoo_engine_start(engine):
    size = _ngram_size(engine)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ZooError(f"processor.ngram_size={size!r} must be an integer >= 1")  # at start, not mid-sampling


@hookimpl
def zoo_logits_process(logits, requests, histories, engine):
    size = _ngram_size(engine)
    # histories, not request.token_ids: under speculative decoding a row may follow draft tokens
    # accepted earlier in the same step, which are not committed yet.
    for row, request, history in zip(logits, requests, histories):
        index = request.plugin_state.get(NAME)
        if index is None or index.size != size:
            index = request.plugin_state[NAME] = NgramIndex(size)
        banned = index.banned(history)
        if banned:
            row[torch.tensor(sorted(banned), device=row.device)] = float("-inf")


@hookimpl
def zoo_request_finished(request):
    request.plugin_state.pop(NAME, None)
