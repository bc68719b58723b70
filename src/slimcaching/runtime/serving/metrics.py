"""Prometheus metrics of ``slimcaching serve`` (prometheus-client, the ``serve`` extra).

One scrape of ``/metrics`` gives the server's own metrics (requests waiting and running, requests
finished, tokens, end-to-end latency and prompt / generation tokens per request, time to first
token, per-token latency measured and predicted by the latency model and their ratio, queueing,
loaded devices, the process's RSS; request metrics labelled ``model_name`` as vLLM's are, no
``_created`` series) and every node's, read from the nodes' ``pong`` at scrape time
(labelled ``node``): up, RSS, requests, expert executions, relays per holder, fallbacks,
rejected messages, compute and queue seconds, requests and bytes in flight, connections. The
nodes need no port of their own: what they report travels over the cluster's authenticated
transport, as ``slimcaching cluster status`` reads it.
"""

from __future__ import annotations

import math

from slimcaching.runtime.node.metrics import NodeCollector


class NullMetrics:
    """Metrics that record nothing (an engine used without a server)."""

    def request_done(self, user: str, info: dict) -> None:
        pass

    def request_failed(self, user: str) -> None:
        pass


REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)


class ServeMetrics:
    """The server's metrics in a registry of their own (several servers in one process do not clash)."""

    def __init__(self, node_status=None, devices=None, counts=None, model: str = ""):
        from prometheus_client import (  # optional extra (serve)
            CollectorRegistry,
            Counter,
            Gauge,
            Histogram,
            disable_created_metrics,
        )
        from prometheus_client.process_collector import ProcessCollector  # optional extra (serve)

        disable_created_metrics()  # counters' _created series: noise for every dashboard
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        p = "slimcaching_"
        m = ["model_name"]
        self.model = model
        self.http = Counter(p + "http_requests", "HTTP requests by endpoint and status code",
                            ["endpoint", "status"], registry=r)
        self.in_progress = Gauge(p + "requests_in_progress", "Generation requests queued or running (HTTP side)",
                                 registry=r)
        if counts is not None:
            Gauge(p + "requests_running", "Requests a device is generating now", registry=r).set_function(
                lambda: counts()[0])
            Gauge(p + "requests_waiting", "Requests queued for their user's device", registry=r).set_function(
                lambda: counts()[1])
        self.finished = Counter(p + "requests_finished", "Generation requests finished, by finish reason",
                                m + ["finish_reason"], registry=r)
        self.failed = Counter(p + "requests_failed", "Generation requests that failed in the cluster", m,
                              registry=r).labels(model)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", m, registry=r).labels(model)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", m, registry=r).labels(model)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "From a request's arrival to its last token",
                             m, buckets=REQUEST_BUCKETS, registry=r).labels(model)
        self.request_prompt = Histogram(p + "request_prompt_tokens", "Prompt tokens per request", m,
                                        buckets=COUNT_BUCKETS, registry=r).labels(model)
        self.request_generation = Histogram(p + "request_generation_tokens", "Tokens generated per request", m,
                                            buckets=COUNT_BUCKETS, registry=r).labels(model)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From a request's arrival to its first text",
                              m, buckets=TOKEN_BUCKETS, registry=r).labels(model)
        self.queue = Histogram(p + "request_queue_seconds", "Time a request waited for its user's device",
                               m, buckets=TOKEN_BUCKETS, registry=r).labels(model)
        self.token = Histogram(p + "token_latency_seconds", "Measured time of each decoded token",
                               m, buckets=TOKEN_BUCKETS, registry=r).labels(model)
        self.predicted = Histogram(p + "token_latency_predicted_seconds",
                                   "The latency model's time for each decoded token (the sets it used)",
                                   m, buckets=TOKEN_BUCKETS, registry=r).labels(model)
        self.ratio = Histogram(p + "token_latency_measured_over_predicted_ratio",
                               "Measured / predicted time per decoded token", m, buckets=RATIO_BUCKETS,
                               registry=r).labels(model)
        if devices is not None:
            Gauge(p + "devices_loaded", "User devices loaded in the server", registry=r).set_function(devices)
        if node_status is not None:
            self.watch_nodes(node_status)

    def watch_nodes(self, node_status) -> None:
        """Report the nodes' states that ``node_status()`` gives at each scrape."""
        self.registry.register(NodeCollector(node_status))

    def request_done(self, user: str, info: dict) -> None:
        self.finished.labels(self.model, info["finish_reason"]).inc()
        self.prompt_tokens.inc(info["prompt_tokens"])
        self.generation_tokens.inc(info["completion_tokens"])
        self.queue.observe(info["queued_s"])
        self.e2e.observe(info["queued_s"] + info["generate_s"])
        self.request_prompt.observe(info["prompt_tokens"])
        self.request_generation.observe(info["completion_tokens"])
        if info["completion_tokens"]:
            self.ttft.observe(info["first_token_s"])
        for m, pr in zip(info["token_measured_s"], info["token_predicted_s"]):
            self.token.observe(m)
            if pr is not None and pr > 0 and math.isfinite(pr):
                self.predicted.observe(pr)
                self.ratio.observe(m / pr)

    def request_failed(self, user: str) -> None:
        self.failed.inc()

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest  # optional extra (serve)

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
