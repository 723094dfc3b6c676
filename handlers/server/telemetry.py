"""What `GET /metrics` reports: one `Telemetry` per server context, on its own registry (never
prometheus-client's global one: a process may hold several apps, as the tests do).

Three sources feed it:
- the generation driver, which sees every output of every protocol's engine requests: time to
  first token, inter-token latency, end-to-end and queue time, tokens, finish reasons;
- the HTTP middleware here (`RequestCounter`) and the gRPC interceptor: requests by protocol,
  route template (never the raw path, so the series stay bounded) and status;
- the engine's `stats()`, read at scrape time: running and waiting requests, KV-cache slots.

Where vLLM has a metric for the same thing it is also exposed under vLLM's name and labels
(`vllm:time_to_first_token_seconds{model_name,engine}`, ...) so that vLLM's dashboards and
autoscalers work unchanged; LMI's own names carry a `model` label, as they always have.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from handlers.engine.types import (
    AdapterActivity,
    FinishReason,
    GenerationRequest,
    RequestOutput,
)
from handlers.server.tracing import RequestTrace, Usage

Stats = Callable[[], dict[str, float]]  # the generation engine's stats(); {} while not ready
# The generation engine's adapter_activity(); None while not ready or with LoRA off.
Activity = Callable[[], AdapterActivity | None]
Pairs = Iterable[tuple[int, RequestOutput]]

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM bounds its 1-2-5 token buckets by max_model_len; this registry exists before the model
# is loaded, so a bound past any context length.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))

# vLLM's finished_reason values; LMI's EOS and stop sequence are both vLLM's "stop".
FINISHED_REASONS = {FinishReason.EOS: "stop", FinishReason.STOP: "stop",
                    FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
                    FinishReason.ERROR: "error", FinishReason.REFUSED: "error"}

# Route template prefix -> protocol, first match wins ("/" alone is TGI's).
PROTOCOLS = (
    ("/v1/models/{model}", "kserve_v1"),
    ("/v1/", "openai"),
    ("/v2", "kserve_v2"),
    ("/invocations", "lmi"),
    ("/predictions/", "lmi"),
    ("/endpoints/", "sagemaker"),
    ("/serving-endpoints/", "databricks"),
    ("/generate", "tgi"),
    ("/info", "tgi"),
    ("/health", "tgi"),
    ("/ping", "health"),
    ("/metrics", "metrics"),
)
UNMATCHED = "unmatched"  # the route label of a path no route serves
GRPC_PROTOCOL = "kserve_v2_grpc"


def protocol_of(route: str) -> str:
    if route == "/":
        return "tgi"
    return next((name for prefix, name in PROTOCOLS if route.startswith(prefix)), "http")


class _Both:
    """One observation recorded under LMI's name and under vLLM's."""

    def __init__(self, *children: Any) -> None:
        self._children = children

    def observe(self, value: float) -> None:
        for child in self._children:
            child.observe(value)


@dataclass
class _Progress:
    """One engine request as the driver has seen it so far."""

    arrival: float
    prompt_tokens: int | None = None  # set by its first output
    first_token: float | None = None  # when the first output carrying tokens arrived
    last_token: float | None = None  # when the last output carrying tokens arrived
    last_output: float | None = None
    queue_time: float = 0.0  # set once finished
    generated: dict[int, int] = field(default_factory=dict)  # per sequence: tokens so far
    reason: FinishReason | None = None  # the first sequence's


@dataclass(frozen=True)
class ModelMetrics:
    """One model's series of the request metrics (LMI's `model` label, vLLM's `model_name`)."""

    ttft: _Both
    itl: _Both
    e2e: _Both
    queue: _Both
    request_prompt: _Both
    request_generation: _Both
    prompt_tokens: Any
    generation_tokens: Any
    success: dict[str, Any]


