"""What the engine needs from a model backend: forward passes over per-sequence KV caches.

``LlamaForward`` (the native forward), ``HFForward`` (any transformers model) and the scripted
test model (``loadtests/scripted.py``) implement these protocols structurally: a new backend
(other kernels, CUDA) is a new class with these members, not an edit of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar, runtime_checkable

import torch

TokenId = int


@runtime_checkable
class KVCache(Protocol):
    """The keys and values of one sequence, made by ``Forward.new_cache`` and fed to its passes.

    - ``length``: positions held, the tokens fed so far minus what ``crop`` removed. A pass
      feeding n tokens to the cache makes it n longer.
    - ``capacity``: positions the cache holds before it has to grow; a backend may grow it up to
      ``Forward.max_positions``, so this is a size hint, not a bound.
    - ``crop(length)``: forget every position from ``length`` on (``0 <= length <= self.length``);
      the next pass writes from there. Rejected draft tokens leave the cache this way.
    """

    @property
    def length(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def crop(self, length: int) -> None: ...


Cache = TypeVar("Cache", bound=KVCache)


@runtime_checkable
class Forward(Protocol[Cache]):
    """Forward passes of one model over any number of sequences at once.

    ``forward(batch)``: each item ``(cache, tokens, num_logits)`` feeds ``tokens`` after the
    ``cache.length`` positions its cache holds and grows the cache by ``len(tokens)``. The result
    has one float32 tensor per item, ``[num_logits, vocab_size]``: the logits after each of the
    item's last ``num_logits`` tokens (``num_logits`` may be 0, for a prompt chunk). Row i is the
    distribution of the token after ``tokens[len(tokens) - num_logits + i]``.

    ``max_positions``: the context window; no cache grows beyond it. ``vocab_size``: the width of
    the logits, which may exceed the tokenizer's vocabulary (padding ids).
    """

    @property
    def max_positions(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def new_cache(self, capacity: int) -> Cache:
        """An empty cache with room for ``capacity`` positions before it grows."""
        ...

    def forward(self, batch: Sequence[tuple[Cache, Sequence[TokenId], int]]) -> list[torch.Tensor]:
        """One pass over every item of ``batch``; logits ``[num_logits, vocab_size]`` per item."""
        ...
