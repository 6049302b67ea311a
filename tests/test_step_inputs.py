"""A step laid out on the device (StepLayout.runs) against the per-token lists it replaces.

The engine lays out a step of plain entries (no drafts, default positions, no bidirectional prefix among their
tokens) from three numbers per sequence; every other step builds per-token lists on the host. Both must fill the
static buffers with the same values and describe the step the same way (its kinds of rows, its logits rows).
The engine's tokens against transformers' through these layouts are in test_parity.py and test_mixed_graphs.py.
"""

from __future__ import annotations

import random

import pytest
import torch

from zoo.request import Request
from zoo.sampling_params import SamplingParams
from zoo.scheduler import ScheduledRequest
from zoo.step_inputs import StepLayout, device_lays_out, is_decode_token

try:
    import triton  # noqa: F401 - fused_ops' kernels run only with it

    from zoo import fused_ops
except ImportError:
    fused_ops = None

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_SIZE = 16
TOKENS, SEQS, BLOCKS_PER_SEQ = 4096, 16, 64
LAYOUT_FIELDS = ("input_ids", "offsets", "logits_rows", "logits_indices", "prompt_logits_rows", "context_lens",
                 "draft_starts", "decode_rows", "decode_seqs", "prompt_spans", "chunk_spans", "fresh_causal",
                 "splittable", "has_drafts")


def buffers(sliding_window: bool) -> dict[str, torch.Tensor]:
    """The runner's int64 input buffers (zoo.model_runner.ModelRunner), filled with -1 so that a slot either way
    leaves unwritten shows."""
    shapes = {"input_ids": (TOKENS,), "positions": (1, TOKENS), "slot_mapping": (TOKENS,), "token_seq": (TOKENS,),
              "token_query_index": (TOKENS,), "token_cache_index": (TOKENS,), "logits_indices": (TOKENS,),
              "block_tables": (SEQS, BLOCKS_PER_SEQ), "query_cache_index": (SEQS, TOKENS),
              "context_lens": (SEQS,), "draft_start": (SEQS,)}
    if sliding_window:
        shapes["query_index_in_sequence"] = (SEQS, TOKENS)
    return {name: torch.full(shape, -1, dtype=torch.int64, device=DEVICE) for name, shape in shapes.items()}


def random_step(rng: random.Random) -> list[ScheduledRequest]:
    """Decodes, whole prompts, chunks after cached tokens and one-token prompts, some asking for prompt logits."""
    step, free_blocks = [], rng.sample(range(10_000), SEQS * BLOCKS_PER_SEQ)
    for request_id in range(rng.randint(1, SEQS)):
        prompt = [rng.randrange(32_000) for _ in range(rng.choice([1, 5, 40, 300]))]
        wants_logits = rng.random() < 0.3
        request = Request(request_id, prompt, SamplingParams(prompt_logprobs=1 if wants_logits else None))
        kind = rng.choice(["decode", "prompt", "chunk"])
        if kind == "decode":
            request.output_token_ids = [rng.randrange(32_000) for _ in range(rng.randint(1, 30))]
            start, num_tokens = request.num_tokens - 1, 1
        elif kind == "prompt":
            start, num_tokens = 0, rng.randint(1, len(prompt))
        else:
            start = rng.randint(0, len(prompt) - 1)
            num_tokens = rng.randint(1, len(prompt) - start)
        request.block_ids = [free_blocks.pop() for _ in range(-(-(start + num_tokens) // BLOCK_SIZE))]
        step.append(ScheduledRequest(request, start, num_tokens))
    return step


def lay_out(step: list[ScheduledRequest], on_device: bool, sliding_window: bool, runs_writer=None):
    """ModelRunner.prepare's layout of a step without position hooks or graph padding, the one way or the other
    (on the device by ``runs_writer``: step_inputs' PyTorch ops by default)."""
    layout = StepLayout(1, BLOCK_SIZE)
    if on_device:
        layout.runs = []
    for b, entry in enumerate(step):
        if on_device:
            layout.add_run(b, entry)
        elif is_decode_token(entry):
            layout.add_decode_token(b, entry)
        else:
            layout.add_entry(b, entry, lambda request, indices: [list(indices)])
    written = buffers(sliding_window)
    if sliding_window:
        written["query_index_in_sequence"].fill_(-1)
    limits = layout.write(written, [e.request.block_ids for e in step], runs_writer)
    return layout, written, limits


@pytest.mark.parametrize("seed", range(40))
def test_a_step_laid_out_on_the_device_fills_the_buffers_as_the_lists_do(seed):
    rng = random.Random(seed)
    step = random_step(rng)
    assert all(map(device_lays_out, step))
    sliding_window = seed % 4 == 0
    lists, from_lists, lists_limits = lay_out(step, False, sliding_window)
    # every fifth step also through fused_ops' kernel (Triton's interpreter on CPU), as ModelRunner runs it on a GPU
    writer = fused_ops.lay_out_runs if fused_ops is not None and seed % 5 == 0 else None
    runs, from_runs, runs_limits = lay_out(step, True, sliding_window, writer)
    assert runs_limits == lists_limits
    for name in from_lists:
        assert torch.equal(from_runs[name], from_lists[name]), name
    for name in LAYOUT_FIELDS:
        assert getattr(runs, name) == getattr(lists, name), name


def test_entries_with_drafts_or_inside_a_bidirectional_prefix_keep_the_lists():
    from zoo.decoding import DraftBlock

    request = Request(0, list(range(20)), SamplingParams())
    request.output_token_ids = [5]
    request.block_ids = [0, 1]
    plain = ScheduledRequest(request, 20, 1)
    assert device_lays_out(plain)
    drafted = ScheduledRequest(request, 20, 1, draft=DraftBlock(tokens=[7, 8], parents=[-1, 0]))
    assert not device_lays_out(drafted)
    glm = Request(1, list(range(20)), SamplingParams())
    glm.bidirectional_prefix = 12
    glm.block_ids = [2, 3]
    assert not device_lays_out(ScheduledRequest(glm, 0, 20))  # its prefix's tokens see past themselves
    assert not device_lays_out(ScheduledRequest(glm, 8, 12))
    glm.output_token_ids = [3]
    assert device_lays_out(ScheduledRequest(glm, 20, 1))  # a decode after the prefix sees only its past
