"""Windowed dashboard statistics: the collector on fake requests, and ``GET /v1/stats`` end to end."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import httpx
import pytest

from parrot.engine.engine import SequenceStats, StepOutput
from parrot.engine.errors import ContextWindowExceeded, EngineError
from parrot.engine.scheduler import output_latency
from parrot.server.metrics import Metrics
from parrot.server.stats import Observers, StatsCollector, percentile
from tests.conftest import start_server


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake_handle(clock: FakeClock) -> SimpleNamespace:
    """A ``RequestHandle`` as the scheduler leaves it after admission."""
    return SimpleNamespace(enqueued_at=clock.now, last_output_at=None, stats=SequenceStats(), finish_reason=None,
                           error=None, cancelled=False)


def emit(collector: Observers | StatsCollector, clock: FakeClock, handle: SimpleNamespace, tokens: int, drafted: int,
         accepted: int, forced: int = 0) -> None:
    """One engine step for ``handle``, as the scheduler reports it: an output with a snapshot of
    the grown stats and its latency go to the observer hook, then the handle records them."""
    s = handle.stats
    stats = dataclasses.replace(s, forward_passes=s.forward_passes + 1, drafted_tokens=s.drafted_tokens + drafted,
                                accepted_tokens=s.accepted_tokens + accepted, forced_tokens=s.forced_tokens + forced)
    output = StepOutput(token_ids=[7] * tokens, text="x" * tokens, logprobs=None, finish_reason=None, stats=stats)
    collector.on_output(handle, output, output_latency(handle.enqueued_at, handle.last_output_at, tokens, clock.now))
    handle.last_output_at, handle.stats = clock.now, stats  # the scheduler records them after the hooks


@pytest.mark.parametrize(
    "samples, q, expected",
    [
        ([], 50, None),  # no data is null, not 0 (0 s would read as "instant")
        ([(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)], 50, 2.0),  # nearest rank, not the interpolated 2.5
        ([(1.0, 1), (2.0, 1), (3.0, 1), (4.0, 1)], 99, 4.0),
        ([(4.0, 1), (1.0, 1), (3.0, 1), (2.0, 1)], 50, 2.0),  # input order does not matter
        ([(0.1, 9), (5.0, 1)], 50, 0.1),  # weights count: one slow emission of 1 token is not the median
        ([(0.1, 9), (5.0, 1)], 95, 5.0),
    ],
)
def test_percentile_is_weighted_nearest_rank(samples, q, expected):
    assert percentile(samples, q) == expected


def test_collector_counts_latencies_tokens_and_speculation_per_window():
    clock = FakeClock()
    collector = StatsCollector(window_s=60, bucket_s=5, clock=clock)
    handle = fake_handle(clock)
    collector.on_queue(1, 0)
    clock.now += 0.5
    collector.on_admit(handle)
    collector.on_queue(0, 1)
    clock.now += 0.5
    emit(collector, clock, handle, tokens=1, drafted=0, accepted=0)  # first token: TTFT 1.0 s
    clock.now += 0.2
    emit(collector, clock, handle, tokens=4, drafted=5, accepted=3)  # 4 tokens in 0.2 s: ITL 0.05 s x 4
    clock.now += 0.1
    emit(collector, clock, handle, tokens=1, drafted=2, accepted=0)  # ITL 0.1 s x 1
    handle.finish_reason = "stop"
    collector.on_finish(handle)
    collector.on_queue(0, 0)

    snap = collector.snapshot()
    w = snap["window"]
    assert w["requests"] == {"ok": 1, "cancelled": 0, "error": 0}
    assert w["output_tokens"] == 6
    assert (w["forward_passes"], w["drafted_tokens"], w["accepted_tokens"], w["forced_tokens"]) == (3, 7, 3, 0)
    assert w["tokens_per_pass"] == pytest.approx(2.0) and w["accepted_per_pass"] == pytest.approx(1.0)
    assert w["ttft_s"] == {"p50": pytest.approx(1.0), "p99": pytest.approx(1.0), "count": 1}
    assert w["itl_s"]["p50"] == pytest.approx(0.05) and w["itl_s"]["p99"] == pytest.approx(0.1)
    assert w["itl_s"]["count"] == 5  # one sample per token after the first
    assert w["e2e_s"]["p50"] == pytest.approx(1.3)
    assert w["max_waiting"] == 1 and w["max_running"] == 1
    assert snap["current"] == {"waiting": 0, "running": 0}
    # Rates use the time the collector has existed, not the whole (mostly empty) window.
    assert w["span_s"] == pytest.approx(1.3)
    assert w["output_tokens_per_s"] == pytest.approx(6 / 1.3)
    assert sum(p["output_tokens_per_s"] > 0 for p in snap["series"]) == 1


def test_collector_forgets_buckets_older_than_the_window():
    clock = FakeClock()
    collector = StatsCollector(window_s=20, bucket_s=5, clock=clock)
    handle = fake_handle(clock)
    collector.on_admit(handle)
    emit(collector, clock, handle, tokens=3, drafted=0, accepted=0)
    handle.finish_reason = "stop"
    collector.on_finish(handle)
    assert collector.snapshot()["window"]["output_tokens"] == 3
    clock.now += 30
    snap = collector.snapshot()
    assert snap["window"]["output_tokens"] == 0 and snap["window"]["ttft_s"]["p50"] is None
    assert len(snap["series"]) == 4 and all(p["output_tokens_per_s"] == 0 for p in snap["series"])


def test_collector_counts_forced_tokens():
    clock = FakeClock()
    collector = StatsCollector(window_s=60, bucket_s=5, clock=clock)
    handle = fake_handle(clock)
    collector.on_admit(handle)
    emit(collector, clock, handle, tokens=7, drafted=0, accepted=0, forced=6)
    assert collector.snapshot()["window"]["forced_tokens"] == 6


def test_collector_separates_ok_cancelled_and_failed_requests():
    clock = FakeClock()
    collector = StatsCollector(window_s=60, bucket_s=5, clock=clock)
    ok, gone, failed, never_started = (fake_handle(clock) for _ in range(4))
    for h in (ok, gone, failed):
        collector.on_admit(h)
    ok.finish_reason = "stop"
    gone.cancelled, gone.finish_reason = True, "cancelled"
    failed.error, failed.finish_reason = EngineError("internal error while generating"), "error"
    never_started.stats, never_started.error = None, ContextWindowExceeded(500, 20, 512)
    for h in (ok, gone, failed, never_started):
        collector.on_finish(h)
    w = collector.snapshot()["window"]
    assert w["requests"] == {"ok": 1, "cancelled": 1, "error": 2}
    assert w["e2e_s"]["count"] == 1  # only completed requests have an end-to-end latency


@pytest.mark.parametrize(
    "last_output_at, tokens, expected",
    [
        (None, 3, (2.0, None)),  # the first output: TTFT only, however many tokens it has
        (9.5, 4, (None, 0.125)),  # later: time since the previous output per token (0.5 s / 4)
        (9.5, 0, (None, None)),  # no tokens (a stop string ended the text): no ITL sample
    ],
)
def test_output_latency_is_ttft_first_then_time_per_token(last_output_at, tokens, expected):
    latency = output_latency(enqueued_at=8.0, last_output_at=last_output_at, num_tokens=tokens, now=10.0)
    assert (latency.ttft_s, latency.itl_s) == expected


def test_metrics_and_stats_observe_the_same_latency_and_counters():
    clock = FakeClock()
    metrics, collector = Metrics(), StatsCollector(window_s=60, bucket_s=5, clock=clock)
    both = Observers(metrics, collector)
    handle = fake_handle(clock)
    handle.admitted_at = clock.now
    handle.request = SimpleNamespace(prompt_ids=[1, 2, 3])
    both.on_admit(handle)
    clock.now += 0.5
    emit(both, clock, handle, tokens=1, drafted=0, accepted=0)
    clock.now += 0.25
    emit(both, clock, handle, tokens=5, drafted=6, accepted=4, forced=1)
    handle.finish_reason = "stop"
    both.on_finish(handle)
    window = collector.snapshot()["window"]
    value = metrics.registry.get_sample_value
    assert value("parrot_time_to_first_token_seconds_sum") == pytest.approx(window["ttft_s"]["p50"]) == pytest.approx(0.5)
    assert value("parrot_inter_token_latency_seconds_count") == window["itl_s"]["count"] == 5
    assert value("parrot_inter_token_latency_seconds_sum") == pytest.approx(5 * window["itl_s"]["p50"]) == pytest.approx(0.25)
    for name in ("forward_passes", "drafted_tokens", "accepted_tokens", "forced_tokens"):
        assert value(f"parrot_{name}_total") == window[name] == handle.stats.counters()[name], name


def test_observers_fan_out_every_hook_in_order():
    calls: list[tuple[str, str]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def on_admit(self, handle):
            calls.append((self.name, "admit"))

        def on_output(self, handle, output, latency):
            calls.append((self.name, "output"))

        def on_finish(self, handle):
            calls.append((self.name, "finish"))

        def on_queue(self, waiting, running, kv_positions):
            calls.append((self.name, "queue"))

    fan = Observers(Recorder("a"), Recorder("b"))
    fan.on_admit(None)
    fan.on_output(None, None, None)
    fan.on_finish(None)
    fan.on_queue(0, 0, 0)
    assert calls == [(n, hook) for hook in ("admit", "output", "finish", "queue") for n in ("a", "b")]


@pytest.fixture(scope="module")
def stats_server(embedded_engine):
    """A server of its own, so that its statistics hold only this module's requests."""
    running = start_server(embedded_engine)
    yield running
    running.stop()


