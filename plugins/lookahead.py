"""Lookahead decoding (Fu et al. 2024): Jacobi iterations in a window, verified n-grams, no draft weights.

Each request keeps a window of ``N - 1`` levels of ``W`` guessed tokens: level
``l``, column ``j`` guesses the token ``l + j + 1`` places after the last
committed token. Every step feeds the window beside the candidates: level 0
is a chain (column ``j`` after column ``j - 1``) and level ``l`` at column
``j`` follows level ``l - 1`` at the same column, so each window token sees
exactly the guesses before it on its diagonal, and the window is a tree the
core can verify as it is. The model's outputs at the last level become the
next level, the oldest level is dropped, and each column, read down its
levels plus that output, is an ``N``-gram for the pool. The pool (per
request, keyed by first token, seeded with the prompt's n-grams) gives up to
``G`` candidates that start with the last committed token; they go into the
block as a trie before the window.
"""

from __future__ import annotations

from collections import OrderedDict

from zoo import DecodingMethod, DraftBlock, Scope, ZooError, hookimpl

zoo_scope = Scope(option="decoding=lookahead")
LIMITS = {"window": (1, 64), "ngram": (2, 16), "candidates": (0, 64)}
MAX_BLOCK = 1024  # draft tokens per request and step
POOL_PER_KEY = 64  # most recent continuations kept per first token


class RequestState:
    def __init__(self, prompt: list[int], window: int, ngram: int):
        # Start from the prompt's tokens, read backwards: any guesses will do, the outputs correct them.
        source = prompt[::-1]
        self.levels = [[source[(l * window + j) % len(source)] for j in range(window)] for l in range(ngram - 1)]
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.proposed = 0  # length of the block last proposed: a step that verified less cut the window
        for i in range(len(prompt) - ngram + 1):
            self.add(prompt[i:i + ngram])

    def add(self, gram) -> None:
        continuations = self.pool.setdefault(gram[0], OrderedDict())
        continuations[tuple(gram[1:])] = None
        continuations.move_to_end(tuple(gram[1:]))
        if len(continuations) > POOL_PER_KEY:
            continuations.popitem(last=False)


def candidate_trie(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """Tokens and parents of the candidates merged on their common prefixes, parents first."""
    tokens, parents, index = [], [], {}
    for candidate in candidates:
        parent = -1
        for depth in range(len(candidate)):
            key = candidate[:depth + 1]
            if key not in index:
                index[key] = len(tokens)
                tokens.append(candidate[depth])
                parents.append(parent)
            parent = index[key]
    return tokens, parents


class Lookahead(DecodingMethod):
    name = "lookahead"
    splits_over_ranks = True  # no weights: its drafts come from tokens, the same on every rank

    def __init__(self, engine):
        settings = engine.config["decoding"]
        for key, (low, high) in LIMITS.items():
            value = settings[key]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ZooError(f"decoding.{key}={value!r} must be an integer in [{low}, {high}]")
        self.window, self.ngram, self.candidates = settings["window"], settings["ngram"], settings["candidates"]
        self.max_draft_tokens = (self.window + self.candidates) * (self.ngram - 1)
        if self.max_draft_tokens > MAX_BLOCK:
            raise ZooError(f"decoding=lookahead: (window + candidates) * (ngram - 1) = {self.max_draft_tokens} draft "
                           f"tokens per step; at most {MAX_BLOCK}")
        self.states: dict[int, RequestState] = {}

    def propose(self, requests):
        drafts = {}
        for request in requests:
            state = self.states.get(request.request_id)
            if state is None:
                state = self.states[request.request_id] = RequestState(request.prompt_token_ids, self.window,
                                                                       self.ngram)
            pooled = list(state.pool.get(request.token_at(request.num_tokens - 1), ()))
            tokens, parents = candidate_trie(pooled[len(pooled) - self.candidates:] if self.candidates else [])
            first = len(tokens)
            for l, level in enumerate(state.levels):
                for j, token in enumerate(level):
                    tokens.append(token)
                    if l:
                        parents.append(first + (l - 1) * self.window + j)
                    else:
                        parents.append(first + j - 1 if j else -1)
            drafts[request.request_id] = DraftBlock(tokens, parents)
            state.proposed = len(tokens)
        return drafts

    @hookimpl
    def zoo_step_results(self, results):
        """Outputs at the last level become the next level; each column gives an n-gram."""
        updates, rows = [], []
        for seq in results.sequences:
            state = self.states.get(seq.request.request_id)
            if state is None or seq.draft is None or len(seq.draft.tokens) != state.proposed:
                continue  # no window this step, or the scheduler cut it: keep the levels as they are
            last_level = len(seq.draft.tokens) - self.window
            updates.append(state)
            rows += seq.draft_logits_rows[last_level:]
        if not updates:
            return
        outputs = results.logits(rows).argmax(-1).tolist()
        for k, state in enumerate(updates):
            new_level = outputs[k * self.window:(k + 1) * self.window]
            for j in range(self.window):
                state.add([level[j] for level in state.levels] + [new_level[j]])
            state.levels = state.levels[1:] + [new_level]

    @hookimpl
    def zoo_request_finished(self, request):
        self.states.pop(request.request_id, None)


@hookimpl
def zoo_decoding_methods():
    return {"lookahead": Lookahead}