class Telemetry:
    def __init__(self, model_name: str, stats: Stats, activity: Activity = lambda: None
                 ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        lmi = (model_name,)
        self._histograms: dict[str, list[Histogram]] = {}  # by field: LMI's, then vLLM's names
        self._models: dict[str, ModelMetrics] = {}
        self._engines = EngineCollector()

        def histogram(key: str, name: str, vllm_names: Sequence[str], doc: str,
                      buckets: Sequence[float]) -> None:
            made = [Histogram(name, doc, ["model"], registry=self.registry, buckets=buckets)]
            made += [Histogram(other, doc, ["model_name", "engine"], registry=self.registry,
                               buckets=buckets) for other in vllm_names]
            self._histograms[key] = made

        def counter(name: str, doc: str, labels: Sequence[str] = ("model",)) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        histogram("ttft", "lmi_time_to_first_token_seconds", ["vllm:time_to_first_token_seconds"],
                  "Time from a request's arrival to its first token", TTFT_BUCKETS)
        # vLLM renamed time_per_output_token to inter_token_latency; dashboards use either.
        histogram("itl", "lmi_inter_token_latency_seconds",
                  ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"],
                  "Time between a request's successive token outputs", ITL_BUCKETS)
        histogram("e2e", "lmi_e2e_request_latency_seconds", ["vllm:e2e_request_latency_seconds"],
                  "Time from a request's arrival to its last output", LATENCY_BUCKETS)
        histogram("queue", "lmi_request_queue_time_seconds", ["vllm:request_queue_time_seconds"],
                  "Time a request waited before the engine scheduled it", LATENCY_BUCKETS)
        histogram("request_prompt", "lmi_request_prompt_tokens", ["vllm:request_prompt_tokens"],
                  "Prompt tokens of each finished request", TOKEN_BUCKETS)
        histogram("request_generation", "lmi_request_generation_tokens",
                  ["vllm:request_generation_tokens"], "Tokens generated for each finished "
                  "request", TOKEN_BUCKETS)
        # LMI's token counters are the engine's (lmi_prompt_tokens_total, read from stats()).
        self._prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of the requests "
                                      "served", ("model_name", "engine"))
        self._generation_tokens = counter("vllm:generation_tokens", "Tokens generated",
                                          ("model_name", "engine"))
        self._success = counter("vllm:request_success", "Requests finished, by why they "
                                "finished", ("model_name", "engine", "finished_reason"))
        self.requests = counter("lmi_requests", "Requests answered, by protocol, route and status",
                                ("protocol", "route", "status"))
        self.rejections = counter("lmi_rejected_requests",
                                  "Requests refused at once because the server was at its "
                                  "limit (job_queue_size)").labels(*lmi)
        self.restarts = counter("lmi_engine_restarts",
                                "Times the engine was restarted after a failure").labels(*lmi)
        self.adapter_requests = counter("lmi_adapter_requests",
                                        "Engine requests run with a LoRA adapter, by adapter",
                                        ("model", "adapter"))
        self.registry.register(self._engines)
        self.add_engine(model_name, stats, activity)

    def metrics(self, model: str) -> ModelMetrics:
        """Model `model`'s series, made on first use."""
        found = self._models.get(model)
        if found is None:
            lmi, vllm = (model,), (model, "0")  # vLLM's engine index: one engine per model

            def both(key: str) -> _Both:
                first, *others = self._histograms[key]
                return _Both(first.labels(*lmi), *(other.labels(*vllm) for other in others))

            found = self._models[model] = ModelMetrics(
                *(both(key) for key in ("ttft", "itl", "e2e", "queue", "request_prompt",
                                        "request_generation")),
                self._prompt_tokens.labels(*vllm), self._generation_tokens.labels(*vllm),
                {reason: self._success.labels(*vllm, reason)
                 for reason in dict.fromkeys(FINISHED_REASONS.values())})
        return found

    def add_engine(self, model: str, stats: Stats, activity: Activity = lambda: None) -> None:
        """Report model `model`'s engine gauges and counters (read at scrape time)."""
        self._engines.engines[model] = _EngineReading(model, stats, activity)
        self.metrics(model)

    def remove_engine(self, model: str) -> None:
        """Model `model` was unloaded: its series go (its engine with them)."""
        self._engines.engines.pop(model, None)
        if self._models.pop(model, None) is None:
            return
        for first, *others in self._histograms.values():
            first.remove(model)
            for other in others:
                other.remove(model, "0")
        for counter in (self._prompt_tokens, self._generation_tokens):
            counter.remove(model, "0")
        for reason in dict.fromkeys(FINISHED_REASONS.values()):
            self._success.remove(model, "0", reason)

    def open_sessions(self, count: Callable[[], int]) -> None:
        """Report the stateful sessions open, as `count()` says at each scrape."""
        Gauge("lmi_open_sessions", "Stateful sessions open", ["model"], registry=self.registry
              ).labels(self.model_name).set_function(count)

    # -- events ---------------------------------------------------------------------------------

    def engine_restarted(self) -> None:
        """Called by engine supervision each time it restarts a failed engine."""
        self.restarts.inc()

    def rejected(self) -> None:
        """A request refused for overload (the admission limit)."""
        self.rejections.inc()

    def answered(self, protocol: str, route: str, status: int | str) -> None:
        self.requests.labels(protocol, route, str(status)).inc()

    def observer(self, requests: Sequence[GenerationRequest], trace: RequestTrace | None = None,
                 model: str | None = None) -> RequestObserver:
        """What observes one client request's engine requests to `model` (None: the server's
        model) (see Generation), and ends its trace when it has one."""
        model = model or self.model_name
        for request in requests:
            if request.adapter is not None:
                self.adapter_requests.labels(model, request.adapter).inc()
        return RequestObserver(self.metrics(model),
                               [_Progress(request.arrival_time) for request in requests], trace)

