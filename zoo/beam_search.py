"""Beam search (``sampling.beam_width`` > 1) inside the continuous batch.

A beam-search request computes its prompt like any request. Its first logits fork it into ``beam_width`` beams:
requests of their own (admitted through the intake, so plugins see each) that run next to everything else as
ordinary one-token decodes. Each step, once every live beam of a group has its logits, the group moves as
transformers' beam search does (``GenerationMixin._beam_search``): the top ``2 x beam_width`` continuations of
all beams by summed log-probability; those ending in a stop token (or at the length limit) and ranked within
the first ``beam_width`` join the finished hypotheses, scored by ``sum / length ** length_penalty``; the best
unfinished ones become the next beams; ``early_stopping`` decides when no running beam can beat the finished.

A new beam takes its parent's block list, sharing every block (reference counts); only the block its next
token writes into is copied, when it is shared (copy-on-write at the block level). A step in which some beam of
a group did not run (a token budget smaller than the running decodes, a preempted beam recomputing) moves
nothing: the beams that ran forget their last token's computation and run it again with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zoo.request import Request, Status, TokenHistories
from zoo.scheduler import ScheduledRequest
from zoo.step import SequenceResult

NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class Hypothesis:
    token_ids: list[int]
    score: float  # cumulative log-prob / generated length ** length_penalty
    cumulative_logprob: float
    finished_by_stop: bool


@dataclass
class BeamGroup:
    leader: Request  # the request the caller holds; it is also beam 0 until the group ends
    beams: list[Request] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)  # each live beam's cumulative log-prob
    finished: list[Hypothesis] = field(default_factory=list)  # at most beam_width, best first
    improvable: bool = True  # transformers' is_early_stop_heuristic_unsatisfied


class BeamSearch:
    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[int, BeamGroup] = {}  # leader's id -> group
        self.group_of: dict[int, BeamGroup] = {}  # every beam's id -> its group

    @staticmethod
    def wants(request: Request) -> bool:
        return request.params.beam_width > 1

    def commit(self, entries: list[tuple[ScheduledRequest, int, list[int]]], logits: torch.Tensor) -> list:
        """Beam requests' sampling rows of a step ((entry, token offset, logits rows)); returns their results."""
        results, ran = [], {}
        for entry, offset, rows in entries:
            request = entry.request
            request.num_computed_tokens = entry.start + entry.num_tokens
            group = self.group_of.get(request.request_id)
            if group is None:  # the prompt's last chunk: fork into beams
                group = BeamGroup(request, [request], [0.0])
                self.groups[request.request_id] = group
                self.group_of[request.request_id] = group
            ran.setdefault(id(group), (group, {}))[1][request.request_id] = rows[0]
            results.append(SequenceResult(request, [], list(range(offset, offset + entry.num_tokens)), entry.start))
        for group, rows in ran.values():
            if all(beam.request_id in rows for beam in group.beams):
                finished = self._advance(group, logits[torch.tensor([rows[b.request_id] for b in group.beams],
                                                                    device=logits.device)])
                if finished:
                    results.append(SequenceResult(group.leader, list(group.leader.output_token_ids), [],
                                                  group.leader.num_tokens))
            else:  # not every beam ran: run this token again with the others next step
                for beam in group.beams:
                    if beam.request_id in rows:
                        beam.num_computed_tokens = beam.num_tokens - 1
        return results

    def forget(self, leader: Request) -> list[Request]:
        """Forget ``leader``'s group; its beams but the leader, for the caller to end."""
        group = self.groups.pop(leader.request_id, None)
        if group is None:
            return []
        for beam in group.beams:
            self.group_of.pop(beam.request_id, None)
        return [beam for beam in group.beams if beam is not leader]

    # ------------------------------------------------------------------ one step of a group

    def _advance(self, group: BeamGroup, logits: torch.Tensor) -> bool:
        """Move ``group`` by one token from its beams' logits rows; True when the group has ended."""
        engine, leader = self.engine, group.leader
        params, width = leader.params, leader.params.beam_width
        generated = len(leader.output_token_ids)  # the same for every beam
        engine.stats.record_first_token(leader)  # its first candidates: what its first token will be among
        prompt_len = len(leader.prompt_token_ids)
        limit = min(params.max_new_tokens, engine.max_model_len - prompt_len)
        # transformers applies its logits processors to the log-probs
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        logprobs = engine.sampler.process(logprobs, group.beams, TokenHistories(group.beams))
        vocab = logprobs.shape[1]
        scores = torch.tensor(group.scores + [NEG] * (width - len(group.beams)), device=logprobs.device)
        if len(group.beams) < width:  # the first step: every beam is the prompt, only beam 0 counts
            logprobs = torch.cat([logprobs, logprobs[:1].expand(width - len(group.beams), -1)])
        stop_ids = engine.sampler.stop_ids(leader)
        keep = max(2, 1 + len(stop_ids)) * width
        top_scores, top_index = torch.topk((logprobs + scores[:, None]).reshape(-1), keep)
        top_scores, top_index = top_scores.tolist(), top_index.tolist()
        candidates = [(index // vocab, index % vocab, score) for index, score in zip(top_index, top_scores)]
        at_limit = generated + 1 >= limit
        ends = [at_limit or token in stop_ids for _, token, _ in candidates]
        histories = [list(beam.output_token_ids) for beam in group.beams]
        # finished hypotheses: the top `width` candidates that end, unless no improvement is possible
        full = len(group.finished) == width and params.early_stopping is True
        new = []
        if group.improvable and not full:
            for rank, ((beam, token, score), end) in enumerate(zip(candidates, ends)):
                if end and rank < width:
                    new.append(Hypothesis(histories[beam] + [token], score / (generated + 1) ** params.length_penalty,
                                          score, token in stop_ids))
        group.finished = sorted(group.finished + new, key=lambda h: -h.score)[:width]  # stable: earlier first
        # next beams: the best candidates that do not end
        running = [(beam, token, score) for (beam, token, score), end in zip(candidates, ends) if not end][:width]
        done = at_limit or not running or len(running) < width
        if not done:
            group.scores = [score for _, _, score in running]
            best = group.scores[0] / ((limit if params.early_stopping == "never" and params.length_penalty > 0
                                       else generated + 1) ** params.length_penalty)
            worst = min(h.score for h in group.finished) if len(group.finished) == width else NEG
            group.improvable = group.improvable and (len(group.finished) < width or best > worst)
            done = not group.improvable or (len(group.finished) == width and params.early_stopping is True)
        if done:
            self._end(group)
            return True
        self._fork(group, [(beam, token) for beam, token, _ in running])
        return False

    def _fork(self, group: BeamGroup, picks: list[tuple[int, int]]) -> None:
        """The next beams: each a parent's tokens and blocks plus one token; a block about to be written and
        shared is copied."""
        engine, blocks = self.engine, self.engine.blocks
        old = [(list(b.output_token_ids), list(b.block_ids), b.num_hashed_blocks) for b in group.beams]
        while len(group.beams) < len(picks):  # the first step: the other beams join, sharing the prompt
            group.leader.seats = 1  # each beam now runs as a sequence of its own
            beam = engine.intake.admit_copy(group.leader)
            beam.seats = 1
            group.beams.append(beam)
            self.group_of[beam.request_id] = group
        new_blocks = [blocks.share(old[parent][1]) for parent, _ in picks]
        for _, block_ids, _ in old:
            blocks.release_blocks(block_ids)
        position = group.leader.num_tokens  # where each beam's new token goes
        column = position // engine.block_size
        sources, targets = [], []
        for block_ids in new_blocks:
            if position % engine.block_size and blocks.ref_counts[block_ids[column]] > 1:
                fresh = blocks.take_private_copy(block_ids[column])
                while fresh is None:  # the cache is full: another request makes room, as for any step
                    if not engine.scheduler.preempt_one_except(group.beams):
                        raise RuntimeError("no KV block left for a beam's copy of the block it writes into")
                    fresh = blocks.take_private_copy(block_ids[column])
                sources.append(block_ids[column])
                targets.append(fresh)
                block_ids[column] = fresh
        engine.runner.kv.copy_blocks(sources, targets)
        for beam, (parent, token), block_ids in zip(group.beams, picks, new_blocks):
            beam.output_token_ids = old[parent][0] + [token]
            beam.block_ids = block_ids
            beam.num_hashed_blocks = min(old[parent][2], position // engine.block_size)
            beam.num_computed_tokens = position
            if beam.status is not Status.RUNNING and beam not in engine.scheduler.waiting:
                beam.status = Status.RUNNING
                engine.scheduler.running.append(beam)
        engine.stats.generated_tokens += len(picks)

    def _end(self, group: BeamGroup) -> None:
        engine, leader = self.engine, group.leader
        best = group.finished[0]
        for beam in self.forget(leader):
            beam.finish("length")
            engine.finish(beam)
        tokenizer = engine.tokenizer
        leader.beam_hypotheses = [{"token_ids": h.token_ids, "text": tokenizer.decode(h.token_ids),
                                   "score": h.score, "cumulative_logprob": h.cumulative_logprob,
                                   "finish_reason": "stop" if h.finished_by_stop else "length"}
                                  for h in group.finished]
        leader.output_token_ids = list(best.token_ids)
        leader.output_text = ""
        leader.finish("stop" if best.finished_by_stop else "length")
        engine.finish(leader)
