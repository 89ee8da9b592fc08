"""Prometheus metrics (``GET /metrics``), fed by the scheduler on the engine thread.

Latencies are histograms in seconds: queue wait (submitted -> admitted), time to first token
(submitted -> first token out of the engine), inter-token latency and end-to-end latency
(submitted -> finished). TTFT and ITL are the scheduler's ``OutputLatency`` of each output (the
samples ``/v1/stats`` keeps too); a verification pass can emit several tokens at once, so an ITL
sample is observed once per token. The ``SPECULATION_COUNTERS`` are counters named
``parrot_<name>_total``, added when a request finishes.

Beside Parrot's own, the three gauges of the Gateway API Inference Extension's model-server
protocol (``docs/proposals/003-model-server-protocol`` in kubernetes-sigs/gateway-api-inference-
extension), named as vLLM and SGLang name theirs, so that an inference gateway's endpoint picker
can route to Parrot: ``parrot:num_requests_waiting`` (TotalQueuedRequests: requests submitted and
not yet admitted), ``parrot:num_requests_running`` (TotalRunningRequests: requests being
generated) and ``parrot:kv_cache_usage_perc`` (KVCacheUtilization, a fraction from 0 to 1 as
vLLM's ``kv_cache_usage_perc``). Parrot gives each running request its own KV cache, which may
grow to the context window, so the capacity it commits is ``server.max_running`` caches of the
context window: the gauge is the positions the running requests' caches hold over that.

The prefix cache (``parrot/engine/prefix_cache.py``): ``parrot:prefix_cache_queries_total`` and
``parrot:prefix_cache_hits_total``, prompt tokens looked up and found (vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``; their ratio is the hit rate), counted at each
request's first token; and the gauges ``parrot:prefix_cache_blocks``, ``_bytes``,
``_budget_bytes`` and ``_evicted_blocks``. ``parrot_pass_cost_seconds{tokens}``: the draft
length policy's pass-cost curve at each scrape.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from parrot.drafting import DraftLengthPolicy
from parrot.engine.interface import SPECULATION_COUNTERS, StepOutput
from parrot.engine.prefix_cache import PrefixCache
from parrot.engine.scheduler import OutputLatency, RequestHandle

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_wait = Histogram("parrot_queue_wait_seconds", "Time from submission to admission", buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("parrot_time_to_first_token_seconds", "Time from submission to the first token", buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("parrot_inter_token_latency_seconds", "Time per output token after the first", buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("parrot_e2e_request_latency_seconds", "Time from submission to the end of generation", buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("parrot_requests_total", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("parrot_prompt_tokens_total", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter("parrot_completion_tokens_total", "Tokens generated", registry=r)
        self.speculation = {
            name: Counter(f"parrot_{name}_total", description, registry=r) for name, description in SPECULATION_COUNTERS.items()
        }
        self.predicted = Counter("parrot_predicted_tokens_total", "Predicted Outputs tokens, by result", ["result"], registry=r)
        self.running = Gauge("parrot_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("parrot_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.model_loaded = Gauge("parrot_model_loaded", "1 once the model is loaded", registry=r)
        # The inference gateway's model-server protocol (module docstring).
        self.queued = Gauge("parrot:num_requests_waiting", "Requests waiting to be admitted (TotalQueuedRequests)", registry=r)
        self.active = Gauge("parrot:num_requests_running", "Requests being generated (TotalRunningRequests)", registry=r)
        self.kv_usage = Gauge("parrot:kv_cache_usage_perc",
                              "KV cache positions held over max_running context windows, 0 to 1 (KVCacheUtilization)", registry=r)
        self.kv_capacity = 0  # positions: max_running x the context window, set once the model loads
        # The prefix cache, named as vLLM names its counters (in tokens), and what it holds.
        self.prefix_queries = Counter("parrot:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up",
                                      registry=r)
        self.prefix_hits = Counter("parrot:prefix_cache_hits", "Prefix cache hits, in prompt tokens reused", registry=r)
        self.prefix_blocks = Gauge("parrot:prefix_cache_blocks", "KV blocks the prefix cache holds", registry=r)
        self.prefix_bytes = Gauge("parrot:prefix_cache_bytes", "Bytes of KV the prefix cache holds", registry=r)
        self.prefix_budget = Gauge("parrot:prefix_cache_budget_bytes", "The prefix cache's budget (0: off)", registry=r)
        self.prefix_evictions = Gauge("parrot:prefix_cache_evicted_blocks",
                                      "Blocks evicted from the prefix cache since start-up", registry=r)

    def watch_prefix_cache(self, cache: PrefixCache | None) -> None:
        """Read the prefix cache's holdings at every scrape (ints read without the engine's lock)."""
        if cache is None:
            return
        self.prefix_blocks.set_function(lambda: cache.stats().blocks)
        self.prefix_bytes.set_function(lambda: cache.stats().bytes)
        self.prefix_budget.set_function(lambda: cache.budget_bytes)
        self.prefix_evictions.set_function(lambda: cache.evicted_blocks)

    def watch_cost_curve(self, policy: DraftLengthPolicy | None) -> None:
        """The drafting's pass-cost curve as it stands at each scrape (``drafting.track_cost``
        keeps it current), at 1, 2, 4, 8, 16 tokens and the longest it holds."""
        if policy is None:
            return
        gauge = Gauge("parrot_pass_cost_seconds", "Seconds of a forward pass over `tokens` rows, as the draft "
                      "length policy estimates it", ["tokens"], registry=self.registry)
        last = len(policy.cost) - 1
        for tokens in sorted({t for t in (1, 2, 4, 8, 16) if t <= last} | {last}):
            gauge.labels(tokens=str(tokens)).set_function(lambda t=tokens: policy.cost[t])

    # Observer hooks (engine thread) ---------------------------------------------------------

    def on_admit(self, handle: RequestHandle) -> None:
        assert handle.admitted_at is not None
        self.queue_wait.observe(handle.admitted_at - handle.enqueued_at)
        self.prompt_tokens.inc(len(handle.request.prompt_ids))

    def on_output(self, handle: RequestHandle, output: StepOutput, latency: OutputLatency) -> None:
        n = len(output.token_ids)
        if latency.ttft_s is not None:
            self.ttft.observe(latency.ttft_s)
            self.prefix_queries.inc(output.stats.prefix_query_tokens)
            self.prefix_hits.inc(output.stats.cached_tokens)
        if latency.itl_s is not None:
            for _ in range(n):
                self.itl.observe(latency.itl_s)
        self.completion_tokens.inc(n)

    def on_finish(self, handle: RequestHandle) -> None:
        if handle.stats is None:  # it never reached the engine
            return
        self.e2e.observe(time.perf_counter() - handle.enqueued_at)
        for name, value in handle.stats.counters().items():
            self.speculation[name].inc(value)

    def on_queue(self, waiting: int, running: int, kv_positions: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
        self.queued.set(waiting)
        self.active.set(running)
        if self.kv_capacity:
            self.kv_usage.set(min(1.0, kv_positions / self.kv_capacity))