class RequestObserver:
    """What one client request's engine requests did, observed as their outputs arrive:
    latencies once per engine request, tokens as they come."""

    def __init__(self, metrics: ModelMetrics, progress: list[_Progress],
                 trace: RequestTrace | None = None) -> None:
        self._metrics = metrics
        self._progress = progress
        self._trace = trace

    def outputs(self, pairs: Pairs) -> None:
        now = time.monotonic()
        for index, output in pairs:
            self._output(self._progress[index], output, now)

    def abandoned(self, indices: Iterable[int]) -> None:
        """These requests were aborted unfinished (a client gone, a deadline, a failure)."""
        for _ in indices:
            self._metrics.success["abort"].inc()

    def _output(self, progress: _Progress, output: RequestOutput, now: float) -> None:
        metrics = self._metrics
        if progress.prompt_tokens is None:
            progress.prompt_tokens = output.prompt_token_count
            metrics.prompt_tokens.inc(output.prompt_token_count)
        new = 0
        for seq in output.outputs:
            done = progress.generated.get(seq.index, 0)
            total = max(seq.generated_tokens, done + len(seq.tokens))
            progress.generated[seq.index] = total
            new += total - done
            if seq.index == 0 and seq.finish_reason is not None:
                progress.reason = seq.finish_reason
        progress.last_output = now
        if new:
            metrics.generation_tokens.inc(new)
            if progress.last_token is None:
                metrics.ttft.observe(now - progress.arrival)
                progress.first_token = now
            else:
                metrics.itl.observe(now - progress.last_token)
            progress.last_token = now
        if output.finished:
            self._finished(progress, output, now)

    def _finished(self, progress: _Progress, output: RequestOutput, now: float) -> None:
        metrics = self._metrics
        reason = progress.reason or next(
            (seq.finish_reason for seq in output.outputs if seq.finish_reason), FinishReason.STOP)
        metrics.success[FINISHED_REASONS[reason]].inc()
        metrics.e2e.observe(now - progress.arrival)
        progress.queue_time = output.metrics.queue_time
        metrics.queue.observe(progress.queue_time)
        metrics.request_prompt.observe(progress.prompt_tokens or 0)
        metrics.request_generation.observe(sum(progress.generated.values()))

    def closed(self, error: str | None) -> None:
        """The client request ended (`error`: why it failed); its trace's spans are written."""
        if self._trace is None:
            return
        firsts = [p.first_token for p in self._progress if p.first_token is not None]
        lasts = [p.last_output for p in self._progress if p.last_output is not None]
        self._trace.ended(Usage(
            prompt_tokens=sum(p.prompt_tokens or 0 for p in self._progress),
            completion_tokens=sum(sum(p.generated.values()) for p in self._progress),
            sequences=sum(len(p.generated) for p in self._progress),
            queue_time=max(p.queue_time for p in self._progress),
            first_token=min(firsts, default=None), last_output=max(lasts, default=None)), error)


# stats() key -> (metric name, help, kind); LMI's names since before this module.
ENGINE_METRICS = {
    "running_requests": ("lmi_running_requests", "Requests in the running batch", "gauge"),
    "waiting_requests": ("lmi_waiting_requests", "Requests waiting for a batch slot", "gauge"),
    "prompt_tokens": ("lmi_prompt_tokens", "Prompt tokens admitted", "counter"),
    "generated_tokens": ("lmi_generated_tokens", "Tokens generated", "counter"),
    "finished_requests": ("lmi_finished_requests", "Requests finished", "counter"),
}
VLLM_GAUGES = {
    "running_requests": ("vllm:num_requests_running", "Requests in the running batch"),
    "waiting_requests": ("vllm:num_requests_waiting", "Requests waiting for a batch slot"),
}


