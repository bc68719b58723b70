"""Prometheus metrics of one node (prometheus-client, the ``serve`` extra): a collector that reads
the node's status at each scrape, served on the node's own host (``--metrics-port``)."""

from __future__ import annotations

import copy

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows per expert batch


class NodeCollector:
    """Every node's pong, as metric families labelled ``node`` (read at scrape time)."""

    def __init__(self, node_status):
        self.node_status = node_status  # () -> {node: status dict, or None when it does not answer}

    def describe(self):
        return []  # collected at scrape time only (no call to the nodes at registration)

    def collect(self):
        from prometheus_client.core import (  # optional extra (serve)
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        p = "slimcaching_node_"
        up = GaugeMetricFamily(p + "up", "1 when the node answered the scrape's ping", labels=["node"])
        gauges = {k: GaugeMetricFamily(p + k, h, labels=["node"]) for k, h in (
            ("rss_bytes", "Resident memory of the node"), ("in_flight", "Requests parked or running at the node"),
            ("in_flight_bytes", "Hidden-state bytes the node holds"), ("connections", "Connections admitted"),
            ("experts_held", "Experts the node holds"))}
        counters = {k: CounterMetricFamily(p + k, h, labels=["node"]) for k, h in (
            ("requests", "Run requests received"), ("expert_executions", "Experts executed (one per request part)"),
            ("fallbacks", "Relays that went to another holder after a failure"),
            ("rejected", "Messages rejected"), ("late_replies", "Replies that came after their deadline"),
            ("internal_errors", "Exceptions caught while handling a message"),
            ("compute_seconds", "Seconds of expert compute"), ("queue_seconds", "Seconds requests queued"),
            ("batches", "Batches of expert work run (one or more requests each)"),
            ("batched_requests", "Requests run in batches (batched_requests / batches: the mean batch size)"))}
        relayed = CounterMetricFamily(p + "relayed", "Experts relayed, by holder", labels=["node", "holder"])
        batch_size = HistogramMetricFamily(p + "batch_size", "Requests per batch", labels=["node"])
        for node, st in sorted((self.node_status() or {}).items()):
            up.add_metric([node], 1.0 if st else 0.0)
            if not st:
                continue
            stats = st.get("stats") or {}
            vals = {"rss_bytes": st.get("rss_bytes"), "in_flight": st.get("in_flight"),
                    "in_flight_bytes": st.get("in_flight_bytes"), "connections": st.get("connections"),
                    "experts_held": held if isinstance(held := st.get("held"), int) else len(held or []),
                    "requests": stats.get("requests"), "expert_executions": sum((stats.get("executed") or {}).values()),
                    "fallbacks": len(stats.get("fallbacks") or []), "rejected": stats.get("rejected"),
                    "late_replies": stats.get("late_replies"), "internal_errors": stats.get("internal_errors"),
                    "compute_seconds": stats.get("compute_s"), "queue_seconds": stats.get("queue_s"),
                    "batches": stats.get("batches", 0), "batched_requests": stats.get("batched_requests", 0)}
            for k, fam in list(gauges.items()) + list(counters.items()):
                v = vals.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    fam.add_metric([node], float(v))
            for holder, n in sorted((stats.get("relayed") or {}).items()):
                relayed.add_metric([node, str(holder)], float(n))
            sizes = {int(k): int(v) for k, v in (stats.get("batch_sizes") or {}).items()
                     if str(k).isdigit() and isinstance(v, int)}
            if sizes:
                buckets = []
                for edge in BATCH_BUCKETS:
                    total_le = sum(v for k, v in sizes.items() if k <= edge)
                    buckets.append((str(edge), float(total_le)))
                total = sum(sizes.values())
                buckets.append(("+Inf", float(total)))
                batch_size.add_metric([node], buckets, float(sum(k * v for k, v in sizes.items())))
        yield up
        yield from gauges.values()
        yield from counters.values()
        yield relayed
        yield batch_size


def node_snapshot(node) -> dict | None:
    """A copy of a running node's status, taken from another thread (the node's loop may change its
    counters meanwhile: a copy that raced is taken again)."""
    for _ in range(10):
        try:
            return copy.deepcopy(node.status())
        except RuntimeError:  # a dict changed size during the copy
            continue
    return None


def serve_node_metrics(node, host: str, port: int) -> int:
    """Prometheus metrics of one node (``slimcaching node --metrics-port``) on ``host:port`` in a
    thread of the node's process; returns the port."""
    from prometheus_client import CollectorRegistry, start_http_server  # optional extra (serve)
    from prometheus_client.process_collector import ProcessCollector  # optional extra (serve)

    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(NodeCollector(lambda: {node.name: node_snapshot(node)}))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
