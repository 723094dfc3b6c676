"""The serving benchmark's model-free parts: statistics, stream timing, workloads, the
static-batching schedule, the client against a stand-in server, and the report."""

from __future__ import annotations

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench import client
from bench.client import LmiTimer
from bench.report import paired, serving_plot, serving_table
from bench.serving import parse_args
from bench.stats import RequestResult, percentile, summarize, wall_time
from bench.workloads import (
    Arrival,
    BatchTiming,
    closed_loop_prompts,
    next_batch,
    poisson_trace,
    run_static_trace,
)


def result(start=0.0, first=1.0, last=2.0, done=2.0, tokens=3, expected=3, error=None):
    return RequestResult(start, first, last, done, tokens, expected, error)


# --- statistics ----------------------------------------------------------------------------


def test_percentile_interpolates_and_skips_missing_values():
    assert percentile([4.0, 1.0, None, 3.0, 2.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0
    assert percentile([None], 50) is None
    assert percentile([], 99) is None


def test_ttft_and_tpot_of_one_request():
    r = result(start=10.0, first=10.5, last=12.5, tokens=5)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.5)  # 2 s over the 4 gaps between 5 tokens
    assert result(tokens=1).tpot is None


def test_summarize_counts_only_successful_tokens():
    results = [
        result(start=0, first=1, last=3, done=3, tokens=3),
        result(start=1, first=2, last=3, done=3, tokens=2, expected=3),  # short
        result(start=0, first=None, last=None, done=4, tokens=0, error="HTTP 500"),
        result(start=0, first=None, last=None, done=2, tokens=4),  # answered, but no text
    ]
    s = summarize(results, wall_time(results))
    assert s["wall_s"] == 4
    assert (s["requests"], s["errors"], s["short"], s["tokens"]) == (4, 2, 1, 5)
    assert s["error_examples"] == ["HTTP 500", "no text in 4 tokens"]
    assert s["tok_s"] == pytest.approx(5 / 4)
    assert s["ttft_p50_s"] == pytest.approx(1.0)
    assert s["tpot_p99_s"] == pytest.approx(1.0)


# --- the jsonlines stream ------------------------------------------------------------------


def feed(timer: LmiTimer, lines: list[tuple[float, str]]) -> RequestResult:
    for now, line in lines:
        timer.feed(line.encode(), now)
    return timer.result(done=lines[-1][0])


def test_stream_timer_times_every_token_line():
    lines = [
        (0.4, '{"token": {"id": 1, "text": "Hi", "log_prob": -0.1}}'),
        (0.5, ""),
        (0.6, '{"token": {"id": 2, "text": "!", "log_prob": -0.2}}'),
        (0.8, '{"token": {"id": 3, "text": "", "log_prob": -0.3}, "generated_text": "Hi!",'
              ' "details": {"finish_reason": "length", "generated_tokens": 3}}'),
    ]
    r = feed(LmiTimer(start=0.0, expected_tokens=3), lines)
    assert (r.tokens, r.error) == (3, None)
    assert r.ttft == pytest.approx(0.4)
    assert r.tpot == pytest.approx(0.2)


def test_stream_timer_accepts_sse_framing():
    r = feed(LmiTimer(0.0, 1), [(0.3, 'data:{"token": {"id": 1, "text": "a"}}')])
    assert (r.tokens, r.ttft) == (1, 0.3)


def test_stream_timer_records_the_error_line_instead_of_counting_it():
    error_line = orjson.dumps({
        "token": {"id": -1, "text": "", "log_prob": -1, "special_token": True},
        "generated_text": "",
        "details": {"finish_reason": "error", "error": "engine died"},
    }).decode()
    r = feed(LmiTimer(0.0, 5), [(0.1, '{"token": {"id": 1, "text": "a"}}'), (0.2, error_line)])
    assert r.tokens == 1
    assert r.error == "engine died"
    assert not r.ok


def test_stream_timer_flags_garbage_and_empty_streams():
    assert "bad stream line" in feed(LmiTimer(0.0, 1), [(0.1, "not json")]).error
    assert LmiTimer(0.0, 1).result(done=1.0).error == "stream ended without a token"


# --- workloads -----------------------------------------------------------------------------


def test_closed_loop_prompts_give_each_request_its_own_prompt():
    plan = closed_loop_prompts(concurrency=4, requests_per_client=2)
    assert [len(turns) for turns in plan] == [2, 2, 2, 2]
    prompts = [p for turns in plan for p in turns]
    assert len(set(prompts)) == 8
    assert plan == closed_loop_prompts(4, 2)
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)