class EngineCollector(Collector):
    """The engines' own gauges and counters, read at scrape time: one family per metric, a
    series in it per model."""

    def __init__(self) -> None:
        self.engines: dict[str, _EngineReading] = {}

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for reading in list(self.engines.values()):
            for metric in reading.collect():
                if metric.name in families:
                    families[metric.name].samples += metric.samples
                else:
                    families[metric.name] = metric
        yield from families.values()


class _EngineReading:
    """One model's engine, read."""

    def __init__(self, model_name: str, stats: Stats, activity: Activity) -> None:
        self.model_name = model_name
        self.stats = stats
        self.activity = activity

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        for key, (name, doc, kind) in ENGINE_METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield self._one(family(name, doc, labels=["model"]), stats.get(key, 0))
        for key, (name, doc) in VLLM_GAUGES.items():
            yield self._vllm(GaugeMetricFamily(name, doc, labels=["model_name", "engine"]),
                             stats.get(key, 0))
        if "kv_cache_slots_total" in stats:  # an engine with a KV cache of batch slots
            yield from self._kv_cache(stats)
        elif "kv_cache_usage" in stats:  # an engine that reports its cache's use itself
            yield self._kv_usage(stats["kv_cache_usage"])
        if "kv_cache_blocks" in stats:
            yield _cache_config(stats, "prefix_cache_queries" in stats)
        if "prefix_cache_queries" in stats:  # an engine caching prompt prefixes
            yield from self._prefix_cache(stats)
        if "spec_decode_num_drafts" in stats:  # speculative decoding (option.speculative_config)
            yield from self._spec_decode(stats)
        if "dynamic_batches" in stats:  # option.rolling_batch=disable
            yield self._dynamic_batch_size(stats)
        if (activity := self.activity()) is not None:
            yield _lora_info(activity)
        if "decode_graphs_total" in stats:  # the torch engine compiling or capturing its step
            yield self._one(GaugeMetricFamily(
                "lmi_decode_graphs_ready", "Decode graphs ready, of lmi_decode_graphs_total "
                "(compiled on the CPU: the step runs eagerly until they are; CUDA graphs on a "
                "GPU: captured as batch sizes first occur)", labels=["model"]),
                stats["decode_graphs_ready"])
            yield self._one(GaugeMetricFamily("lmi_decode_graphs_total",
                                              "Decode graphs this engine wants",
                                              labels=["model"]), stats["decode_graphs_total"])

    def _one(self, metric: Any, value: float) -> Metric:
        metric.add_metric([self.model_name], value)
        return metric

    def _vllm(self, metric: Any, value: float) -> Metric:
        metric.add_metric([self.model_name, "0"], value)
        return metric

    def _kv_cache(self, stats: dict[str, int]) -> Iterator[Metric]:
        used, total = stats.get("kv_cache_slots_in_use", 0), stats["kv_cache_slots_total"]
        yield self._one(GaugeMetricFamily("lmi_kv_cache_slots_in_use",
                                          "KV-cache batch slots held by running sequences",
                                          labels=["model"]), used)
        yield self._one(GaugeMetricFamily("lmi_kv_cache_slots", "KV-cache batch slots in all",
                                          labels=["model"]), total)
        share = used / total if total else 0.0
        if "kv_cache_budget_tokens" in stats:  # an engine admitting within a KV budget
            yield from self._kv_budget(stats)
            share = max(share, stats["kv_cache_reserved_tokens"] / stats["kv_cache_budget_tokens"])
        yield self._kv_usage(share)

    def _kv_budget(self, stats: dict[str, int]) -> Iterator[Metric]:
        for key, doc in (("budget_tokens", "KV cache positions the memory budget holds"),
                         ("reserved_tokens", "KV cache positions the running requests reserve"),
                         ("reserved_tokens_peak", "The most KV cache positions reserved at once")):
            yield self._one(GaugeMetricFamily(f"lmi_kv_cache_{key}", doc, labels=["model"]),
                            stats[f"kv_cache_{key}"])
        yield self._one(CounterMetricFamily(
            "lmi_kv_cache_budget_waits", "Requests that waited for room in the KV cache's "
            "budget", labels=["model"]), stats["kv_cache_budget_waits"])

    def _kv_usage(self, share: float) -> Metric:
        return self._vllm(GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                            "Share of the KV cache in use (0 to 1)",
                                            labels=["model_name", "engine"]), share)

    def _prefix_cache(self, stats: dict[str, int]) -> Iterator[Metric]:
        """Prompt tokens looked up and found, in LMI's names and vLLM's (hit rate: their ratio)."""
        if "prefix_cache_pinned_tokens" in stats:
            yield self._one(GaugeMetricFamily(
                "lmi_prefix_cache_pinned_tokens", "Tokens the prefix cache keeps pinned for open "
                "stateful sessions", labels=["model"]), stats["prefix_cache_pinned_tokens"])
        for key, doc in (("queries", "Prompt tokens looked up in the prefix cache"),
                         ("hits", "Prompt tokens found in the prefix cache (not prefilled)")):
            value = stats[f"prefix_cache_{key}"]
            yield self._one(CounterMetricFamily(f"lmi_prefix_cache_{key}", doc,
                                                labels=["model"]), value)
            yield self._vllm(CounterMetricFamily(f"vllm:prefix_cache_{key}", doc,
                                                 labels=["model_name", "engine"]), value)

    def _spec_decode(self, stats: dict[str, int]) -> Iterator[Metric]:
        """vLLM's speculative decoding counters (acceptance rate: accepted / draft tokens)."""
        for key, doc in (("num_drafts", "Rows that proposed tokens, counted per step"),
                         ("num_draft_tokens", "Tokens proposed"),
                         ("num_accepted_tokens", "Proposed tokens accepted")):
            yield self._vllm(CounterMetricFamily(f"vllm:spec_decode_{key}", doc,
                                                 labels=["model_name", "engine"]),
                             stats[f"spec_decode_{key}"])
        metric = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Proposed tokens accepted, by their place in the proposal",
                                     labels=["model_name", "engine", "position"])
        position = 0
        while (value := stats.get(f"spec_decode_accepted_at_{position}")) is not None:
            metric.add_metric([self.model_name, "0", str(position)], value)
            position += 1
        yield metric

    def _dynamic_batch_size(self, stats: dict[str, int]) -> Metric:
        # _count: batches run; _sum: HTTP requests they served.
        metric = SummaryMetricFamily(
            "lmi_dynamic_batch_size", "HTTP requests per dynamic batch", labels=["model"]
        )
        metric.add_metric(
            [self.model_name], stats["dynamic_batches"], stats["dynamic_batch_requests"]
        )
        return metric


