"""What the engine needs from a model backend: forward passes over per-sequence KV caches, and
the ``LoadedModel`` a backend hands the server.

``LlamaForward`` (the native forward), ``HFForward`` (any transformers model) and the scripted
test model (``loadtests/scripted.py``) implement these protocols structurally. A new backend is
one module that registers itself (``backends/registry.py``): a forward with these members and
the loading that builds it, with no edit of the engine or the loader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from parrot.tokenizer import Tokenizer

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


@runtime_checkable
class TensorKVCache(KVCache, Protocol):
    """A cache held as two tensors ``k``, ``v``: ``[layers, kv_heads, capacity, head_dim]``, positions
    ``0..length-1`` valid. ``reserve(n)`` makes room for n positions; setting ``length`` declares
    positions written from outside (the prefix cache copies cached blocks in this way)."""

    k: torch.Tensor
    v: torch.Tensor

    def reserve(self, length: int) -> None: ...


@dataclass(frozen=True)
class KVLayout:
    """The shape of one position in a ``TensorKVCache``: keys and values of every layer."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype.itemsize


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

    ``kv_layout``: not None when the backend's caches are ``TensorKVCache``s of that layout and a
    position's keys and values depend only on the tokens up to it, never on how they were
    chunked or batched into passes: then positions copied from another cache holding the same
    tokens are exactly the ones a pass would write, and the prefix cache may reuse them
    (``prefix_cache.py``). None where either does not hold.
    """

    @property
    def max_positions(self) -> int: ...

    @property
    def kv_layout(self) -> KVLayout | None: ...

    @property
    def vocab_size(self) -> int: ...

    def new_cache(self, capacity: int) -> Cache:
        """An empty cache with room for ``capacity`` positions before it grows."""
        ...

    def forward(self, batch: Sequence[tuple[Cache, Sequence[TokenId], int]]) -> list[torch.Tensor]:
        """One pass over every item of ``batch``; logits ``[num_logits, vocab_size]`` per item."""
        ...


def context_window(model_config: Any) -> int:
    """The positions a model's config says it reads (4,096 where it does not say)."""
    return int(getattr(model_config, "max_position_embeddings", 0) or 4096)


@dataclass
class LoadedModel:
    """A model ready to serve, as a backend loaded it."""

    forward: Forward[Any]
    tokenizer: Tokenizer
    name: str
    device: torch.device
    dtype: torch.dtype
    backend: str  # the registered name of the backend that loaded it
    context_window: int
    load_seconds: float = 0.0
    # What the backend says about it (``Backend.describe``): the start-up log and /health.
    details: dict[str, Any] = field(default_factory=dict)
    # What a one-token pass at a given context must read and the bandwidth measured now (the
    # start-up log's floor), where the backend can say.
    pass_report: Callable[[int], dict[str, float]] | None = None