@pytest.mark.real_model
def test_stats_endpoint_shape_and_numbers_move_with_requests(stats_server):
    http_server = stats_server
    before = httpx.get(http_server.url + "/v1/stats").json()
    assert before["status"] == "ok" and before["model"]
    assert before["window_s"] == 300 and before["bucket_s"] == 5
    assert set(before["current"]) == {"waiting", "running"}
    for key in ("request_rate", "output_tokens_per_s", "ttft_s", "itl_s", "e2e_s", "accepted_per_pass",
                "tokens_per_pass", "drafted_tokens", "accepted_tokens", "forced_tokens", "forward_passes"):
        assert key in before["window"], key
    assert set(before["series"][-1]) >= {"t", "request_rate", "output_tokens_per_s", "ttft_p50", "ttft_p99",
                                          "itl_p50", "itl_p99", "e2e_p50", "e2e_p99", "tokens_per_pass",
                                          "accepted_per_pass", "drafted_tokens", "forced_tokens", "waiting", "running"}

    # A copying task, so that drafts are proposed and accepted.
    text = "The quick brown fox jumps over the lazy dog. " * 4
    r = httpx.post(http_server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Repeat this text exactly:\n\n" + text}],
        "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200
    used = r.json()["usage"]

    after = httpx.get(http_server.url + "/v1/stats").json()
    b, a = before["window"], after["window"]
    assert a["requests"]["ok"] == b["requests"]["ok"] + 1
    assert a["output_tokens"] == b["output_tokens"] + used["completion_tokens"]
    assert a["forward_passes"] == b["forward_passes"] + used["speculation"]["forward_passes"]
    assert a["drafted_tokens"] == b["drafted_tokens"] + used["speculation"]["drafted_tokens"]
    assert a["accepted_tokens"] == b["accepted_tokens"] + used["speculation"]["accepted_tokens"]
    assert a["ttft_s"]["count"] == b["ttft_s"]["count"] + 1 and a["ttft_s"]["p50"] > 0
    assert a["request_rate"] > 0 and a["output_tokens_per_s"] > 0 and a["tokens_per_pass"] >= 1
    assert after["time"] >= before["time"]


# -- the load generator (loadtests/load.py) against the same server -------------------------------


def test_task_mix_parses_weights_and_rejects_unknown_tasks():
    from loadtests.load_workload import TASKS, parse_mix

    assert parse_mix("all") == dict.fromkeys(TASKS, 1.0)
    assert parse_mix("summarization=2,grammar") == {"summarization": 2.0, "grammar": 1.0}
    assert parse_mix("grammar=1,open_chat=0") == {"grammar": 1.0}  # weight 0 leaves a task out
    for bad in ("poetry=1", "grammar=x", "grammar=-1", "grammar=0"):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_workload_order_depends_only_on_seed_and_index():
    from loadtests.load_workload import Prompt, Workload

    prompts = {"a": [Prompt(f"a{i}", "a", f"text a{i}") for i in range(5)], "b": [Prompt("b0", "b", "text b0")]}
    one, two = Workload(prompts, {"a": 1, "b": 3}, seed=7), Workload(prompts, {"a": 1, "b": 3}, seed=7)
    forward = [one.prompt(i).id for i in range(40)]
    backward = [two.prompt(i).id for i in reversed(range(40))][::-1]  # asked in another order
    assert forward == backward
    assert {p[0] for p in forward} == {"a", "b"}  # both tasks drawn
    assert forward != [Workload(prompts, {"a": 1, "b": 3}, seed=8).prompt(i).id for i in range(40)]


@pytest.mark.real_model
def test_load_generator_records_every_request_and_agrees_with_server_stats(stats_server, tmp_path):
    import asyncio

    from loadtests.load import build_parser, main_async, write_results

    # Its own small task file, so that the test does not depend on where ../shared/data is.
    data = tmp_path / "data"
    data.mkdir()
    sentences = ["she go to school every days.", "He have two cat.", "They was happy yesterday."]
    (data / "grammar.jsonl").write_text("".join(
        json.dumps({"id": f"g{i}", "task": "grammar", "prompt": "Correct the grammar: " + s}) + "\n"
        for i, s in enumerate(sentences)))
    before = httpx.get(stats_server.url + "/v1/stats").json()["window"]
    args = build_parser().parse_args(["--url", stats_server.url, "--data", str(data), "--mix", "grammar",
                                      "--concurrency", "1,2", "--compare", "--requests", "2", "--max-tokens", "6",
                                      "--warmup", "0"])
    result = asyncio.run(main_async(args))
    text = write_results(result, tmp_path, "load")
    after = httpx.get(stats_server.url + "/v1/stats").json()["window"]

    runs = result["runs"]
    assert [(r["load_label"], r["speculation_label"]) for r in runs] == [
        ("c=1", "on"), ("c=1", "off"), ("c=2", "on"), ("c=2", "off")]
    requests = [q for r in runs for q in r["requests"]]
    assert len(requests) == 8 and all(q["status"] == "ok" and q["http_status"] == 200 for q in requests)
    assert all(q["ttft_s"] > 0 and q["e2e_s"] >= q["ttft_s"] and q["completion_tokens"] >= 1 for q in requests)
    assert all(q["speculation"]["drafted_tokens"] == 0 for r in runs if r["speculation_label"] == "off" for q in r["requests"])
    # The same prompts in the same order with speculation on and off.
    assert [q["prompt_id"] for q in runs[0]["requests"]] == [q["prompt_id"] for q in runs[1]["requests"]]
    # Client and server count the same requests and tokens.
    assert after["requests"]["ok"] - before["requests"]["ok"] == 8
    assert after["output_tokens"] - before["output_tokens"] == sum(q["completion_tokens"] for q in requests)
    assert after["drafted_tokens"] - before["drafted_tokens"] == sum(q["speculation"]["drafted_tokens"] for q in requests)
    # Outputs: the table, every request in the JSON, the plots.
    assert "| on | c=1 | 2 | 0 | 0 |" in text and "load avg" in text and "speed-up" in text
    saved = json.loads((tmp_path / "load.json").read_text())
    assert sum(len(r["requests"]) for r in saved["runs"]) == 8
    for png in ("load_cdf.png", "load_sweep.png"):
        assert (tmp_path / png).stat().st_size > 10_000


# -- Grafana dashboard over /metrics -------------------------------------------------------------


def test_grafana_dashboard_queries_only_metrics_that_parrot_exports():
    import re
    from pathlib import Path

    from parrot.server.metrics import Metrics

    root = Path(__file__).resolve().parent.parent
    dashboard = json.loads((root / "configs" / "grafana" / "parrot-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {re.sub(r"_(bucket|sum|count)$", "", name) for e in exprs for name in re.findall(r"parrot_[a-z0-9_]+", e)}
    exported = set()
    for family in Metrics().registry.collect():
        exported |= {family.name, family.name + "_total"}
    assert used and used <= exported, used - exported
    # Every latency histogram and the speculation counters have a panel.
    for name in ("parrot_time_to_first_token_seconds", "parrot_inter_token_latency_seconds",
                 "parrot_e2e_request_latency_seconds", "parrot_drafted_tokens_total", "parrot_accepted_tokens_total",
                 "parrot_forced_tokens_total", "parrot_forward_passes_total", "parrot_requests_waiting"):
        assert name in used, name
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


@pytest.mark.real_model
def test_stats_count_tokens_forced_by_a_grammar(stats_server):
    before = httpx.get(stats_server.url + "/v1/stats").json()["window"]
    schema = {"type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"],
              "additionalProperties": False}
    r = httpx.post(stats_server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Name a colour as JSON."}], "max_tokens": 16, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}})
    assert r.status_code == 200, r.text
    after = httpx.get(stats_server.url + "/v1/stats").json()["window"]
    assert after["forced_tokens"] > before["forced_tokens"]  # at least '{"colour":"' is forced