def _cache_config(stats: dict[str, float], prefix_caching: bool) -> Metric:
    """vLLM's `vllm:cache_config_info` (value 1, the facts in its labels): the block size and
    block count the Gateway API Inference Extension's prefix-aware routing sizes its index by."""
    labels = {"block_size": str(int(stats["kv_cache_block_size"])),
              "num_gpu_blocks": str(int(stats["kv_cache_blocks"])),
              "enable_prefix_caching": str(prefix_caching), "engine": "0"}
    metric = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache "
                               "configuration", labels=list(labels))
    metric.add_metric(list(labels.values()), 1)
    return metric


def _lora_info(activity: AdapterActivity) -> Metric:
    """vLLM's `vllm:lora_requests_info`: the adapters in its labels, comma-separated, and the
    time of the reading as its value (what the Gateway API Inference Extension and llm-d read
    to route by adapter)."""
    metric = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                               labels=["max_lora", "running_lora_adapters",
                                       "waiting_lora_adapters"])
    metric.add_metric([str(activity.max_loras), ",".join(activity.running),
                       ",".join(activity.waiting)], time.time())
    return metric


class RequestCounter:
    """ASGI middleware: counts each HTTP request once it ends, by protocol, route template and
    status. A request answered before routing (by another middleware) is matched against
    `routes` here; a path no route serves is `unmatched`."""

    def __init__(self, app: Any, telemetry: Telemetry, routes: Sequence[Any]) -> None:
        self.app = app
        self.telemetry = telemetry
        self.routes = routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, counted = 0, False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status, counted
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self._count(scope, status)  # before the client can see its answer end
                counted = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            status = status or 499  # the client went away before an answer (nginx's code)
            raise
        except Exception:
            status = status or 500  # what the server's error middleware answers
            raise
        finally:
            if not counted:
                self._count(scope, status)

    def _count(self, scope: dict[str, Any], status: int) -> None:
        route = self._route(scope)
        self.telemetry.answered(protocol_of(route) if route != UNMATCHED else "http", route,
                                status)

    def _route(self, scope: dict[str, Any]) -> str:
        route = scope.get("route")
        if route is None:
            route = next((r for r in self.routes if r.matches(scope)[0].value), None)
        return getattr(route, "path", None) or UNMATCHED
