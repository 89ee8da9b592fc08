"""Load the model and build the engine from the configuration (CLI, server and benchmarks)."""

from __future__ import annotations

import logging

from server.config import Config
from server.engine.costmodel import measure_cost_curve
from server.engine.engine import Engine
from server.engine.loader import LoadedModel, load_model

log = logging.getLogger("parrot.engine")


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
    engine = Engine(loaded.forward, loaded.tokenizer, drafting, cost, config.server.prefill_chunk,
                    config.server.prefill_chunk_busy)
    return loaded, engine
