"""GET /metrics: the engine's counters and gauges in Prometheus text format, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from starlette.responses import Response

from handlers.server.context import ServerContext

# stats() key -> (metric name, help, kind)
_METRICS = {
    "running_requests": ("lmi_running_requests", "Requests in the running batch", "gauge"),
    "waiting_requests": ("lmi_waiting_requests", "Requests waiting for a batch slot", "gauge"),
    "prompt_tokens": ("lmi_prompt_tokens", "Prompt tokens admitted", "counter"),
    "generated_tokens": ("lmi_generated_tokens", "Tokens generated", "counter"),
    "finished_requests": ("lmi_finished_requests", "Requests finished", "counter"),
}


class EngineCollector(Collector):
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.model_name = ctx.settings.model_name

    def collect(self) -> Iterator[Metric]:
        served = self.ctx.generator
        stats = served.engine.stats() if served is not None and served.ready else {}
        for key, (name, doc, kind) in _METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            metric = family(name, doc, labels=["model"])
            metric.add_metric([self.model_name], stats.get(key, 0))
            yield metric
        if "dynamic_batches" in stats:  # option.rolling_batch=disable
            yield self._dynamic_batch_size(stats)

    def _dynamic_batch_size(self, stats: dict[str, int]) -> Metric:
        # _count: batches run; _sum: HTTP requests they served.
        metric = SummaryMetricFamily(
            "lmi_dynamic_batch_size", "HTTP requests per dynamic batch", labels=["model"]
        )
        metric.add_metric(
            [self.model_name], stats["dynamic_batches"], stats["dynamic_batch_requests"]
        )
        return metric


def router(ctx: ServerContext) -> APIRouter:
    routes = APIRouter()
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(ctx))

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return routes