def test_poisson_trace_is_reproducible_and_within_bounds():
    trace = poisson_trace(n=400, rate=2.0, min_tokens=16, max_tokens=256, seed=7)
    assert trace == poisson_trace(400, 2.0, 16, 256, seed=7)
    assert trace != poisson_trace(400, 2.0, 16, 256, seed=8)
    times = [a.at for a in trace]
    assert times[0] == 0.0 and times == sorted(times)
    assert times[-1] / 399 == pytest.approx(0.5, rel=0.15)  # mean gap is 1 / rate
    lengths = {a.max_new_tokens for a in trace}
    assert min(lengths) >= 16 and max(lengths) <= 256 and len(lengths) > 50


def arrivals(*spec: tuple[float, int]) -> list[Arrival]:
    return [Arrival(i, at, f"prompt {i}", n) for i, (at, n) in enumerate(spec)]


def test_next_batch_takes_arrived_requests_oldest_first_up_to_the_cap():
    pending = arrivals((0.0, 8), (1.0, 8), (2.0, 8), (9.0, 8))
    assert [a.index for a in next_batch(pending, 5.0, max_batch=2)] == [0, 1]
    assert [a.index for a in next_batch(pending, 5.0, max_batch=8)] == [0, 1, 2]
    assert next_batch(pending[3:], 5.0, max_batch=8) == []


class FakeModel:
    """A clock and a generate() that takes 3 s per batch: 1 s to the first token, then 0.25 s
    per step."""

    def __init__(self) -> None:
        self.now = 100.0
        self.batches: list[tuple[list[int], int]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def run_batch(self, batch: list[Arrival]) -> BatchTiming:
        longest = max(a.max_new_tokens for a in batch)
        self.batches.append(([a.index for a in batch], longest))
        start = self.now
        self.now += 3.0
        return BatchTiming(start, [start + 1.0 + 0.25 * i for i in range(longest)], self.now)


def test_static_batcher_groups_waiting_requests_and_pads_to_the_longest():
    trace = arrivals((0.0, 4), (1.0, 2), (2.0, 8), (2.5, 1), (10.0, 3))
    model = FakeModel()
    results = run_static_trace(trace, model.run_batch, model.clock, model.sleep, max_batch=2)

    # t=0 only #0 waits; at 3 #1-#3 wait (cap 2); at 6 #3; idle until #4 arrives at 10.
    assert model.batches == [([0], 4), ([1, 2], 8), ([3], 1), ([4], 3)]
    first, second, third, fourth, fifth = results
    assert second.ttft == pytest.approx(3.0)  # arrived at 1, batch starts at 3, +1 s prefill
    assert second.tokens == 2 and second.tpot == pytest.approx(0.25)
    assert second.latency == pytest.approx(5.0)  # waits for #2's 8 tokens: the batch ends at 6
    assert fourth.ttft == pytest.approx(4.5)
    assert fifth.ttft == pytest.approx(1.0)
    assert all(r.ok and r.tokens == r.expected_tokens for r in results)


# --- the client, against a stand-in server ------------------------------------------------


async def answered(respond: web.Response | None = None) -> tuple[dict, RequestResult]:
    """One LMI request through the client to a server that records it and answers `respond`
    (four token lines when None)."""
    sent = {}

    async def handler(request: web.Request) -> web.Response:
        sent.update(await request.json(), path=request.path)
        if respond is not None:
            return respond
        lines = [{"token": {"id": i, "text": "x", "log_prob": 0.0}} for i in range(4)]
        body = b"\n".join(orjson.dumps(line) for line in lines) + b"\n"
        return web.Response(body=body, content_type="application/jsonlines")

    app = web.Application()
    app.router.add_post("/{path:.*}", handler)
    async with TestServer(app) as server, client.session() as http:
        url = str(server.make_url("")).rstrip("/")
        return sent, await client.stream_request(http, url, client.LMI, "Hello", 4)


async def test_stream_request_sends_an_lmi_streaming_body_and_times_the_tokens():
    sent, r = await answered()
    assert sent == {"path": "/invocations", **client.lmi_body("Hello", 4)}
    assert sent["parameters"] == {"max_new_tokens": 4, "ignore_eos_token": True}
    assert (r.tokens, r.expected_tokens, r.error) == (4, 4, None)


async def test_stream_request_reports_an_http_error():
    error = web.json_response({"error": "max_new_tokens too large", "code": 424}, status=424)
    _sent, r = await answered(error)
    assert not r.ok
    assert r.error.startswith("HTTP 424") and "max_new_tokens" in r.error


# --- command line and report ---------------------------------------------------------------


def test_quick_sets_small_defaults_that_flags_override():
    args = parse_args(["--quick", "--concurrency", "1,2"])
    assert (args.concurrency, args.max_new_tokens) == ([1, 2], 16)
    assert parse_args([]).concurrency == [1, 8, 16, 32]
    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "64", "--max-batch", "32"])


