"""GET /metrics: the engine's counters and gauges in Prometheus text format, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from starlette.responses import Response

from handlers.engine.base import Engine

# stats() key -> (metric name, help, kind)
_METRICS = {
    "running_requests": ("lmi_running_requests", "Requests in the running batch", "gauge"),
    "waiting_requests": ("lmi_waiting_requests", "Requests waiting for a batch slot", "gauge"),
    "prompt_tokens": ("lmi_prompt_tokens", "Prompt tokens admitted", "counter"),
    "generated_tokens": ("lmi_generated_tokens", "Tokens generated", "counter"),
    "finished_requests": ("lmi_finished_requests", "Requests finished", "counter"),
}


class EngineCollector(Collector):
    def __init__(self, engine: Engine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats() if self.engine.is_ready() else {}
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


def metrics_endpoint(engine: Engine, model_name: str):
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, model_name))

    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return metrics
