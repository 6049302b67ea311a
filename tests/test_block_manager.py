"""BlockManager on its own: block allocation, reference counts, prefix caching and eviction.

No model runs here: requests are built by hand and "computed" by setting
``num_computed_tokens`` and registering their full blocks, as the engine does
after each step.
"""

from __future__ import annotations

import pytest

from zoo.block_manager import BlockManager
from zoo.request import Request
from zoo.sampling_params import SamplingParams


def make_request(request_id: int, tokens, cache_key: tuple = ()) -> Request:
    request = Request(request_id, list(tokens), SamplingParams())
    request.cache_key = cache_key
    return request


def compute(blocks: BlockManager, request: Request, num_tokens: int | None = None) -> None:
    """What the engine does for a request whose first ``num_tokens`` tokens went through the model."""
    num_tokens = request.num_tokens if num_tokens is None else num_tokens
    assert blocks.ensure_slots(request, num_tokens)
    request.num_computed_tokens = num_tokens
    blocks.register_full_blocks(request)


def admit_and_compute(blocks: BlockManager, request: Request) -> None:
    blocks.allocate_cached_prefix(request)
    compute(blocks, request)


def check_consistent(blocks: BlockManager, holders: list[Request]) -> None:
    """Ref counts are exactly the holdings of ``holders``; a block is free iff nobody holds it."""
    expected = [0] * blocks.num_blocks
    for request in holders:
        assert len(set(request.block_ids)) == len(request.block_ids), request.block_ids
        for block in request.block_ids:
            expected[block] += 1
    assert blocks.ref_counts == expected
    assert set(blocks.free_blocks) == {b for b in range(blocks.num_blocks) if expected[b] == 0}


# ---------------------------------------------------------------- allocation


def test_ensure_slots_allocates_whole_blocks_on_demand():
    blocks = BlockManager(num_blocks=8, block_size=4)
    request = make_request(0, range(10))
    assert blocks.ensure_slots(request, 1)
    assert len(request.block_ids) == 1
    assert blocks.ensure_slots(request, 4)  # still fits in the first block
    assert len(request.block_ids) == 1
    assert blocks.ensure_slots(request, 5)
    assert len(request.block_ids) == 2
    assert blocks.ensure_slots(request, 10)
    assert len(request.block_ids) == 3
    assert blocks.ensure_slots(request, 2)  # asking for fewer slots than held changes nothing
    assert len(request.block_ids) == 3
    assert blocks.num_free_blocks == 5 and blocks.num_used_blocks == 3
    check_consistent(blocks, [request])


def test_fresh_blocks_are_handed_out_in_order():
    blocks = BlockManager(num_blocks=6, block_size=2)
    a, b = make_request(0, range(6)), make_request(1, range(4))
    assert blocks.ensure_slots(a, 6) and blocks.ensure_slots(b, 4)
    assert a.block_ids == [0, 1, 2] and b.block_ids == [3, 4]


def test_ensure_slots_is_all_or_nothing():
    blocks = BlockManager(num_blocks=3, block_size=4)
    a, b = make_request(0, range(20)), make_request(1, range(20))
    assert blocks.ensure_slots(a, 8)  # 2 blocks, 1 left
    assert not blocks.ensure_slots(b, 9)  # needs 3
    assert b.block_ids == []
    assert not blocks.ensure_slots(a, 16)  # needs 2 more
    assert len(a.block_ids) == 2
    assert blocks.num_free_blocks == 1
    check_consistent(blocks, [a, b])
    assert blocks.ensure_slots(b, 4)  # exactly what is left
    assert blocks.num_free_blocks == 0
    assert not blocks.ensure_slots(a, 9)
    check_consistent(blocks, [a, b])


def test_free_gives_everything_back_and_twice_is_harmless():
    blocks = BlockManager(num_blocks=4, block_size=2)
    request = make_request(0, range(7))
    admit_and_compute(blocks, request)
    assert blocks.num_free_blocks == 0 and request.num_hashed_blocks == 3
    blocks.free(request)
    assert request.block_ids == [] and request.num_hashed_blocks == 0
    assert blocks.num_free_blocks == 4 and blocks.ref_counts == [0] * 4
    blocks.free(request)  # a request holds no blocks after free: nothing is released twice
    assert blocks.ref_counts == [0] * 4 and blocks.num_free_blocks == 4


