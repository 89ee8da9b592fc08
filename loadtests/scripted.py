"""A "model" whose greedy choice at every position is the next token of a fixed script.

Greedy output does not depend on drafting, so once a request's output is known, everything the
engine decides while producing it (forced tokens, drafts, draft lengths, what is accepted) can be
replayed without the model: feed the engine this forward with ``script = prompt + output``.
Used by ``loadtests/replay_grammar.py`` and by engine tests that need exact token sequences in
front of the real tokenizer and grammar engine. It implements ``parrot.engine.backend.Forward``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class ScriptedCache:
    """A cache with nothing in it but its length: the script is the whole model."""

    def __init__(self, capacity: int) -> None:
        self.length = 0
        self.capacity = capacity

    def crop(self, length: int) -> None:
        self.length = length


class ScriptedForward:
    """Logits that put all the weight on ``script[position + 1]`` (``eos`` past its end)."""

    max_positions = 1 << 20
    kv_layout = None  # nothing to copy: the prefix cache does not apply

    def __init__(self, script: Sequence[int], vocab_size: int, eos: int) -> None:
        self.script = list(script)
        self.vocab_size = vocab_size
        self.eos = eos
        self.passes: list[tuple[int, int]] = []  # (tokens fed, logits asked) of every pass

    def new_cache(self, capacity: int) -> ScriptedCache:
        return ScriptedCache(capacity)

    def forward(self, batch: Sequence[tuple[ScriptedCache, Sequence[int], int]]) -> list[torch.Tensor]:
        out = []
        for cache, tokens, num_logits in batch:
            first = cache.length + len(tokens) - num_logits  # position of the first row with logits
            cache.length += len(tokens)
            self.passes.append((len(tokens), num_logits))
            logits = torch.zeros(num_logits, self.vocab_size)
            for row in range(num_logits):
                nxt = first + row + 1
                logits[row, self.script[nxt] if nxt < len(self.script) else self.eos] = 10.0
            out.append(logits)
        return out
