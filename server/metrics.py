"""Prometheus metrics (``GET /metrics``), fed by the scheduler on the engine thread.

Latencies are histograms in seconds: queue wait (submitted -> admitted), time to first token
(submitted -> first token out of the engine), inter-token latency and end-to-end latency
(submitted -> finished). A verification pass can emit several tokens at once; inter-token
latency is then the time since the previous emission divided by the number of tokens, observed
once per token (time per output token, as vLLM reports it).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.engine.engine import StepOutput
from server.engine.scheduler import RequestHandle

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
        self.drafted = Counter("parrot_drafted_tokens_total", "Draft tokens verified", registry=r)
        self.accepted = Counter("parrot_accepted_tokens_total", "Draft tokens accepted", registry=r)
        self.predicted = Counter("parrot_predicted_tokens_total", "Predicted Outputs tokens, by result", ["result"], registry=r)
        self.forced = Counter("parrot_forced_tokens_total", "Tokens forced by a grammar (fast-forward)", registry=r)
        self.forward_passes = Counter("parrot_forward_passes_total", "Forward passes that produced tokens", registry=r)
        self.running = Gauge("parrot_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("parrot_requests_waiting", "Requests waiting to be admitted", registry=r)
        self.model_loaded = Gauge("parrot_model_loaded", "1 once the model is loaded", registry=r)

    # Observer hooks (engine thread) ---------------------------------------------------------

    def on_admit(self, handle: RequestHandle) -> None:
        assert handle.admitted_at is not None
        self.queue_wait.observe(handle.admitted_at - handle.enqueued_at)
        self.prompt_tokens.inc(len(handle.request.prompt_ids))

    def on_output(self, handle: RequestHandle, output: StepOutput) -> None:
        now = time.perf_counter()
        n = len(output.token_ids)
        if handle.last_output_at is None:
            self.ttft.observe(now - handle.enqueued_at)
            n_itl, since = n - 1, None
        else:
            n_itl, since = n, handle.last_output_at
        if since is not None and n_itl > 0:
            per_token = (now - since) / n_itl
            for _ in range(n_itl):
                self.itl.observe(per_token)
        self.completion_tokens.inc(n)

    def on_finish(self, handle: RequestHandle) -> None:
        generation = handle.generation
        if generation is None:
            return
        self.e2e.observe(time.perf_counter() - handle.enqueued_at)
        s = generation.stats
        self.drafted.inc(s.drafted_tokens)
        self.accepted.inc(s.accepted_tokens)
        self.forward_passes.inc(s.forward_passes)
        self.forced.inc(s.forced_tokens)

    def on_queue(self, waiting: int, running: int) -> None:
        self.waiting.set(waiting)
        self.running.set(running)