def test_trim_gives_back_only_the_tail_blocks():
    blocks = BlockManager(num_blocks=6, block_size=4)
    request = make_request(0, range(5))
    assert blocks.ensure_slots(request, 12)  # e.g. room for draft tokens
    held = list(request.block_ids)
    blocks.trim(request, 5)
    assert request.block_ids == held[:2]
    assert held[2] in blocks.free_blocks and blocks.ref_counts[held[2]] == 0
    blocks.trim(request, 8)  # still needs both blocks
    assert request.block_ids == held[:2]
    blocks.trim(request, 100)  # never grows
    assert request.block_ids == held[:2]
    check_consistent(blocks, [request])
    blocks.trim(request, 0)
    assert request.block_ids == [] and blocks.num_free_blocks == 6


def test_trim_of_a_request_sharing_a_prefix_keeps_the_shared_blocks():
    blocks = BlockManager(num_blocks=8, block_size=2)
    a = make_request(0, [1, 2, 3, 4, 5])
    admit_and_compute(blocks, a)
    b = make_request(1, [1, 2, 3, 4, 9])
    blocks.allocate_cached_prefix(b)
    assert blocks.ensure_slots(b, 9)
    shared = b.block_ids[:2]
    blocks.trim(b, 5)
    assert b.block_ids[:2] == shared and len(b.block_ids) == 3
    assert [blocks.ref_counts[x] for x in shared] == [2, 2]
    check_consistent(blocks, [a, b])


# ---------------------------------------------------------------- prefix caching


def test_shared_prefix_blocks_are_reference_counted():
    blocks = BlockManager(num_blocks=10, block_size=4)
    a = make_request(0, range(10))  # 2 full blocks + 2 tokens
    admit_and_compute(blocks, a)
    b = make_request(1, list(range(8)) + [50, 51, 52])
    blocks.allocate_cached_prefix(b)
    assert b.block_ids == a.block_ids[:2]
    assert b.num_computed_tokens == 8 and b.num_cached_prompt_tokens == 8 and b.num_hashed_blocks == 2
    assert [blocks.ref_counts[x] for x in a.block_ids] == [2, 2, 1]
    compute(blocks, b)
    check_consistent(blocks, [a, b])
    blocks.free(a)
    assert [blocks.ref_counts[x] for x in b.block_ids[:2]] == [1, 1]
    assert not set(b.block_ids) & set(blocks.free_blocks)  # b still holds them: not evictable
    check_consistent(blocks, [b])
    blocks.free(b)
    assert blocks.ref_counts == [0] * 10 and blocks.num_free_blocks == 10


def test_three_requests_share_one_prefix():
    blocks = BlockManager(num_blocks=10, block_size=2)
    a = make_request(0, [7, 7, 8, 8, 9])
    admit_and_compute(blocks, a)
    others = [make_request(i, [7, 7, 8, 8, i]) for i in (1, 2)]
    for request in others:
        admit_and_compute(blocks, request)
        assert request.block_ids[:2] == a.block_ids[:2]
    assert [blocks.ref_counts[x] for x in a.block_ids[:2]] == [3, 3]
    check_consistent(blocks, [a] + others)


