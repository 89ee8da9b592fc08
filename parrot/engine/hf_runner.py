"""The fallback forward: any transformers causal LM, one sequence at a time, with DynamicCache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache


class HFCache:
    """A transformers ``DynamicCache`` and the number of positions it holds.

    Every layer keeps every position, sliding-window layers too (the model's attention mask
    applies the window): transformers' sliding layers drop what falls out of the window, and then
    cannot be cropped back when a draft is rejected."""

    def __init__(self, max_positions: int) -> None:
        self.cache = DynamicCache()
        self.length = 0
        self.max_positions = max_positions

    @property
    def capacity(self) -> int:
        """A ``DynamicCache`` grows as needed, up to the context window."""
        return self.max_positions

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot crop a cache of {self.length} positions to {length}")
        if length < self.length:
            # transformers 5: crop(-n) removes the last n positions.
            self.cache.crop(length - self.length)
            self.length = length


class HFForward:
    """Forward passes through the transformers model itself (for architectures the native path lacks)."""

    def __init__(self, hf_model: Any, max_positions: int) -> None:
        self.model = hf_model
        self.device = hf_model.device
        self.dtype = hf_model.dtype
        self.max_positions = max_positions
        self.vocab_size = hf_model.config.vocab_size
        # DynamicCache is no TensorKVCache, and transformers' kernels pick their algorithms by
        # shape: a chunk's keys may differ in low bits from the same positions fed otherwise.
        self.kv_layout = None

    def new_cache(self, capacity: int) -> HFCache:
        return HFCache(self.max_positions)

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[HFCache, Sequence[int], int]]) -> list[torch.Tensor]:
        """Same contract as ``LlamaForward.forward``; the sequences run one after another."""
        results = []
        for cache, tokens, num_logits in batch:
            if cache.length + len(tokens) > self.max_positions:
                raise ValueError(
                    f"sequence of {cache.length + len(tokens)} tokens exceeds the context window ({self.max_positions})"
                )
            ids = torch.tensor([list(tokens)], device=self.device)
            positions = torch.arange(cache.length, cache.length + len(tokens), device=self.device)[None]
            out = self.model(
                input_ids=ids,
                past_key_values=cache.cache,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=max(num_logits, 1),
            )
            cache.length += len(tokens)
            logits = out.logits[0, out.logits.shape[1] - num_logits :].float() if num_logits else out.logits[0, :0].float()
            results.append(logits)
        return results
