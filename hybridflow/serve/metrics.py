"""``GET /metrics``: the server's counters in Prometheus's text format, under vLLM's names where the
meaning matches, so a dashboard or scraper built for vLLM reads this server too (issue 45 item 5).

Read live from the engine at every scrape (``prometheus_client`` collector on a registry of this app's
own, so several servers in one process never share values). Each sample carries vLLM's ``model_name``
label. Counters are exposed with Prometheus's ``_total`` suffix, as vLLM's are.

===================================  =======  ====================================================
name                                 type     what
===================================  =======  ====================================================
``vllm:num_requests_running``        gauge    sequences in the engine's running batch
``vllm:num_requests_waiting``        gauge    requests added and not admitted, and preempted sequences
``vllm:kv_cache_usage_perc``         gauge    the fraction (0-1, vLLM's unit) of the KV blocks held
``vllm:num_preemptions``             counter  sequences preempted (blocks ran out; recomputed later)
``vllm:prompt_tokens``               counter  prompt tokens prefilled (the cached prefix not counted)
``vllm:generation_tokens``           counter  tokens generated
``vllm:prefix_cache_queries``        counter  prompt tokens looked up in the prefix cache (vLLM counts
                                              tokens)
``vllm:prefix_cache_hits``           counter  of those, tokens found cached (whole blocks)
``hybridflow:requests_aborted``      counter  requests aborted (a client left, a cancel)
``hybridflow:requests_failed``       counter  requests that failed in the engine
``hybridflow:sequences_in_flight``   gauge    sequences admitted by the server and not yet answered
===================================  =======  ====================================================
"""

from __future__ import annotations

from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineMetrics:
    """A ``prometheus_client`` collector over ``service`` (a :class:`~hybridflow.serve.app.EngineService`):
    every scrape reads the engine's counters now."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine = self.service.engine
        stats = dict(engine.stats)
        label, value = ["model_name"], [str(self.service.model_name)]
        pool = engine.pool
        prefilled = float(stats.get("prefill_tokens", 0))
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                engine.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engine.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                pool.usage if engine.cache.allocated else 0.0,
            ),
            (
                "hybridflow:sequences_in_flight",
                "Sequences admitted by the server and not yet answered.",
                getattr(self.service, "in_flight", 0),
            ),
        )
        counters = (
            (
                "vllm:num_preemptions",
                "Cumulative number of preemptions from the engine.",
                stats.get("preemptions", 0),
            ),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", prefilled),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                stats.get("generated_tokens", 0),
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                pool.stats["prefix_queries"],
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                pool.stats["prefix_hits"],
            ),
            ("hybridflow:requests_aborted", "Requests aborted.", stats.get("aborted_requests", 0)),
            (
                "hybridflow:requests_failed",
                "Requests that failed in the engine.",
                stats.get("failed_requests", 0),
            ),
        )
        for name, doc, number in gauges:
            family = GaugeMetricFamily(name, doc, labels=label)
            family.add_metric(value, float(number))
            yield family
        for name, doc, number in counters:
            family = CounterMetricFamily(name, doc, labels=label)
            family.add_metric(value, float(number))
            yield family


def add_metrics_route(app, service) -> None:
    """``GET /metrics`` on ``app`` (FastAPI), serving :class:`EngineMetrics` of ``service``."""
    from fastapi.responses import Response
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineMetrics(service))

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)
