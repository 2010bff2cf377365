"""Prometheus metrics of one server, in its own CollectorRegistry (so a process can host several)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from sluice.engine.outputs import EngineStats, RequestOutput, Usage
from sluice.service.tenants import DEFAULT_TENANT

# Hosts that mean "every address": grpc listens on IPv4 and IPv6 for either, and so does /metrics.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Latency buckets in seconds: sub-millisecond decode steps up to a minute between tokens ...
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# ... and for a whole request, its queue time and its first token, up to vLLM's longest request bucket:
# a quantile past the last bound reads as that bound, and long outputs or an overloaded queue pass 60 s.
_REQUEST_BUCKETS = (*_LATENCY_BUCKETS, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Gauges and the engine's cumulative counters (preemptions, prefix cache) read from `stats()` at
    every scrape."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        if stats is None:  # the model is still loading
            return
        yield GaugeMetricFamily(
            "sluice_num_requests_running", "Requests in the running batch.", stats.num_running
        )
        yield GaugeMetricFamily(
            "sluice_num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting
        )
        yield GaugeMetricFamily(
            "sluice_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", stats.kv_usage
        )
        yield GaugeMetricFamily(
            "sluice_kv_cache_blocks_used", "KV cache blocks in use.", stats.num_kv_blocks_used
        )
        counters = (
            ("sluice_preemptions", "Requests preempted by the scheduler.", stats.num_preemptions),
            (
                "sluice_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (requests admitted for the first time).",
                stats.prefix_cache_queries,
            ),
            (
                "sluice_prefix_cache_hits",
                "Prompt tokens found in the prefix cache (requests admitted for the first time).",
                stats.prefix_cache_hits,
            ),
            (
                "sluice_prefix_cache_preempted_queries",
                "Tokens looked up in the prefix cache by requests resumed after preemption.",
                stats.prefix_cache_preempted_queries,
            ),
            (
                "sluice_prefix_cache_preempted_hits",
                "Tokens found in the prefix cache by requests resumed after preemption.",
                stats.prefix_cache_preempted_hits,
            ),
            (
                "sluice_prefix_cache_evictions",
                "Cached KV blocks evicted for reuse.",
                stats.prefix_cache_evictions,
            ),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value)
        yield from _speculative_metrics(stats)


def _speculative_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Draft tokens verified and accepted, in total and per draft position (0 = the first draft after
    the last accepted token), and the acceptance rate at each position."""
    yield CounterMetricFamily(
        "sluice_spec_decode_draft_tokens",
        "Draft tokens verified by the target model.",
        stats.num_draft_tokens,
    )
    yield CounterMetricFamily(
        "sluice_spec_decode_accepted_tokens", "Draft tokens accepted.", stats.num_accepted_draft_tokens
    )
    drafts = CounterMetricFamily(
        "sluice_spec_decode_draft_tokens_by_position",
        "Draft tokens verified at each position.",
        labels=["position"],
    )
    accepted = CounterMetricFamily(
        "sluice_spec_decode_accepted_tokens_by_position",
        "Draft tokens accepted at each position.",
        labels=["position"],
    )
    rate = GaugeMetricFamily(
        "sluice_spec_decode_acceptance_rate",
        "Accepted / verified draft tokens at each position, since the server started.",
        labels=["position"],
    )
    pairs = zip(stats.draft_tokens_per_position, stats.accepted_draft_tokens_per_position, strict=True)
    for position, (num_drafts, num_accepted) in enumerate(pairs):
        label = [str(position)]
        drafts.add_metric(label, num_drafts)
        accepted.add_metric(label, num_accepted)
        rate.add_metric(label, num_accepted / num_drafts if num_drafts else 0.0)
    yield from (drafts, accepted, rate)


class RequestTracker:
    """Observes one request's outputs as they stream: its tokens count as they come (a long request moves
    the token counters while it runs, as vLLM's do every step); `finish` records the rest once."""

    def __init__(self, metrics: ServerMetrics, tenant: str) -> None:
        self._metrics = metrics
        self._tenant = tenant
        self._last_token_times: dict[int, float] = {}  # sample index -> when its latest chunk came
        self._num_generated: dict[int, int] = {}  # sample index -> completion tokens counted so far
        self._num_cached = 0  # sample 0's cached tokens counted so far (the prompt counts once)
        self._prompt_counted = False
        self._prefilled = False  # a token came: the prompt was computed

    def on_output(self, output: RequestOutput) -> None:
        """Counts the tokens the output's usage adds to its sample's, then inter-token latency: time
        between chunks of one sample (`output.index`; the n samples of a request decode side by side, as
        vLLM's child requests), spread over the tokens of the later chunk (tokens merged into a sample's
        first chunk, behind a slow reader, have no gap to observe). The prompt counts once a token came,
        as vLLM counts it at its first token: a request aborted or expired while it waited, whose last
        output still reports its prompt, counted it, and one its caller cancelled did not."""
        self._prefilled = self._prefilled or bool(output.token_ids)
        if output.usage is not None:
            self._count_tokens(output.index, output.usage)
        if not output.token_ids:
            return
        now = time.monotonic()
        last = self._last_token_times.get(output.index)
        if last is not None:
            gap = (now - last) / len(output.token_ids)
            for _ in output.token_ids:
                self._metrics.inter_token_latency.observe(gap)
        self._last_token_times[output.index] = now

    def _count_tokens(self, index: int, usage: Usage) -> None:
        m, tenant = self._metrics, self._tenant
        if self._prefilled and not self._prompt_counted:
            self._prompt_counted = True
            m.prompt_tokens.labels(tenant=tenant).inc(usage.prompt_tokens)
        new_tokens = usage.completion_tokens - self._num_generated.get(index, 0)
        if new_tokens > 0:
            self._num_generated[index] = usage.completion_tokens
            m.generation_tokens.labels(tenant=tenant).inc(new_tokens)
        if self._prefilled and index == 0 and usage.cached_tokens > self._num_cached:
            m.cached_tokens.labels(tenant=tenant).inc(usage.cached_tokens - self._num_cached)
            self._num_cached = usage.cached_tokens

    def finish(self, final: RequestOutput, finish_reasons: Sequence[str]) -> None:
        """Counts each sample's finish reason (as vLLM counts its child requests) and the request's
        latencies: queue time and time to first token to its first sample's, end to end to its end."""
        m = self._metrics
        for finish_reason in finish_reasons:
            m.requests.labels(finish_reason=finish_reason, tenant=self._tenant).inc()
        timings = final.timings
        if timings is None:
            return
        for histogram, seconds in (
            (m.queue_time, timings.queue_seconds),
            (m.time_to_first_token, timings.ttft_seconds),
            (m.e2e_latency, timings.total_seconds),
        ):
            if seconds is not None:
                histogram.observe(seconds)


