"""``parrot serve`` on the tiny deterministic model, for tests that need a real server process
(signals): ``python -m tests.serve_tiny --port P [--delay S] [--drain-timeout S]``. Each forward
pass sleeps ``--delay`` seconds, so that requests stay in flight long enough to act on."""

from __future__ import annotations

import parrot  # noqa: F401  (sets OMP_WAIT_POLICY before torch starts its thread pool)

import argparse
import logging

from parrot.server.app import serve
from parrot.config import Config, DraftingConfig, ServerConfig
from tests.conftest import engine_builder
from tests.tiny import SlowForward, tiny_engine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    engine = tiny_engine("native", DraftingConfig(adaptive=False, max_draft=8))
    engine.forward = SlowForward(engine.forward, args.delay)
    config = Config(server=ServerConfig(port=args.port, drain_timeout_s=args.drain_timeout))
    return serve(config, builder=engine_builder(engine, "tiny"))


if __name__ == "__main__":
    raise SystemExit(main())
