"""Scheduler on its own: chunked prefill budgets, max_num_seqs, preemption, bidirectional prefixes,
and block invariants under random workloads.

No model runs here. ``Driver`` plays the engine's part for each step: it writes
the scheduled tokens' "K/V" into a fake cache (each slot holds the context its
token saw), commits ``num_computed_tokens``, samples a token from a fake model
when an entry reaches the request's last token, registers full blocks and
finishes requests at their ``max_new_tokens``. Reading the fake cache back
before each sample checks that shared and recomputed blocks hold what a request
running alone would have put there.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from zoo.block_manager import BlockManager
from zoo.decoding import DraftBlock
from zoo.request import Request, Status
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ADMIT, LOG_WIDTH, PREEMPT, RESET, RUN, ScheduledRequest, Scheduler


def model_token(tokens: list[int]) -> int:
    """The fake model's next token: it depends on the whole context, as a real model's does."""
    h = 17
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
    return h % 997


def alone_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(model_token(tokens))
    return tokens[len(prompt):]


class Driver:
    """The engine's side of the loop: schedule -> compute -> commit -> register / finish."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                 enable_prefix_caching: bool = True, admission_interval: int = 1):
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                                   admission_interval=admission_interval)
        self.kv: dict[tuple[int, int], tuple] = {}  # (block, offset) -> what that slot's K/V was computed from
        self.finished: list[Request] = []
        self.steps: list[list[tuple[int, int, int]]] = []  # per step: (request_id, start, num_tokens)
        self.cached_starts = 0  # admissions that skipped tokens thanks to the prefix cache
        self.accepted_drafts = 0

    def add(self, request_id: int, prompt, max_new_tokens: int, bidirectional_prefix: int = 0,
            cache_key: tuple = ()) -> Request:
        request = Request(request_id, list(prompt), SamplingParams(max_new_tokens=max_new_tokens))
        request.bidirectional_prefix = bidirectional_prefix
        if bidirectional_prefix:  # as the engine composes it: the prefix is part of every block's key
            cache_key = tuple(sorted([*cache_key, ("bidirectional", tuple(prompt[:bidirectional_prefix]))], key=repr))
        request.cache_key = cache_key
        self.scheduler.add(request)
        return request

    # ---------------------------------------------------------------- the fake cache

    @staticmethod
    def context(request: Request, position: int, tokens: list[int] | None = None) -> tuple:
        tokens = request.token_ids if tokens is None else tokens
        return request.cache_key, tuple(tokens[:max(position + 1, request.bidirectional_prefix)])

    def write(self, request: Request, position: int, content: tuple) -> None:
        block = request.block_ids[position // self.blocks.block_size]
        assert self.blocks.ref_counts[block] == 1, f"request {request.request_id} writes into shared block {block}"
        self.kv[block, position % self.blocks.block_size] = content

    def check_cache(self, request: Request, num_tokens: int) -> None:
        bs = self.blocks.block_size
        for p in range(num_tokens):
            found = self.kv.get((request.block_ids[p // bs], p % bs))
            assert found == self.context(request, p), f"request {request.request_id}: wrong K/V at position {p}"

    # ---------------------------------------------------------------- one step

    def step(self, drafts: dict[int, DraftBlock] | None = None) -> list[ScheduledRequest]:
        had_work = self.scheduler.has_work()
        scheduled = self.scheduler.schedule(drafts)
        assert scheduled or not had_work, "the scheduler placed nothing while requests were waiting"
        self.steps.append([(e.request.request_id, e.start, e.num_tokens) for e in scheduled])
        for entry in scheduled:
            self.run(entry)
        return scheduled

    def run(self, entry: ScheduledRequest) -> None:
        request = entry.request
        assert self.blocks.blocks_needed(entry.start + entry.num_query_tokens) <= len(request.block_ids)
        if entry.start < request.bidirectional_prefix:
            assert entry.start + entry.num_tokens >= request.bidirectional_prefix, "bidirectional prefix split"
        self.check_cache(request, entry.start)  # what this step attends to
        for p in range(entry.start, entry.start + entry.num_tokens):
            self.write(request, p, self.context(request, p))
        first = entry.start + entry.num_tokens
        if entry.draft is not None:
            for i, token in enumerate(entry.draft.tokens):  # a chain: draft token i sits at first + i
                self.write(request, first + i, self.context(request, first + i,
                                                            request.token_ids + entry.draft.tokens[:i + 1]))
        request.num_computed_tokens = first
        if not entry.samples:
            self.blocks.register_full_blocks(request)
            return
        self.check_cache(request, request.num_tokens)
        history = list(request.token_ids)
        tokens = []
        if entry.draft is not None:
            for token in entry.draft.tokens:
                if token != model_token(history):
                    break
                tokens.append(token)
                history.append(token)
            request.num_computed_tokens = first + len(tokens)
            self.accepted_drafts += len(tokens)
        tokens.append(model_token(history))
        for token in tokens:
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= request.params.max_new_tokens:
                request.finish("length")
                break
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        if request.is_finished:
            self.scheduler.finish(request)
            self.finished.append(request)
        else:
            self.blocks.trim(request, request.num_tokens)
            self.blocks.register_full_blocks(request)

    def run_until_done(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError("requests never finished")


def step_until(driver: Driver, condition, max_steps: int = 100) -> list[ScheduledRequest]:
    """Step, checking the invariants, until ``condition(scheduled)``; returns that step's entries."""
    for _ in range(max_steps):
        scheduled = driver.step()
        check_invariants(driver)
        if condition(scheduled):
            return scheduled
    raise AssertionError("the condition never held")


def check_invariants(driver: Driver) -> None:
    blocks, scheduler = driver.blocks, driver.scheduler
    assert all(r.status is Status.RUNNING for r in scheduler.running)
    assert all(r.status is Status.WAITING for r in scheduler.waiting)
    assert not {id(r) for r in scheduler.running} & {id(r) for r in scheduler.waiting}
    assert len(scheduler.running) <= scheduler.max_num_seqs
    holdings = Counter()
    for request in scheduler.running:
        assert len(set(request.block_ids)) == len(request.block_ids), f"a block twice in {request.block_ids}"
        holdings.update(request.block_ids)
        # Room for every computed token, and not more than its tokens need.
        assert blocks.blocks_needed(request.num_computed_tokens) <= len(request.block_ids)
        assert len(request.block_ids) <= blocks.blocks_needed(request.num_tokens)
        assert request.num_computed_tokens < request.num_tokens  # something left to compute: the next step's token
        assert request.num_hashed_blocks <= len(request.block_ids)
        driver.check_cache(request, request.num_computed_tokens)
    for request in scheduler.waiting:  # waiting requests hold nothing, not even their cache hits
        assert request.block_ids == [] and request.num_computed_tokens == 0
    assert all(request.block_ids == [] for request in driver.finished)
    assert min(blocks.ref_counts) >= 0, "a block was freed twice"
    assert sum(blocks.ref_counts) == sum(holdings.values())
    assert blocks.ref_counts == [holdings[b] for b in range(blocks.num_blocks)]
    for block in range(blocks.num_blocks):
        assert (block in blocks.free_blocks) == (blocks.ref_counts[block] == 0), block
    assert len(blocks.free_blocks) == blocks.num_free_blocks == blocks.num_blocks - len(holdings)


def entries(scheduled: list[ScheduledRequest]) -> list[tuple[int, int, int, bool]]:
    return [(e.request.request_id, e.start, e.num_tokens, e.samples) for e in scheduled]


# ---------------------------------------------------------------- chunked prefill


def test_a_long_prompt_is_prefilled_in_chunks_of_the_budget():
    driver = Driver(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    request = driver.add(0, range(30), max_new_tokens=3)
    chunks = [entries(driver.step()) for _ in range(6)]
    assert chunks == [[(0, 0, 8, False)], [(0, 8, 8, False)], [(0, 16, 8, False)], [(0, 24, 6, True)],
                      [(0, 30, 1, True)], [(0, 31, 1, True)]]
    assert request.is_finished and request.finish_reason == "length"
    assert request.output_token_ids == alone_output(list(range(30)), 3)
    assert not driver.scheduler.has_work() and driver.blocks.num_used_blocks == 0


def test_running_requests_go_first_then_waiting_ones_fill_the_budget():
    driver = Driver(num_blocks=64, block_size=4, max_num_batched_tokens=10)
    driver.add(0, range(25), max_new_tokens=2)
    assert entries(driver.step()) == [(0, 0, 10, False)]
    driver.add(1, range(100, 112), max_new_tokens=2)
    assert entries(driver.step()) == [(0, 10, 10, False)]  # the running prefill takes the whole budget
    assert [r.request_id for r in driver.scheduler.waiting] == [1]
    assert entries(driver.step()) == [(0, 20, 5, True), (1, 0, 5, False)]
    assert entries(driver.step()) == [(0, 25, 1, True), (1, 5, 7, True)]
    check_invariants(driver)
    assert entries(driver.step()) == [(1, 12, 1, True)]
    assert not driver.scheduler.has_work()


def test_decodes_and_a_prefill_chunk_share_one_budget():
    driver = Driver(num_blocks=64, block_size=4, max_num_batched_tokens=6)
    for i in range(3):
        driver.add(i, [i, i + 1], max_new_tokens=5)
    assert entries(driver.step()) == [(0, 0, 2, True), (1, 0, 2, True), (2, 0, 2, True)]
    driver.add(3, range(50, 70), max_new_tokens=1)
    assert entries(driver.step()) == [(0, 2, 1, True), (1, 2, 1, True), (2, 2, 1, True), (3, 0, 3, False)]
    assert entries(driver.step()) == [(0, 3, 1, True), (1, 3, 1, True), (2, 3, 1, True), (3, 3, 3, False)]
    for _ in range(20):
        scheduled = driver.step()
        assert sum(e.num_query_tokens for e in scheduled) <= 6
        check_invariants(driver)
        if not driver.scheduler.has_work():
            break
    assert [len(r.output_token_ids) for r in driver.finished] == [5, 5, 5, 1]


def test_every_token_of_the_budget_is_used_while_there_is_work():
    driver = Driver(num_blocks=64, block_size=2, max_num_batched_tokens=7)
    for i in range(4):
        driver.add(i, range(10 * i, 10 * i + 9), max_new_tokens=2)
    driver.step()
    driver.step()
    # 4 prompts of 9 tokens in chunks of at most 7: every step is full until the prompts are done.
    assert [sum(n for _, _, n in step) for step in driver.steps] == [7, 7]
    driver.run_until_done()
    assert all(sum(n for _, _, n in step) <= 7 for step in driver.steps)
    assert sum(n for step in driver.steps for _, _, n in step) == 4 * 9 + 4 * 1  # prompts + one decode each


# ---------------------------------------------------------------- max_num_seqs


def test_max_num_seqs_caps_the_running_requests():
    driver = Driver(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=100)
    requests = [driver.add(i, range(i, i + 5), max_new_tokens=2 + i) for i in range(4)]
    assert [e.request.request_id for e in driver.step()] == [0, 1]
    assert len(driver.scheduler.running) == 2 and len(driver.scheduler.waiting) == 2
    driver.step()  # request 0 finishes
    assert requests[0].is_finished
    assert [e.request.request_id for e in driver.step()] == [1, 2]  # its seat goes to the oldest waiting one
    while driver.scheduler.has_work():
        driver.step()
        check_invariants(driver)
    assert [r.request_id for r in driver.finished] == [0, 1, 2, 3]
    assert all(len(step) <= 2 for step in driver.steps)


# ---------------------------------------------------------------- preemption


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_the_newest_request_is_preempted_and_resumes_with_the_same_result(prefix_caching):
    # 6 blocks of 2: both prompts fit, but not old's 4 new tokens beside new's 8.
    driver = Driver(num_blocks=6, block_size=2, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    old = driver.add(0, [1, 2, 3, 4], max_new_tokens=4)
    new = driver.add(1, [5, 6, 7, 8], max_new_tokens=8)
    driver.step()
    check_invariants(driver)
    scheduled = step_until(driver, lambda _: new.num_preemptions)
    assert [e.request.request_id for e in scheduled] == [0]  # nothing is admitted in a step that preempted
    assert driver.scheduler.num_preemptions == 1 and old.num_preemptions == 0
    assert new.status is Status.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    assert driver.scheduler.waiting[0] is new
    generated = len(new.output_token_ids)
    assert generated > 0  # it keeps what it generated and recomputes it
    scheduled = step_until(driver, lambda scheduled: any(e.request is new for e in scheduled))
    (entry,) = [e for e in scheduled if e.request is new]
    if prefix_caching:  # its freed blocks kept their hashes: only the rest is recomputed
        assert 0 < entry.start and entry.start % 2 == 0
    else:
        assert entry.start == 0
    assert entry.start + entry.num_tokens == 4 + generated and entry.samples  # then it samples again
    driver.run_until_done()
    assert old.output_token_ids == alone_output([1, 2, 3, 4], 4)
    assert new.output_token_ids == alone_output([5, 6, 7, 8], 8)
    assert driver.blocks.num_free_blocks == 6 and driver.blocks.ref_counts == [0] * 6


def test_a_request_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    driver = Driver(num_blocks=4, block_size=2, max_num_batched_tokens=16, enable_prefix_caching=False)
    old = driver.add(0, [1, 2], max_new_tokens=4)
    new = driver.add(1, [3, 4, 5], max_new_tokens=4)
    driver.step()
    driver.step()
    assert driver.blocks.num_free_blocks == 0
    # old's next token fits in its 2 blocks; new's needs a third: new is the newest, so it gives way.
    assert entries(driver.step()) == [(0, 3, 1, True)]
    assert new.num_preemptions == 1 and old.num_preemptions == 0
    assert new.status is Status.WAITING and new.block_ids == [] and list(driver.scheduler.waiting) == [new]
    check_invariants(driver)
    driver.run_until_done()
    assert [r.request_id for r in driver.finished] == [0, 1]
    assert old.output_token_ids == alone_output([1, 2], 4)
    assert new.output_token_ids == alone_output([3, 4, 5], 4)


def test_the_newest_request_is_the_victim_when_an_older_one_asks_for_room():
    driver = Driver(num_blocks=5, block_size=2, max_num_batched_tokens=32, enable_prefix_caching=False)
    first = driver.add(0, [1, 2], max_new_tokens=6)
    second = driver.add(1, [3, 4, 5], max_new_tokens=6)
    for _ in range(3):
        driver.step()
    assert driver.blocks.num_free_blocks == 0 and len(first.block_ids) == 2 and len(second.block_ids) == 3
    third = driver.add(2, [9], max_new_tokens=1)
    assert entries(driver.step()) == [(0, 4, 1, True)]  # first needs a block for position 4: second gives its own
    assert second.num_preemptions == 1 and first.num_preemptions == 0
    assert list(driver.scheduler.waiting) == [second, third]  # the preempted request goes back to the front
    assert len(first.block_ids) == 3 and driver.blocks.num_free_blocks == 2
    check_invariants(driver)
    driver.run_until_done()
    assert first.output_token_ids == alone_output([1, 2], 6)
    assert second.output_token_ids == alone_output([3, 4, 5], 6)


def test_preemption_frees_the_newest_first_to_let_the_oldest_run():
    driver = Driver(num_blocks=6, block_size=1, max_num_batched_tokens=64, enable_prefix_caching=False)
    requests = [driver.add(i, [i + 1], max_new_tokens=6) for i in range(3)]
    driver.step()
    driver.step()  # each holds 2 blocks: full
    assert driver.blocks.num_free_blocks == 0
    scheduled = driver.step()
    assert [e.request.request_id for e in scheduled] == [0, 1]  # request 2 gave its blocks to 0 and 1
    assert [r.num_preemptions for r in requests] == [0, 0, 1]
    check_invariants(driver)
    assert entries(driver.step()) == [(0, 3, 1, True)]  # request 1 is the newest running one now
    assert [r.num_preemptions for r in requests] == [0, 1, 1]
    assert list(driver.scheduler.waiting) == requests[1:]  # back in the order they were admitted
    driver.run_until_done()
    assert requests[0].num_preemptions == 0  # the oldest always makes progress
    for i, request in enumerate(requests):
        assert request.output_token_ids == alone_output([i + 1], 6)
    assert driver.blocks.num_used_blocks == 0


def test_a_waiting_request_that_does_not_fit_holds_no_blocks():
    driver = Driver(num_blocks=4, block_size=2, max_num_batched_tokens=64)
    first = driver.add(0, [1, 2, 3, 4, 5], max_new_tokens=2)  # 3 blocks, 2 of them cached
    driver.step()
    second = driver.add(1, [1, 2, 3, 4, 9, 9, 9, 9], max_new_tokens=1)  # hits 2 blocks, needs 2 more: 1 free
    assert entries(driver.step()) == [(0, 5, 1, True)]
    assert first.is_finished
    assert second.block_ids == [] and second.num_computed_tokens == 0 and second.status is Status.WAITING
    check_invariants(driver)
    assert entries(driver.step()) == [(1, 4, 4, True)]  # now it fits, still reusing the cached prefix
    assert second.num_cached_prompt_tokens == 4


def test_drafts_are_dropped_before_anyone_is_preempted():
    driver = Driver(num_blocks=4, block_size=2, max_num_batched_tokens=32, enable_prefix_caching=False)
    a = driver.add(0, [1, 2, 3], max_new_tokens=4)
    b = driver.add(1, [4, 5, 6], max_new_tokens=4)
    driver.step()
    assert driver.scheduler.decoding_requests() == [a, b]
    # Three draft tokens for a (positions 4..6) need two more blocks: none is free.
    scheduled = driver.step({0: DraftBlock.chain([0, 0, 0])})
    assert [(e.request, e.draft) for e in scheduled] == [(a, None), (b, None)]
    assert a.num_preemptions == b.num_preemptions == 0
    driver.run_until_done()
    assert a.output_token_ids == alone_output([1, 2, 3], 4)
    assert b.output_token_ids == alone_output([4, 5, 6], 4)


def test_drafts_are_cut_to_the_free_slots_before_anyone_is_preempted():
    driver = Driver(num_blocks=5, block_size=2, max_num_batched_tokens=32, enable_prefix_caching=False)
    a = driver.add(0, [1, 2, 3], max_new_tokens=4)
    b = driver.add(1, [4, 5, 6], max_new_tokens=4)
    driver.step()
    # Three draft tokens for a need two more blocks; one is free, with room for two of them.
    scheduled = driver.step({0: DraftBlock.chain([0, 0, 0])})
    assert scheduled[0].draft.tokens == [0, 0] and scheduled[1].draft is None
    assert a.num_preemptions == b.num_preemptions == 0
    driver.run_until_done()
    assert a.output_token_ids == alone_output([1, 2, 3], 4)
    assert b.output_token_ids == alone_output([4, 5, 6], 4)


def test_a_draft_larger_than_the_budget_is_cut_to_fit():
    driver = Driver(num_blocks=16, block_size=2, max_num_batched_tokens=3)
    a = driver.add(0, [1, 2], max_new_tokens=6)
    driver.step()
    right = alone_output([1, 2], 6)[1:]
    (entry,) = driver.step({0: DraftBlock.chain(right[:3])})  # 1 + 3 query tokens > 3: its first 2 drafts stay
    assert entry.draft.tokens == right[:2] and entry.num_query_tokens == 3
    assert driver.accepted_drafts == 2
    driver.run_until_done()
    assert a.output_token_ids == alone_output([1, 2], 6)
    assert driver.blocks.num_used_blocks == 0


# ---------------------------------------------------------------- bidirectional prefixes


def test_a_bidirectional_prefix_waits_for_a_step_with_room_for_all_of_it():
    driver = Driver(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    decoder = driver.add(0, [1, 2], max_new_tokens=4)
    driver.step()
    glm = driver.add(1, range(10, 20), max_new_tokens=2, bidirectional_prefix=8)
    small = driver.add(2, [3], max_new_tokens=1)
    for start in (2, 3, 4):  # the decode takes 1 of 8 tokens: 7 are left, the prefix needs 8
        assert entries(driver.step()) == [(0, start, 1, True)]
        assert glm.status is Status.WAITING and glm.block_ids == [] and glm.num_computed_tokens == 0
        assert list(driver.scheduler.waiting) == [glm, small]  # and nothing overtakes it
    assert decoder.is_finished
    assert entries(driver.step()) == [(1, 0, 8, False)]  # all of the prefix in one step
    assert entries(driver.step()) == [(1, 8, 2, True), (2, 0, 1, True)]
    driver.run_until_done()
    assert glm.output_token_ids == alone_output(list(range(10, 20)), 2)


def test_a_bidirectional_prefix_that_fits_beside_the_decodes_is_admitted_at_once():
    driver = Driver(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    driver.add(0, [1, 2], max_new_tokens=4)
    driver.step()
    driver.add(1, range(10, 20), max_new_tokens=2, bidirectional_prefix=7)
    assert entries(driver.step()) == [(0, 2, 1, True), (1, 0, 7, False)]


def test_bidirectional_prefixes_share_blocks_only_with_the_same_prefix():
    driver = Driver(num_blocks=32, block_size=2, max_num_batched_tokens=16)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    driver.add(0, prompt, max_new_tokens=2, bidirectional_prefix=4)
    driver.run_until_done()
    same = driver.add(1, prompt, max_new_tokens=1, bidirectional_prefix=4)
    longer = driver.add(2, prompt, max_new_tokens=1, bidirectional_prefix=6)
    plain = driver.add(3, prompt, max_new_tokens=1)
    assert [(e.request.request_id, e.start) for e in driver.step()] == [(1, 6), (2, 0), (3, 0)]
    driver.run_until_done()  # the fake cache checks that every reused slot was computed in the same context
    for request in (same, longer, plain):
        assert request.output_token_ids == alone_output(prompt, 1)


def test_a_preempted_bidirectional_request_recomputes_its_prefix_in_one_step():
    driver = Driver(num_blocks=7, block_size=2, max_num_batched_tokens=6, enable_prefix_caching=False)
    a = driver.add(0, [1, 2], max_new_tokens=8)
    b = driver.add(1, [4, 5, 6, 7, 8], max_new_tokens=6, bidirectional_prefix=5)
    assert entries(driver.step()) == [(0, 0, 2, True)]  # 4 tokens left: b's prefix waits
    assert entries(driver.step()) == [(0, 2, 1, True), (1, 0, 5, True)]
    step_until(driver, lambda _: b.num_preemptions)
    generated = len(b.output_token_ids)
    scheduled = step_until(driver, lambda scheduled: any(e.request is b for e in scheduled))
    back = [e for e in scheduled if e.request is b]
    assert back[0].start == 0 and back[0].num_tokens >= 5
    assert sum(e.num_tokens for e in scheduled) <= 6
    driver.run_until_done()
    assert b.num_tokens == 5 + 6 and generated < 6
    assert a.output_token_ids == alone_output([1, 2], 8)
    assert b.output_token_ids == alone_output([4, 5, 6, 7, 8], 6)


# ---------------------------------------------------------------- statistics


def test_prefix_hit_tokens_counts_only_hits_that_are_used():
    driver = Driver(num_blocks=5, block_size=2, max_num_batched_tokens=64)
    driver.add(0, [1, 2, 3, 4, 5], max_new_tokens=2)
    driver.run_until_done()  # [1, 2] and [3, 4] stay cached
    big = driver.add(1, [7, 7, 7, 7, 7], max_new_tokens=2)  # 3 blocks, none of them cached ones
    driver.step()
    late = driver.add(2, [1, 2, 3, 4, 6], max_new_tokens=1)  # hits 2 cached blocks, needs 1 more: none free
    driver.step()
    assert late.status is Status.WAITING and big.is_finished
    assert entries(driver.step()) == [(2, 4, 1, True)]  # its second try fits
    assert late.num_cached_prompt_tokens == 4
    assert driver.blocks.prefix_hit_tokens == 4  # one admission that reused 4 tokens


def test_waiting_requests_join_a_decoding_batch_every_interval_steps():
    driver = Driver(num_blocks=64, block_size=4, admission_interval=3)
    a = driver.add(0, [1, 2, 3, 4], 30)
    assert [e.request for e in driver.step()] == [a]  # nothing runs: admitted at once
    b = driver.add(1, [5, 6], 30)
    assert [e.request for e in driver.step()] == [a]  # two steps sit out...
    assert [e.request for e in driver.step()] == [a]
    assert [e.request for e in driver.step()] == [a, b]  # ...the third lets it in
    group = [driver.add(2 + i, [7, i], 30) for i in range(3)]  # as many as the interval: at once
    assert [e.request for e in driver.step()] == [a, b, *group]
    late = driver.add(9, [8], 30)
    driver.step()
    assert late.status is Status.WAITING
    driver.run_until_done()
    for request in [a, b, *group, late]:
        assert request.output_token_ids == alone_output(request.prompt_token_ids, 30)


# ---------------------------------------------------------------- random workloads


def random_workload(seed: int) -> Driver:
    """Requests with shared prefixes arriving over time on a small cache; the invariants hold after every step."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 3, 4, 8])
    shared = [rng.randrange(40) for _ in range(rng.randint(4, 24))]
    plan = []
    for request_id in range(rng.randint(20, 40)):
        head = shared[:rng.randint(0, len(shared))] if rng.random() < 0.7 else []
        prompt = head + [rng.randrange(40) for _ in range(rng.randint(1, 12))]
        plan.append((request_id, prompt, rng.randint(1, 10)))
    budget = rng.choice([1, 2, 3, 5, 8, 16, 64])
    longest = max(len(prompt) + max_new for _, prompt, max_new in plan)
    driver = Driver(num_blocks=-(-longest // block_size) + rng.randint(0, 4),  # often too few: preemption
                    block_size=block_size, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget,
                    enable_prefix_caching=rng.random() < 0.8, admission_interval=rng.choice([1, 1, 2, 3]))
    use_drafts = rng.random() < 0.5
    requests = []
    pending = list(plan)
    for _ in range(2000):
        if pending and (not driver.scheduler.has_work() or rng.random() < 0.3):
            request_id, prompt, max_new = pending.pop(0)
            bidirectional = rng.randint(1, min(len(prompt), budget)) if rng.random() < 0.2 else 0
            key = rng.choice([(), (), (), ("adapter", 1)])
            requests.append(driver.add(request_id, prompt, max_new, bidirectional, key))
        if not driver.scheduler.has_work():
            if not pending:
                break
            continue
        drafts = None
        if use_drafts:
            drafts = {}
            for request in driver.scheduler.decoding_requests():
                if rng.random() < 0.5:
                    right = alone_output(request.token_ids, 3)
                    drafts[request.request_id] = DraftBlock.chain(
                        [t if rng.random() < 0.7 else rng.randrange(997) for t in right[:rng.randint(1, 3)]])
        running_before = list(driver.scheduler.running)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        scheduled = driver.step(drafts)
        # Running requests first, at their computed tokens, in admission order; then admitted ones.
        ids = [e.request.request_id for e in scheduled]
        assert len(set(ids)) == len(ids)
        continuing = [e for e in scheduled if e.request.request_id in computed_before]
        assert ids[:len(continuing)] == [e.request.request_id for e in continuing]
        for e in continuing:
            assert e.start == computed_before[e.request.request_id]
        for e in scheduled[len(continuing):]:
            assert e.start % block_size == 0
            assert e.start == 0 or driver.blocks.enable_prefix_caching
            driver.cached_starts += e.start > 0
        preempted = [r for r in running_before if r.status is Status.WAITING]
        if len(continuing) < len(scheduled):  # admitting: only when every running request got its turn
            assert not preempted and len(continuing) == len(running_before)
        # Chunks are as large as the remaining budget allows: one that stops short of the end used all of it.
        left = budget
        for e in scheduled:
            assert 1 <= e.num_tokens <= left
            assert e.samples or e.num_tokens == left
            left -= e.num_query_tokens
        assert left >= 0
        check_invariants(driver)
    assert not pending and not driver.scheduler.has_work()
    assert len(driver.finished) == len(requests) == len(plan)
    for request_id, prompt, max_new in plan:
        request = requests[request_id]
        assert request.is_finished and request.finish_reason == "length"
        assert request.output_token_ids == alone_output(prompt, max_new), request_id
    assert driver.blocks.ref_counts == [0] * driver.blocks.num_blocks  # nothing leaked
    assert driver.blocks.num_free_blocks == driver.blocks.num_blocks
    return driver


SEEDS = range(16)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workloads_keep_block_invariants(seed):
    random_workload(seed)


def test_random_workloads_exercise_preemption_prefix_hits_and_drafts():
    """The random workloads above are not vacuous: together they preempt, reuse prefixes, accept drafts
    and run bidirectional prefixes, over thousands of steps."""
    drivers = [random_workload(seed) for seed in SEEDS]
    assert sum(d.scheduler.num_preemptions for d in drivers) >= 10
    assert sum(d.cached_starts for d in drivers) >= 10
    assert sum(d.accepted_drafts for d in drivers) >= 10
    assert sum(r.bidirectional_prefix > 0 for d in drivers for r in d.finished) >= 10
    assert sum(len(d.steps) for d in drivers) >= 1000


def test_every_decoding_request_gets_its_token_before_drafts_share_the_rest():
    """Drafts never crowd a decoding request out of a step: its own token is reserved first."""
    driver = Driver(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    requests = [driver.add(i, [i + 1, i + 2], max_new_tokens=5) for i in range(4)]
    driver.step()  # the four prompts: 8 tokens, and each request's first token
    assert driver.scheduler.decoding_requests() == requests
    drafts = {r.request_id: DraftBlock.chain([9] * 6) for r in requests}
    scheduled = driver.step(drafts)
    assert [e.request.request_id for e in scheduled] == [0, 1, 2, 3]
    # 8 tokens: 4 own tokens, and the first request's draft takes the 4 left.
    assert [len(e.draft.tokens) if e.draft else 0 for e in scheduled] == [4, 0, 0, 0]


# ---------------------------------------------------------------- a follower replaying the leader's log


def state(driver: Driver) -> tuple:
    scheduler, blocks = driver.scheduler, driver.blocks
    return ([(r.request_id, r.num_computed_tokens, list(r.block_ids), r.status) for r in scheduler.running],
            [(r.request_id, r.num_computed_tokens, list(r.block_ids)) for r in scheduler.waiting],
            list(blocks.ref_counts), list(blocks.free_blocks), blocks.prefix_hit_tokens, scheduler.steps_deferred,
            [(r.request_id, r.output_token_ids) for r in driver.finished])


def replayed_workload(seed: int) -> Counter:
    """Tensor parallelism: rank 0 schedules and records its decisions; another rank replays them on its own
    copies of the requests. After every step both hold the same queues, block tables, free list and prefix
    hits. Returns how often each kind of decision (and a draft cut short) was replayed."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    shared = [rng.randrange(40) for _ in range(12)]
    plan = [(i, shared[:rng.randint(0, 12)] + [rng.randrange(40) for _ in range(rng.randint(1, 6))],
             rng.randint(1, 8)) for i in range(24)]
    longest = max(len(prompt) + max_new for _, prompt, max_new in plan)
    settings = dict(num_blocks=-(-longest // block_size) + rng.randint(0, 4),  # often too few: preemption
                    block_size=block_size, max_num_seqs=rng.randint(1, 5),
                    max_num_batched_tokens=rng.choice([3, 8, 64]), enable_prefix_caching=rng.random() < 0.8,
                    admission_interval=rng.choice([1, 1, 2, 3]))
    leader, follower = Driver(**settings), Driver(**settings)
    budget = settings["max_num_batched_tokens"]
    kinds = Counter()
    for _ in range(3000):
        if plan and (not leader.scheduler.has_work() or rng.random() < 0.3):
            request_id, prompt, max_new = plan.pop(0)
            bidirectional = rng.randint(1, min(len(prompt), budget)) if rng.random() < 0.15 else 0
            for driver in (leader, follower):
                driver.add(request_id, prompt, max_new, bidirectional)
        if not leader.scheduler.has_work():
            if not plan:
                break
            continue
        drafts = {}
        for request in leader.scheduler.decoding_requests():
            if rng.random() < 0.5:
                right = alone_output(request.token_ids, 2)
                drafts[request.request_id] = DraftBlock.chain([t if rng.random() < 0.7 else 0 for t in right])
        assert leader.scheduler.fingerprint() == follower.scheduler.fingerprint()
        log = []
        entries = leader.scheduler.schedule(drafts, log=log)
        mirrored = follower.scheduler.replay(log, drafts)
        kinds.update(log[k] for k in range(0, len(log), LOG_WIDTH))
        kinds["cut draft"] += sum(e.draft is not None and len(e.draft.tokens) < len(drafts[e.request.request_id].tokens)
                                  for e in entries)
        assert ([(e.request.request_id, e.start, e.num_tokens, e.num_query_tokens) for e in entries]
                == [(e.request.request_id, e.start, e.num_tokens, e.num_query_tokens) for e in mirrored])
        for driver, step in ((leader, entries), (follower, mirrored)):
            for entry in step:
                driver.run(entry)
        assert state(leader) == state(follower)
    assert not plan and not leader.scheduler.has_work() and not follower.scheduler.has_work()
    return kinds


def test_a_follower_replaying_the_leaders_log_holds_the_leaders_state():
    """Random workloads (preemption, prefix caching, drafts, bidirectional prefixes, admission intervals): the
    follower's state equals the leader's after every step, and every kind of decision was replayed."""
    kinds = sum((replayed_workload(seed) for seed in range(12)), Counter())
    assert all(kinds[kind] >= 5 for kind in (PREEMPT, RUN, ADMIT, RESET, "cut draft")), kinds
