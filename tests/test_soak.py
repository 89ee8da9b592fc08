"""A short ``make soak`` on the tiny deterministic model over the embedded tokenizer (so grammars
are the real ones): 120 mixed requests from 8 clients against a real uvicorn server, drafts of up
to 4 tokens verified whole in every batch. Every request gets one outcome, none is lost, every
finished answer equals its sequential one, malformed requests get a 4xx in OpenAI's shape, and
the server ends idle having counted every request."""

from __future__ import annotations

import argparse
import asyncio
import os

import pytest

from loadtests.load_workload import DATA
from loadtests.soak import run
from loadtests.soak_report import summarize
from parrot.config import DraftingConfig
from parrot.engine.engine import Engine
from parrot.engine.llama import LlamaForward
from tests.conftest import start_server
from tests.tiny import tiny_hf_model


@pytest.fixture(scope="module")
def soak_server(embedded_tokenizer):
    if not (DATA / "schemas.jsonl").exists():
        pytest.skip(f"{DATA} is not here (a checkout without ../shared beside it)")
    # 2,048 positions: task prompts run to 3,000 characters.
    model = tiny_hf_model(seed=7, vocab_size=embedded_tokenizer.vocab_size, max_positions=2048)
    engine = Engine(LlamaForward(model, 2048), embedded_tokenizer, DraftingConfig(adaptive=False, max_draft=4), None)
    server = start_server(engine, loaded_name="tiny")
    yield server
    server.stop()


def test_a_short_soak_loses_nothing_and_every_answer_equals_its_sequential_one(soak_server):
    args = argparse.Namespace(requests=120, concurrency=8, duration=600, pool=16, warmup=8, recheck=4, max_tokens=16,
                              max_prompt_chars=3000, timeout=120, seed=1, data=DATA)
    result = asyncio.run(run(args, soak_server.url, os.getpid(), None))
    result.update(server_exit=None, server_log_problems=None)
    summary = summarize(result)
    goals = {goal: met for goal, met in summary["goals"].items() if not goal.startswith("RSS")}  # RSS of this process
    assert all(goals.values()), (goals, summary, [r for r in result["records"] if r["mismatch"] or r["error"]][:5])
    assert summary["recorded"] == summary["issued"] == 120 and summary["server_counted"] == 120
    outcomes = summary["outcomes"]
    assert outcomes["ok"] > 50 and outcomes["expected_4xx"] > 5 and outcomes["cancelled"] > 3, outcomes
    # Not vacuous: answers were compared, constrained outputs finished, drafts were verified in batches.
    assert summary["compared_soak"] >= outcomes["ok"] and summary["finished_constrained"] > 0
    assert summary["drafted"] > 0 and summary["accepted"] > 0, summary
    assert result["rss_kb"]["start"] and result["rss_kb"]["end"]