class ServerMetrics:
    """All metrics of one server. `serve(port)` exposes them at http://host:port/metrics."""

    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _REQUEST_BUCKETS) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=r)

        self.time_to_first_token = histogram("sluice_time_to_first_token_seconds", "Arrival to first token.")
        self.inter_token_latency = histogram(
            "sluice_inter_token_latency_seconds", "Between output tokens.", _LATENCY_BUCKETS
        )
        self.e2e_latency = histogram("sluice_e2e_request_latency_seconds", "Arrival to finish.")
        self.queue_time = histogram("sluice_queue_time_seconds", "Arrival to first scheduled.")
        # Per tenant (sluice.service.tenants; "default" without --api-keys).
        self.prompt_tokens = Counter(
            "sluice_prompt_tokens",
            "Prompt tokens of requests (counted at their first token: a request ended before has none).",
            ["tenant"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "sluice_generation_tokens", "Generated tokens.", ["tenant"], registry=r
        )
        self.cached_tokens = Counter(
            "sluice_cached_tokens",
            "Prompt tokens served from the prefix cache (with n > 1, sample 0's: the prompt counts once).",
            ["tenant"],
            registry=r,
        )
        self.requests = Counter(
            "sluice_requests",
            "Finished generation requests (each of n samples) by finish reason and tenant.",
            ["finish_reason", "tenant"],
            registry=r,
        )
        self.tenant_rejections = Counter(
            "sluice_tenant_rejected_requests",
            "Requests refused because their tenant was over its concurrency or rate limit.",
            ["tenant"],
            registry=r,
        )
        self.rpc_status = Counter(
            "sluice_rpc_requests",
            "Requests by method and final gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        r.register(EngineStatsCollector(stats))
        self._http_servers: list[WSGIServer] = []

    def track(self, tenant: str = DEFAULT_TENANT) -> RequestTracker:
        return RequestTracker(self, tenant)

    def record_status(self, method: str, code: grpc.StatusCode) -> None:
        self.rpc_status.labels(method=method, code=code.name).inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Starts the /metrics HTTP endpoint in daemon threads; returns the bound port. It listens where
        grpc does on the gRPC port: a wildcard host on IPv4 and IPv6 (an IPv6 pod IP is scraped too), a
        name on every address it resolves to ("localhost": 127.0.0.1 and ::1), on one port."""
        if host in WILDCARD_HOSTS and socket.has_dualstack_ipv6():
            self._http_servers = [_serve(_DualStackServer, "::", port, self.registry)]
        else:
            self._http_servers = _serve_each_address(host, port, self.registry)
        return self._http_servers[0].server_port

    def close(self) -> None:
        _close(self._http_servers)
        self._http_servers = []


class _DualStackServer(ThreadingWSGIServer):
    """An IPv6 listener that takes IPv4 too (IPV6_V6ONLY off, whatever the system's default)."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _IPv6Server(ThreadingWSGIServer):
    """An IPv6 listener for IPv6 alone, beside an IPv4 one on the same port."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape."""


def _serve(
    server_class: type[WSGIServer], address: str, port: int, registry: CollectorRegistry
) -> WSGIServer:
    server = make_server(address, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="sluice-metrics", daemon=True).start()
    return server


def _serve_each_address(host: str, port: int, registry: CollectorRegistry) -> list[WSGIServer]:
    """A listener on each address `host` resolves to, all on the port the first one bound (OSError if
    one cannot listen: none is left open)."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = dict.fromkeys((family, sockaddr[0]) for family, _, _, _, sockaddr in found)
    servers: list[WSGIServer] = []
    try:
        for family, address in addresses:
            server_class = _IPv6Server if family == socket.AF_INET6 else ThreadingWSGIServer
            servers.append(
                _serve(server_class, address, servers[0].server_port if servers else port, registry)
            )
    except OSError:
        _close(servers)
        raise
    return servers


def _close(servers: list[WSGIServer]) -> None:
    for server in servers:
        server.shutdown()
        server.server_close()
