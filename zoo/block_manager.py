"""Paged KV-cache blocks: allocation, reference counts and prefix caching.

A full block whose tokens (and all tokens before it) are known is hashed by
chaining its tokens onto its parent's hash; a later request whose prompt
starts with the same tokens reuses it. Freed blocks keep their hash until the
block is handed out again, oldest first, so recent prefixes survive longest.
"""

from __future__ import annotations

from collections import OrderedDict

from zoo.request import Request


# A block-table entry whose block was given back (outside a sliding window): index -1 reads the KV cache's last
# block, the scratch block, and the window's mask hides it.
FREED = -1


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, lookahead: int = 0):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Tokens past a block's end that its K/V also depend on (EAGLE's draft pairs a position with the
        # next token): a block is keyed on them too, so it is shared only where they are equal.
        self.lookahead = lookahead
        self.ref_counts = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: dict[int, int] = {}
        self.block_tokens: dict[int, tuple[int, ...]] = {}
        self.hash_to_block: dict[int, int] = {}
        self.prefix_hit_tokens = 0  # prompt tokens admitted requests took from the cache (counted by the scheduler)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def _chain_hash(self, parent: int | None, tokens: tuple[int, ...]) -> int:
        return hash((parent, tokens))

    @staticmethod
    def _root_hash(request: Request) -> int | None:
        """The parent of a request's first block: none, or what its K/V depends on besides its tokens.

        ``request.cache_key`` is composed at admission from every part that changes a block's
        contents (a bidirectional prefix, an adapter, images...); blocks are shared only between
        requests with equal keys.
        """
        return hash(("root", request.cache_key)) if request.cache_key else None

    def _take_free_block(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)
        old = self.block_hash.pop(block, None)
        if old is not None and self.hash_to_block.get(old) == block:
            del self.hash_to_block[old]
        self.block_tokens.pop(block, None)
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None

    def allocate_cached_prefix(self, request: Request) -> None:
        """Give a new request the cached blocks of its longest cached prefix.

        The last prompt token is always recomputed, so that the step that
        finishes the prompt has logits to sample from.
        """
        assert not request.block_ids
        if not self.enable_prefix_caching or request.params.wants_prompt_logits:
            return
        tokens = request.token_ids
        parent = self._root_hash(request)
        for i in range((len(tokens) - 1 - self.lookahead) // self.block_size):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size + self.lookahead])
            h = self._chain_hash(parent, chunk)
            block = self.hash_to_block.get(h)
            if block is None or self.block_tokens.get(block) != chunk:
                break
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            request.block_ids.append(block)
            parent = h
        request.num_hashed_blocks = len(request.block_ids)
        request.num_computed_tokens = len(request.block_ids) * self.block_size
        request.num_cached_prompt_tokens = request.num_computed_tokens

    def ensure_slots(self, request: Request, num_slots: int) -> bool:
        """Make room for ``num_slots`` cache entries; all or nothing."""
        missing = self.blocks_needed(num_slots) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > len(self.free_blocks):
            return False
        request.block_ids.extend(self._take_free_block() for _ in range(missing))
        return True

    def share(self, block_ids: list[int]) -> list[int]:
        """The same blocks for one more holder (a forked beam): their reference counts go up."""
        for block in block_ids:
            if block != FREED:
                self.ref_counts[block] += 1
        return list(block_ids)

    def release_blocks(self, block_ids: list[int]) -> None:
        for block in reversed(block_ids):
            if block != FREED:
                self._release(block)

    def drop_outside_window(self, request: Request, window: int, sinks: int) -> None:
        """Give back the blocks no later query of ``request`` can see: past the sliding window of its next token
        and after the attention sinks. Their places in the block table become FREED (read, masked, as the
        scratch block)."""
        first_visible = request.num_computed_tokens - window + 1  # the lowest index the next query sees
        bs = self.block_size
        for k in range(sinks // bs + (sinks % bs > 0), max(0, first_visible) // bs):
            if request.block_ids[k] != FREED:
                self._release(request.block_ids[k])
                request.block_ids[k] = FREED

    def take_private_copy(self, block: int) -> int | None:
        """A fresh block for a holder of shared ``block`` about to write into it (copy-on-write); None when no
        block is free. The caller copies the K/V and replaces its reference."""
        if not self.free_blocks:
            return None
        self._release(block)
        return self._take_free_block()

    def trim(self, request: Request, num_slots: int) -> None:
        """Give back blocks past ``num_slots`` entries (after rejected drafts)."""
        keep = self.blocks_needed(num_slots)
        while len(request.block_ids) > keep:
            self._release(request.block_ids.pop())

    def free(self, request: Request) -> None:
        # Tail blocks first, so that eviction takes a prefix's end before its start.
        for block in reversed(request.block_ids):
            if block != FREED:
                self._release(block)
        request.block_ids = []
        request.num_hashed_blocks = 0

    def register_full_blocks(self, request: Request) -> None:
        """Hash the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = min(request.num_computed_tokens, request.num_tokens - self.lookahead) // self.block_size
        if full <= request.num_hashed_blocks:
            return  # most steps: no block filled up, so skip building the token list
        if FREED in request.block_ids[:full]:  # a window gave blocks back: no chain of hashes goes past them
            request.num_hashed_blocks = full
            return
        tokens = request.token_ids
        for i in range(request.num_hashed_blocks, full):
            block = request.block_ids[i]
            parent = self.block_hash.get(request.block_ids[i - 1]) if i else self._root_hash(request)
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size + self.lookahead])
            h = self._chain_hash(parent, chunk)
            self.block_hash[block] = h
            self.block_tokens[block] = chunk
            self.hash_to_block.setdefault(h, block)
        request.num_hashed_blocks = max(request.num_hashed_blocks, full)
