"""Measure what a forward pass over 1..K tokens costs on this hardware, at start-up."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


def wait_for(tensors: Sequence[torch.Tensor]) -> None:
    """Return once a GPU has computed ``tensors`` (its calls return before the work is done), so
    that a pass's time is its time; on a CPU they are done already."""
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize(tensors[0].device)


def measure_cost_curve(forward: Any, max_tokens: int, context: int = 512, repeats: int = 9) -> list[float]:
    """``cost[t]`` = seconds of one pass feeding t tokens after ``context`` cached ones.

    ``cost[0]`` is 0. Points are measured at 1, 2, 3, 4, 5, 6, 8, 12, 16, ... and interpolated in
    between; the curve is made non-decreasing (a longer pass never costs less; noise aside).
    Other work on the machine only ever adds time, so each point is the *minimum* of
    ``repeats`` timings, taken round-robin over the points so that a burst of outside load
    spoils one sample of several points rather than every sample of one. (With 5 repeats, busy
    neighbours on 2 shared vCPUs still left some points up to 2x high; 9 take about 3 s.)
    """
    context = max(1, min(context, forward.max_positions - max_tokens - 1))
    vocab = forward.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (context,), generator=generator).tolist()
    cache = forward.new_cache(context + max_tokens)
    forward.forward([(cache, prompt, 1)])
    points = sorted({t for t in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64) if t <= max_tokens} | {max_tokens})
    measured = {t: float("inf") for t in points}
    for _ in range(2):  # warm-up: first calls allocate
        forward.forward([(cache, prompt[:1], 1)])
        cache.crop(context)
    for _ in range(repeats):
        for t in points:
            tokens = (prompt * (t // len(prompt) + 1))[:t]
            begin = time.perf_counter()
            wait_for(forward.forward([(cache, tokens, t)]))
            measured[t] = min(measured[t], time.perf_counter() - begin)
            cache.crop(context)
    cost = [0.0] * (max_tokens + 1)
    for left, right in zip(points, points[1:]):
        for t in range(left, right + 1):
            w = (t - left) / (right - left)
            cost[t] = measured[left] * (1 - w) + measured[right] * w
    cost[points[0]] = measured[points[0]]
    for t in range(2, max_tokens + 1):
        cost[t] = max(cost[t], cost[t - 1])
    return cost
