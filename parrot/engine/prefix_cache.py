"""Prefix caching across requests: KV blocks of earlier token sequences, kept in host memory.

Chat clients and agents resend the whole conversation every turn. The prefix cache keeps the
keys and values of every request's prompt and output in blocks of ``block_tokens`` positions, so
the next request that starts with the same tokens copies them into its own KV cache and reads
only the rest of its prompt.

Keys. A block is named by a hash chain over token ids (as vLLM's ``kv_cache_utils`` names its
blocks): block i's key is ``blake2b(key of block i-1, scope, its block_tokens token ids)``, so a
key stands for the whole prefix up to the end of its block, and two sequences share block i
exactly when their first ``(i + 1) * block_tokens`` tokens and scopes are equal. Only full blocks
are named; the last partial block of a sequence is not cached.

Scope. Each block's key includes a scope string: the request's tenant (its API key and ``user``)
and its ``cache_salt``, so a tenant never reuses, and never times, another tenant's blocks.
Blocks wholly inside a configured shared prefix (a system prompt every tenant sends) are keyed
with the empty scope instead, and shared; the blocks after it carry the tenant's scope again.

Exactness. A block is copied into the request's own cache, so the KV a request reads is the KV
the block's first writer computed for the same tokens at the same positions. That equals what
the request would compute itself only if a position's keys and values do not depend on how the
prompt was chunked or batched; Parrot's compiled pass has that property (every row computed on
its own), so a hit gives the same logits bit for bit. The engine uses the cache only over a
backend that says so (``Forward.kv_layout``).

Ownership. The cache owns its blocks, in one anonymous memory mapping of the budget's size
(pages are taken as blocks are first written, so resident memory never exceeds the budget) cut
into slots of one block each. Running requests hold copies in their own KV caches, never
references: a block can be evicted at any time without touching a request. Eviction is least
recently used among leaves (blocks no cached block extends), so a chain is cut from its end and
never leaves unreachable blocks behind. Not thread-safe: the engine thread owns it.
"""

from __future__ import annotations

import hashlib
import mmap
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from parrot.engine.backend import KVLayout, TokenId

# Positions per block. Only whole blocks are reused, so a chat's next turn recomputes the end of
# the last answer that did not fill a block: 1.5 tokens on average with 4, 7.5 with vLLM's 16
# (which suits its GPU pages). Smaller blocks cost more hashes and copies, but little: for 1,024
# positions of the 1.5B coder (28 KB each) storing takes 7-17 ms and loading 6-7 ms with blocks
# of 4, 11-28 and 4-10 ms with 16 (blake2b over the ids: 0.24 and 0.12 ms; Xeon, 2026-11-26).
DEFAULT_BLOCK_TOKENS = 4
# The automatic budget: this share of the memory available once the model has loaded, at most
# MAX_AUTO_BYTES (llama.cpp's --cache-ram default is 8 GiB).
AUTO_SHARE = 0.25
MAX_AUTO_BYTES = 8 << 30


