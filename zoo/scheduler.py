"""Continuous batching with chunked prefill.

Every request just needs its uncomputed tokens run through the model: a
prefill is many of them, a decode one (plus any draft tokens). Each step takes
running requests first, then admits waiting ones, until the token budget or
the sequence limit is reached. When the cache is full, the most recently
admitted request is preempted: its blocks are freed and it is recomputed from
its tokens later, which gives the same output as if it had run alone.

With an admission interval, waiting requests join a batch that is decoding at
most every few steps (or as soon as that many wait), so that arrivals one by
one do not make every step a prompt step.

Under tensor parallelism rank 0 alone decides: ``schedule`` records each
decision that changes state (preempt, run, admit, reset) in a log of integers,
and the other ranks ``replay`` it on their copies of the same requests, so
their block tables and queues stay those of rank 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from zoo.block_manager import BlockManager
from zoo.decoding import DraftBlock
from zoo.request import Request, Status

# Decisions in a schedule log, five integers each: (kind, request id, start, tokens, draft tokens); the last
# entry, DEFERRED, carries the admission interval's count in its start field.
PREEMPT, RUN, ADMIT, RESET, DEFERRED = 1, 2, 3, 4, 5
LOG_WIDTH = 5


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # cache index of the first token computed this step
    num_tokens: int  # committed tokens computed this step
    draft: DraftBlock | None = None
    # The step's input token is the previous step's, still on the device (an overlapped step, launched before
    # that token was committed): the layout writes a placeholder and the engine copies the token in.
    token_on_device: bool = False
    # True when this step reaches the request's last token, so it yields logits. Fixed when
    # scheduled: committing the step's tokens later must not change what the step was.
    samples: bool = field(init=False)

    def __post_init__(self):
        self.samples = self.token_on_device or self.start + self.num_tokens == self.request.num_tokens

    @property
    def num_query_tokens(self) -> int:
        return self.num_tokens + (len(self.draft.tokens) if self.draft else 0)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 step_resource=None, admission_interval: int = 1):
        """``step_resource(request)``: None, or ``(pool, item, capacity)`` when the request needs ``item``
        from a pool a step holds at most ``capacity`` distinct items of (LoRA adapters in device slots);
        a request whose item does not fit waits for a later step. ``admission_interval``: see
        :meth:`admits_waiting`."""
        self.blocks = block_manager
        self.step_resource = step_resource or (lambda request: None)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.admission_interval = admission_interval
        self.steps_deferred = 0  # steps since waiting requests were last let in

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admits_waiting(self) -> bool:
        """Whether this step lets waiting requests in. Always with an interval of 1, or when nothing runs; else
        once ``admission_interval`` steps have passed since the last time, or as soon as that many requests
        wait. A step that admits prompts runs them beside the decodes in one eager pass; steps of decodes alone
        replay CUDA graphs, so under a stream of arrivals (a server) batching the admissions keeps most steps on
        the graphs, at the cost of a few steps' wait before a new request starts. (vLLM's
        ``scheduler_delay_factor`` and TGI's ``waiting_served_ratio`` trade the same way.)"""
        return (self.admission_interval <= 1 or not self.running or len(self.waiting) >= self.admission_interval
                or self.steps_deferred + 1 >= self.admission_interval)

    def defer_admission(self) -> None:
        """A step passes without letting waiting requests in (one launched without scheduling, too)."""
        if self.waiting:
            self.steps_deferred += 1

    def decoding_requests(self) -> list[Request]:
        """Running requests whose next step is a single-token decode."""
        return [r for r in self.running if r.num_computed_tokens == r.num_tokens - 1]

    def schedule(self, drafts: dict[int, DraftBlock] | None = None,
                 log: list[int] | None = None) -> list[ScheduledRequest]:
        """This step's entries. ``log``: where to record the decisions, for other ranks to ``replay``."""
        scheduled = self._schedule(drafts or {}, log.extend if log is not None else (lambda decision: None))
        if log is not None:
            log.extend((DEFERRED, 0, self.steps_deferred, 0, 0))
        return scheduled

    def _schedule(self, drafts: dict[int, DraftBlock], record) -> list[ScheduledRequest]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        # Every decoding request's own token comes before any draft: drafts share what is left.
        decodes_after = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        held: dict = {}  # pool -> the distinct items this step holds
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if not self._fits(request, held):
                decodes_after -= request.num_tokens - request.num_computed_tokens == 1
                i += 1
                continue
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            decodes_after -= request.num_tokens - request.num_computed_tokens == 1
            draft = drafts.get(request.request_id)
            if draft is not None:  # only after a single committed token, and cut to what the budget leaves
                draft = draft.first(budget - 1 - decodes_after) if num_tokens == 1 else None
            entry = ScheduledRequest(request, request.num_computed_tokens, num_tokens, draft)
            while not self.blocks.ensure_slots(request, entry.start + entry.num_query_tokens):
                if entry.draft is not None:  # drafts are optional: cut them to the free slots before preempting
                    entry.draft = self._draft_within_free_slots(entry)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                record((PREEMPT, victim.request_id, 0, 0, 0))
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append(entry)
                record((RUN, request.request_id, entry.start, num_tokens,
                        len(entry.draft.tokens) if entry.draft else 0))
                budget -= entry.num_query_tokens
                i += 1
        # Admitting new work right after a preemption would only preempt again.
        seats = len(self.running) + sum(r.seats - 1 for r in self.running)
        if not self.waiting:
            return scheduled
        if not self.admits_waiting():
            self.defer_admission()
            return scheduled
        self.steps_deferred = 0
        while self.waiting and budget > 0 and seats + self.waiting[0].seats <= self.max_num_seqs and not preempted:
            request = self.waiting[0]
            if not self._fits(request, held):
                break  # in arrival order: it goes first once the step has room for it
            if not request.block_ids:
                self.blocks.allocate_cached_prefix(request)
            num_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.num_computed_tokens + num_tokens < request.bidirectional_prefix:
                # A bidirectional prefix is computed in one step: wait for a step with room for all of it.
                self._reset(request)
                record((RESET, request.request_id, 0, 0, 0))
                break
            if not self.blocks.ensure_slots(request, request.num_computed_tokens + num_tokens):
                # A waiting request holds no blocks: the ones it matched stay cached for its next try,
                # while running requests (or the preempted request ahead of it) can use them now.
                self._reset(request)
                record((RESET, request.request_id, 0, 0, 0))
                break
            record((ADMIT, request.request_id, request.num_computed_tokens, num_tokens, 0))
            self._admit(request)
            seats += request.seats
            scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_tokens))
            budget -= num_tokens
        return scheduled

    def _admit(self, request: Request) -> None:
        self.waiting.popleft()
        # Counted here, not per admission try: a request that had to wait would count its hits again.
        self.blocks.prefix_hit_tokens += request.num_cached_prompt_tokens
        request.status = Status.RUNNING
        self.running.append(request)

    def fingerprint(self) -> int:
        """A hash of the queues and the cache's use: equal on ranks that hold the same state."""
        return hash((tuple((r.request_id, r.num_computed_tokens, r.num_tokens) for r in self.running),
                     tuple(r.request_id for r in self.waiting), self.blocks.num_free_blocks, self.steps_deferred))

    def replay(self, log: list[int], drafts: dict[int, DraftBlock] | None = None) -> list[ScheduledRequest]:
        """Apply another rank's ``schedule`` log to these same requests: the same preemptions, admissions and
        block allocations, in the same order; returns the step's entries. ``drafts``: this rank's proposals,
        cut as the log says."""
        drafts = drafts or {}
        running = {r.request_id: r for r in self.running}
        scheduled = []
        for k in range(0, len(log), LOG_WIDTH):
            kind, request_id, start, num_tokens, num_draft = log[k:k + LOG_WIDTH]
            if kind == PREEMPT:
                self._preempt(running.pop(request_id))
            elif kind == DEFERRED:
                self.steps_deferred = start
            elif kind == RUN:
                request = running[request_id]
                draft = drafts[request_id].first(num_draft) if num_draft else None
                entry = ScheduledRequest(request, start, num_tokens, draft)
                self._take_slots(request, start + entry.num_query_tokens)
                scheduled.append(entry)
            else:  # ADMIT or RESET: the head of the queue
                request = self.waiting[0]
                if request.request_id != request_id:
                    raise RuntimeError(f"schedule replay: request {request_id} is not first in the queue")
                if not request.block_ids:
                    self.blocks.allocate_cached_prefix(request)
                if kind == RESET:
                    self._reset(request)
                    continue
                self._take_slots(request, start + num_tokens)
                self._admit(request)
                running[request_id] = request
                scheduled.append(ScheduledRequest(request, start, num_tokens))
        return scheduled

    def _take_slots(self, request: Request, num_slots: int) -> None:
        if not self.blocks.ensure_slots(request, num_slots):
            raise RuntimeError(f"schedule replay: no room for request {request.request_id}'s {num_slots} slots")

    def _fits(self, request: Request, held: dict) -> bool:
        """Whether the request's step resource fits; if so it is counted as held (the request is about to
        be scheduled, and one that is then preempted only leaves an item unused this step)."""
        need = self.step_resource(request)
        if need is None:
            return True
        pool, item, capacity = need
        items = held.setdefault(pool, set())
        if item not in items and len(items) >= capacity:
            return False
        items.add(item)
        return True

    def _draft_within_free_slots(self, entry: ScheduledRequest) -> DraftBlock | None:
        request = entry.request
        room = ((len(request.block_ids) + self.blocks.num_free_blocks) * self.blocks.block_size
                - entry.start - entry.num_tokens)
        return entry.draft.first(room) if room < len(entry.draft.tokens) else None

    def _reset(self, request: Request) -> None:
        self.blocks.free(request)
        request.num_computed_tokens = 0
        request.num_cached_prompt_tokens = 0

    def preempt_one_except(self, keep: list[Request]) -> bool:
        """Free blocks by preempting the latest running request not in ``keep``; False when there is none."""
        victim = next((r for r in reversed(self.running) if all(r is not k for k in keep)), None)
        if victim is None:
            return False
        self._preempt(victim)
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._reset(request)
        request.status = Status.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:  # ended before it ran again (aborted while preempted)
            self.waiting.remove(request)
        self.blocks.free(request)