@pytest.mark.parametrize("length", range(1, 15))
def test_prefix_hit_is_whole_blocks_and_leaves_the_last_token(length):
    """12 tokens are cached (3 full blocks); any prompt starting with them reuses what it can."""
    block_size = 4
    blocks = BlockManager(num_blocks=16, block_size=block_size)
    cached = list(range(100, 112))
    admit_and_compute(blocks, make_request(0, cached))
    prompt = (cached + [1, 2, 3])[:length]
    request = make_request(1, prompt)
    blocks.allocate_cached_prefix(request)
    expected = block_size * min(3, (length - 1) // block_size)
    assert request.num_computed_tokens == expected
    assert request.num_computed_tokens % block_size == 0
    assert request.num_computed_tokens <= length - 1  # the last prompt token always runs, for its logits
    assert len(request.block_ids) == expected // block_size


def test_a_fully_cached_prompt_still_computes_its_last_token():
    blocks = BlockManager(num_blocks=8, block_size=4)
    admit_and_compute(blocks, make_request(0, range(8)))
    again = make_request(1, range(8))
    blocks.allocate_cached_prefix(again)
    assert again.num_computed_tokens == 4  # not 8: the second block holds the last token
    assert blocks.ensure_slots(again, 8)
    assert len(again.block_ids) == 2


def test_only_computed_full_blocks_are_cached():
    blocks = BlockManager(num_blocks=8, block_size=4)
    a = make_request(0, range(12))
    assert blocks.ensure_slots(a, 12)
    a.num_computed_tokens = 7  # a chunk of the prompt: one full block, one partial
    blocks.register_full_blocks(a)
    assert a.num_hashed_blocks == 1
    b = make_request(1, range(12))
    blocks.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 4 and b.block_ids == a.block_ids[:1]


def test_prefix_match_stops_at_the_first_different_block():
    blocks = BlockManager(num_blocks=12, block_size=2)
    a = make_request(0, [1, 2, 3, 4, 5, 6, 7])
    admit_and_compute(blocks, a)
    # Block 2 holds the same tokens as a's block 2, but after a different block 1: a different chain.
    b = make_request(1, [1, 2, 9, 9, 5, 6, 7])
    blocks.allocate_cached_prefix(b)
    assert b.block_ids == a.block_ids[:1] and b.num_computed_tokens == 2
    # The same tokens at another position are another block, too.
    c = make_request(2, [3, 4, 5, 6, 7])
    blocks.allocate_cached_prefix(c)
    assert c.block_ids == [] and c.num_computed_tokens == 0


def test_generated_tokens_are_cached_too():
    blocks = BlockManager(num_blocks=8, block_size=2)
    a = make_request(0, [1, 2, 3])
    admit_and_compute(blocks, a)
    a.output_token_ids.append(4)  # sampled; its K/V is computed on the next step
    compute(blocks, a, 4)
    b = make_request(1, [1, 2, 3, 4, 5])
    blocks.allocate_cached_prefix(b)
    assert b.block_ids == a.block_ids[:2] and b.num_computed_tokens == 4


def test_requests_with_different_cache_keys_never_share_blocks():
    blocks = BlockManager(num_blocks=32, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    plain = make_request(0, tokens)
    admit_and_compute(blocks, plain)
    adapter1 = make_request(1, tokens, cache_key=("adapter", 1))
    blocks.allocate_cached_prefix(adapter1)
    assert adapter1.block_ids == [] and adapter1.num_computed_tokens == 0
    compute(blocks, adapter1)
    adapter2 = make_request(2, tokens, cache_key=("adapter", 2))
    blocks.allocate_cached_prefix(adapter2)
    assert adapter2.block_ids == []
    compute(blocks, adapter2)
    assert not set(plain.block_ids) & set(adapter1.block_ids)
    assert not set(adapter1.block_ids) & set(adapter2.block_ids)
    # Equal keys share, whichever request computed the blocks.
    for key, owner in [((), plain), (("adapter", 1), adapter1), (("adapter", 2), adapter2)]:
        again = make_request(9, tokens, cache_key=key)
        blocks.allocate_cached_prefix(again)
        assert again.block_ids == owner.block_ids[:2], key
        blocks.free(again)
    check_consistent(blocks, [plain, adapter1, adapter2])


def test_equal_cache_keys_share_deep_prefixes():
    blocks = BlockManager(num_blocks=16, block_size=3)
    key = ("image", "cat.png")
    a = make_request(0, range(20), cache_key=key)
    admit_and_compute(blocks, a)
    b = make_request(1, list(range(18)) + [99], cache_key=("image", "cat.png"))  # equal, not the same object
    blocks.allocate_cached_prefix(b)
    assert b.num_computed_tokens == 18 and b.block_ids == a.block_ids[:6]


def test_identical_prompts_computed_together_do_not_share_but_both_cache():
    blocks = BlockManager(num_blocks=12, block_size=2)
    a, b = make_request(0, range(5)), make_request(1, range(5))
    blocks.allocate_cached_prefix(a)
    blocks.allocate_cached_prefix(b)  # nothing cached yet
    compute(blocks, a)
    compute(blocks, b)
    assert not set(a.block_ids) & set(b.block_ids)
    check_consistent(blocks, [a, b])
    c = make_request(2, range(5))
    blocks.allocate_cached_prefix(c)
    assert c.block_ids == a.block_ids[:2]  # the first registration wins
    for request in (a, b, c):
        blocks.free(request)
    # Reusing every block (a's duplicates and b's) leaves no stale entry behind.
    d = make_request(3, range(100, 124))
    compute(blocks, d)
    e = make_request(4, range(5))
    blocks.allocate_cached_prefix(e)
    assert e.block_ids == [] and e.num_computed_tokens == 0


def test_a_hash_collision_never_shares_blocks_with_other_tokens():
    blocks = BlockManager(num_blocks=8, block_size=2)
    blocks._chain_hash = lambda parent, tokens: 0  # every block hashes the same
    admit_and_compute(blocks, make_request(0, [1, 2, 3]))
    other = make_request(1, [8, 9, 3])
    blocks.allocate_cached_prefix(other)
    assert other.block_ids == [] and other.num_computed_tokens == 0


def test_prefix_caching_disabled_never_shares():
    blocks = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_request(0, range(7))
    admit_and_compute(blocks, a)
    assert blocks.block_hash == {} and blocks.hash_to_block == {}
    assert a.num_hashed_blocks == 0
    b = make_request(1, range(7))
    blocks.allocate_cached_prefix(b)
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.num_cached_prompt_tokens == 0
    compute(blocks, b)
    assert not set(a.block_ids) & set(b.block_ids)
    check_consistent(blocks, [a, b])
    blocks.free(a)
    c = make_request(2, range(7))
    blocks.allocate_cached_prefix(c)
    assert c.block_ids == []


# ---------------------------------------------------------------- eviction


def test_freed_blocks_keep_their_hash_until_reused():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = make_request(0, [1, 2, 3, 4, 5])
    admit_and_compute(blocks, a)
    held = list(a.block_ids)
    blocks.free(a)
    assert blocks.num_free_blocks == 4
    b = make_request(1, [1, 2, 3, 4, 6])
    blocks.allocate_cached_prefix(b)
    assert b.block_ids == held[:2] and b.num_computed_tokens == 4
    assert [blocks.ref_counts[x] for x in held[:2]] == [1, 1]
    assert not set(held[:2]) & set(blocks.free_blocks)  # a cache hit takes them out of the free list
    check_consistent(blocks, [b])


def test_free_releases_tail_blocks_before_the_head():
    blocks = BlockManager(num_blocks=5, block_size=2)
    a = make_request(0, range(6))
    compute(blocks, a)
    held = list(a.block_ids)
    blocks.free(a)
    assert list(blocks.free_blocks) == [3, 4] + held[::-1]  # never-used blocks are the oldest


def test_eviction_takes_the_oldest_freed_block_first():
    blocks = BlockManager(num_blocks=4, block_size=2)
    x = make_request(0, [1, 2, 3, 4])
    compute(blocks, x)  # blocks 0, 1
    y = make_request(1, [5, 6, 7, 8])
    compute(blocks, y)  # blocks 2, 3
    blocks.free(x)
    blocks.free(y)
    assert list(blocks.free_blocks) == [1, 0, 3, 2]
    # Three fresh blocks: x's tail, x's head, y's tail go; y's head is the newest and survives.
    z = make_request(2, [20, 21, 22, 23, 24, 25])
    compute(blocks, z)
    assert z.block_ids == [1, 0, 3]
    blocks.free(z)
    x_again = make_request(3, [1, 2, 3, 4, 0])
    blocks.allocate_cached_prefix(x_again)
    assert x_again.num_computed_tokens == 0  # overwritten: its old hash is gone
    y_again = make_request(4, [5, 6, 7, 8, 0])
    blocks.allocate_cached_prefix(y_again)
    assert y_again.block_ids == [2] and y_again.num_computed_tokens == 2


def test_evicting_a_prefix_tail_keeps_its_head_usable():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = make_request(0, [1, 2, 3, 4, 5, 6, 7])
    compute(blocks, a)  # 4 blocks, 3 full
    held = list(a.block_ids)
    blocks.free(a)
    b = make_request(1, [40, 41])
    compute(blocks, b)  # takes a's last block
    c = make_request(2, [50, 51])
    compute(blocks, c)  # takes a's third block
    d = make_request(3, [1, 2, 3, 4, 5, 6, 7])
    blocks.allocate_cached_prefix(d)
    assert b.block_ids == [held[3]] and c.block_ids == [held[2]]
    assert d.block_ids == held[:2] and d.num_computed_tokens == 4


def test_a_cache_hit_makes_a_block_recently_used():
    blocks = BlockManager(num_blocks=4, block_size=2)
    x = make_request(0, [1, 2, 3])
    compute(blocks, x)
    y = make_request(1, [5, 6, 7])
    compute(blocks, y)
    x_head, y_head = x.block_ids[0], y.block_ids[0]
    blocks.free(x)
    blocks.free(y)
    reuse = make_request(2, [1, 2, 9])  # hits x's head, then gives it back: now the newest
    admit_and_compute(blocks, reuse)
    assert reuse.block_ids[0] == x_head
    blocks.free(reuse)
    assert list(blocks.free_blocks)[-1] == x_head
    filler = make_request(3, range(30, 36))  # three blocks: y's head goes before x's
    compute(blocks, filler)
    assert x_head not in filler.block_ids and y_head in filler.block_ids
    probe = make_request(4, [1, 2, 0])
    blocks.allocate_cached_prefix(probe)
    assert probe.block_ids == [x_head]


def test_a_waiting_request_giving_back_cache_hits_frees_nothing_in_use():
    blocks = BlockManager(num_blocks=4, block_size=2)
    a = make_request(0, [1, 2, 3, 4, 5])
    admit_and_compute(blocks, a)  # 3 blocks, 1 left
    b = make_request(1, [1, 2, 3, 4, 6, 7, 8])
    blocks.allocate_cached_prefix(b)
    assert not blocks.ensure_slots(b, 7)  # needs 2 more, 1 free
    blocks.free(b)  # as the scheduler does for a request it cannot admit yet
    assert b.num_hashed_blocks == 0 and b.block_ids == []
    assert [blocks.ref_counts[x] for x in a.block_ids] == [1, 1, 1]
    check_consistent(blocks, [a])


def test_blocks_keyed_on_the_next_token_are_shared_only_where_it_is_equal():
    """lookahead=1 (EAGLE's draft pairs each position with the next token): a block is keyed on the token after it."""
    blocks = BlockManager(num_blocks=16, block_size=4, lookahead=1)
    a = make_request(0, list(range(10)))  # blocks [0..3], [4..7]; the second is keyed on token 8 too
    admit_and_compute(blocks, a)
    same_next = make_request(1, list(range(9)) + [50, 51])
    blocks.allocate_cached_prefix(same_next)
    assert same_next.block_ids == a.block_ids[:2] and same_next.num_computed_tokens == 8
    other_next = make_request(2, list(range(8)) + [60, 61, 62])
    blocks.allocate_cached_prefix(other_next)
    assert other_next.block_ids == a.block_ids[:1] and other_next.num_computed_tokens == 4
    # A block whose next token is not known yet is not cached at all.
    c = make_request(3, list(range(100, 108)))
    admit_and_compute(blocks, c)
    assert c.num_hashed_blocks == 1


def test_the_slots_of_a_range_are_its_indices_through_the_block_table():
    """A step's layout takes a chunk's cache slots a block's run at a time; the same as one index at a time."""
    import random

    from zoo.step_inputs import slots_of_range

    rng = random.Random(0)
    for _ in range(500):
        block_size, num_blocks = rng.choice([1, 2, 3, 16]), rng.randint(1, 12)
        block_ids = rng.sample(range(100), num_blocks)
        start = rng.randrange(num_blocks * block_size)
        end = rng.randint(start + 1, num_blocks * block_size)
        assert slots_of_range(block_ids, block_size, start, end) == [
            block_ids[i // block_size] * block_size + i % block_size for i in range(start, end)]