def block_keys(tokens: Sequence[TokenId], block_tokens: int, scope: str, shared_tokens: int = 0,
               start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Keys of the full blocks of ``tokens`` from block ``start`` on (``parent``: the key of block
    ``start - 1``). Blocks that end within the first ``shared_tokens`` tokens take the shared
    (empty) scope, the rest ``scope``."""
    keys = []
    salt = scope.encode()
    ids = np.asarray(tokens, dtype=np.int64)
    for i in range(start, len(tokens) // block_tokens):
        end = (i + 1) * block_tokens
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(b"" if end <= shared_tokens else salt)
        h.update(b"\0")
        h.update(ids[end - block_tokens : end].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


@dataclass
class _Block:
    slot: int
    parent: bytes | None
    children: int = 0


@dataclass(frozen=True)
class PrefixCacheStats:
    blocks: int
    bytes: int
    budget_bytes: int
    evicted_blocks: int


class PrefixCache:
    """KV blocks by key (module docstring), within ``budget_bytes`` of host memory."""

    def __init__(self, layout: KVLayout, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if block_tokens < 1:
            raise ValueError("block_tokens must be >= 1")
        self.layout = layout
        self.block_tokens = block_tokens
        self.block_bytes = layout.bytes_per_position * block_tokens
        self.capacity = max(0, budget_bytes) // self.block_bytes  # slots
        self.budget_bytes = self.capacity * self.block_bytes
        # [slot, k/v, layers, kv_heads, block_tokens, head_dim]; a private anonymous mapping takes
        # no memory until a slot is first written.
        shape = (self.capacity, 2, layout.layers, layout.kv_heads, block_tokens, layout.head_dim)
        if self.capacity:
            self._mapping = mmap.mmap(-1, self.budget_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            count = self.budget_bytes // layout.dtype.itemsize
            self._slab = torch.frombuffer(self._mapping, dtype=layout.dtype, count=count).view(shape)
        else:
            self._slab = torch.empty(shape, dtype=layout.dtype)
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()  # least recently used first
        self._free = list(range(self.capacity - 1, -1, -1))
        self.evicted_blocks = 0

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(len(self._blocks), len(self._blocks) * self.block_bytes, self.budget_bytes,
                                self.evicted_blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def match(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are cached."""
        n = 0
        while n < len(keys) and keys[n] in self._blocks:
            n += 1
        return n

    def load(self, keys: Sequence[bytes], positions: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the first ``positions`` positions of the blocks ``keys`` (all cached, in order, from
        the first) into ``k`` and ``v`` (``[layers, kv_heads, >= positions, head_dim]``), and mark
        them used now."""
        assert positions <= len(keys) * self.block_tokens
        b = self.block_tokens
        for i, key in enumerate(keys):
            n = min(b, positions - i * b)
            if n <= 0:
                break
            slot = self._slab[self._blocks[key].slot]
            k[:, :, i * b : i * b + n].copy_(slot[0, :, :, :n])
            v[:, :, i * b : i * b + n].copy_(slot[1, :, :, :n])
        # Most recent last, the chain's first block most recent of all: eviction takes leaves
        # first anyway, and this keeps the oldest entries leaves.
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def store(self, keys: Sequence[bytes], first: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Cache blocks ``first..len(keys)-1`` of a sequence whose full chain of keys is ``keys``
        and whose KV cache is ``k``, ``v`` (holding every position of those blocks). Blocks cached
        already are only marked used. Evicts least recently used leaves to make room; returns how
        many blocks were stored (fewer when the budget holds no more)."""
        b = self.block_tokens
        stored = 0
        for i in range(first, len(keys)):
            key = keys[i]
            parent = keys[i - 1] if i > 0 else None
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            if parent is not None and parent not in self._blocks:
                break  # the chain was cut before this block (evicted): it could never be reached
            slot = self._take_slot(protect=parent)
            if slot is None:
                break
            self._slab[slot, 0].copy_(k[:, :, i * b : (i + 1) * b])
            self._slab[slot, 1].copy_(v[:, :, i * b : (i + 1) * b])
            self._blocks[key] = _Block(slot, parent)
            if parent is not None:
                self._blocks[parent].children += 1
            stored += 1
        return stored

    def _take_slot(self, protect: bytes | None) -> int | None:
        """A free slot, evicting the least recently used leaf if there is none (never ``protect``,
        the parent of the block about to be stored)."""
        if self._free:
            return self._free.pop()
        for key, block in self._blocks.items():
            if block.children == 0 and key != protect:
                break
        else:
            return None
        del self._blocks[key]
        if block.parent is not None and block.parent in self._blocks:
            self._blocks[block.parent].children -= 1
        self.evicted_blocks += 1
        return block.slot


def auto_budget(available_bytes: int) -> int:
    """The default budget: ``AUTO_SHARE`` of the available memory, at most ``MAX_AUTO_BYTES``."""
    return int(min(MAX_AUTO_BYTES, max(0, available_bytes) * AUTO_SHARE))
