"""Load the model and build the engine from the configuration (CLI, server and benchmarks)."""

from __future__ import annotations

import logging

from parrot.config import Config
from parrot.engine.costmodel import measure_cost_curve
from parrot.engine.engine import Engine
from parrot.engine.backend import LoadedModel
from parrot.engine.loader import load_model
from parrot.engine.memory import available_bytes, release_free_memory
from parrot.engine.prefix_cache import PrefixCache, auto_budget

log = logging.getLogger("parrot.engine")


def _log_floor(loaded: LoadedModel, cost: list[float] | None, context: int = 512) -> None:
    """Log the physical floor of a one-token pass (bytes it reads over the memory bandwidth
    measured now) beside the measured pass, so a slow machine or a slow path shows at start-up."""
    if loaded.pass_report is None:
        return
    r = loaded.pass_report(context)
    measured = f"; measured {cost[1] * 1e3:.1f} ms ({cost[1] * 1e3 / r['floor_ms']:.2f}x)" if cost else ""
    log.info(
        "one-token pass at %d tokens of context reads %.0f MB (weights %.0f + KV cache %.0f); memory bandwidth "
        "%.1f GB/s; floor %.1f ms%s; kernels: %s",
        context, r["bytes_per_pass"] / 1e6, r["weight_bytes"] / 1e6, r["kv_bytes"] / 1e6, r["bandwidth"] / 1e9,
        r["floor_ms"], measured, loaded.details.get("kernels") or "none",
    )


def build_engine(config: Config) -> tuple[LoadedModel, Engine]:
    """Load the model once, measure the forward cost curve if drafting is adaptive, build the engine."""
    loaded = load_model(config.model)
    cost = None
    drafting = config.drafting
    if drafting.enabled and drafting.adaptive and drafting.max_draft > 0:
        cost = measure_cost_curve(loaded.forward, drafting.max_draft + 1)
        log.info(
            "forward cost for 1..%d tokens (ms): %s",
            drafting.max_draft + 1,
            " ".join(f"{c * 1e3:.0f}" for c in cost[1:]),
        )
    _log_floor(loaded, cost)
    release_free_memory()  # the cost curve's cache and passes
    engine = Engine(loaded.forward, loaded.tokenizer, drafting, cost, config.server.prefill_chunk,
                    config.server.prefill_chunk_busy, prefix_cache=new_prefix_cache(config, loaded),
                    track_cost=drafting.track_cost)
    return loaded, engine


def new_prefix_cache(config: Config, loaded: LoadedModel) -> PrefixCache | None:
    """The prefix cache the configuration asks for, or None (turned off, or the backend cannot
    reuse KV exactly); logs which and why."""
    settings = config.prefix_cache
    layout = loaded.forward.kv_layout
    if settings.bytes == 0:
        log.info("prefix cache off (prefix_cache.bytes = 0)")
        return None
    if layout is None:
        log.info("prefix cache off: the %s backend's KV of a position depends on how its prompt was chunked, "
                 "so a reused prefix could change outputs", loaded.backend)
        return None
    # Automatic: from the memory available now, capped by a cgroup's limit (in a container,
    # /proc/meminfo describes the whole node).
    budget = settings.bytes if settings.bytes > 0 else auto_budget(available_bytes() or 0)
    cache = PrefixCache(layout, budget, settings.block_tokens)
    if cache.capacity == 0:
        log.info("prefix cache off: a budget of %d bytes holds no block of %d bytes", budget, cache.block_bytes)
        return None
    log.info("prefix cache: %.0f MiB%s, %d blocks of %d tokens (%.0f KiB each)", cache.budget_bytes / 2**20,
             " (a quarter of the memory available)" if settings.bytes < 0 else "", cache.capacity,
             cache.block_tokens, cache.block_bytes / 1024)
    return cache