def level(system: str, label: str, tok_s: float) -> dict:
    return {"workload": "A", "system": system, "label": label, "concurrency": 8, "tok_s": tok_s,
            "ttft_p50_s": 0.1, "ttft_p99_s": 0.25, "tpot_p50_s": 0.02, "tpot_p99_s": 0.03,
            "errors": 0, "short": 0}


def test_the_generate_baseline_runs_a_given_model_as_one_static_batch(tiny_dir):
    from bench import baseline

    model = baseline.GenerateBaseline(threads=1, dtype="fp32", model=tiny_dir)
    timing = model.run_batch(["Deep learning is", "The quick brown fox jumps over"], 5)
    assert len(timing.token_times) == 5  # one stamp a step, the prompt's pass not counted
    assert timing.start < timing.token_times[0] <= timing.token_times[-1] <= timing.end
    assert parse_args(["--model", str(tiny_dir), "--device", "cuda"]).device == "cuda"


def test_table_pairs_server_with_generate_and_shows_the_ratio(tmp_path):
    levels = [level("server", "C=8", 300.0), level("generate", "C=8", 100.0),
              level("server", "C=16", 50.0)]
    assert [(p.label, p.ratio) for p in paired(levels)] == [("C=8", 3.0), ("C=16", None)]
    table = serving_table(levels)
    assert "3.00x" in table and "250" in table  # TTFT p99 in ms
    assert len(table.splitlines()) == 2 + 3 + 1

    serving_plot(levels, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG")


# --- the cold-start benchmark -----------------------------------------------------------------


def test_cold_start_phases_are_read_from_the_log_relative_to_the_launch(tmp_path):
    from datetime import datetime

    from bench import cold_start

    launched = datetime(2026, 11, 25, 6, 0, 0).timestamp()
    log = "\n".join([
        "2026-11-25 06:00:01,250 INFO lmi_serve: config --model-dir = /x [default]",
        "INFO:     Started server process [1]",
        "2026-11-25 06:00:03,000 INFO handlers.engine.torch.loader: Loaded tiny from /x",
        "2026-11-25 06:00:04,500 INFO lmi_serve: model tiny is ready on http://0.0.0.0:8080",
    ])
    phases = cold_start._phases(log, launched)
    assert phases == pytest.approx({"configured": 1.25, "model loaded": 3.0, "ready": 4.5})
    runs = [{**phases, "/ping 200": 4.6, "/v1/embeddings": 9.0},
            {"configured": 1.0, "/ping 200": 5.0, "/v1/embeddings": 8.0}]
    stats = cold_start.summary(runs)
    assert stats["/ping 200"] == pytest.approx({"median": 4.8, "min": 4.6, "max": 5.0})
    assert stats["ready"] == {"median": 4.5, "min": 4.5, "max": 4.5}  # one run had no line
    assert "| /ping 200 | 4.80 | 4.60 | 5.00 |" in cold_start.format_table(stats)
    cold_start.plot(runs[:1], tmp_path / "cold.png")
    assert (tmp_path / "cold.png").stat().st_size > 0
