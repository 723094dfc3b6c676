"""The peer benchmark's parts that need no peer: the client's load (OpenAI and LMI routes) against
our own server (over the fake engine), and the report's ratios."""

from __future__ import annotations

import asyncio

import pytest
from fakes import FakeEngine, served_app
from server_process import serving

from bench import client
from bench.report import peer_rows, peer_table


@pytest.mark.parametrize("route", [client.OPENAI, client.LMI], ids=["openai", "lmi"])
def test_a_streamed_completion_counts_its_tokens_and_times_them(route: client.Route):
    with serving(served_app(FakeEngine(), model_name=client.MODEL)) as url:
        result = asyncio.run(client.closed_loop(url, route, 2, 1, 5, lambda _n: None))
    assert [(r.error, r.tokens, r.expected_tokens) for r in result] == [(None, 5, 5)] * 2
    assert all(r.ttft is not None and r.tpot is not None for r in result)


def level(peer: str, label: str, tok_s: float) -> dict:
    return {"peer": peer, "workload": "streams", "label": label, "tok_s": tok_s, "errors": 0,
            "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "tpot_p50_s": 0.01, "tpot_p99_s": 0.02}


def run(levels: list[dict], skipped: dict | None = None) -> dict:
    bounds = dict.fromkeys(["read_gb_s", "fp32_gflop_s", "bf16_gflop_s",
                            "one_stream_fp32_tok_s", "one_stream_bf16_tok_s",
                            "batch_fp32_tok_s", "batch_bf16_tok_s"], 1.0)
    return {"levels": levels, "machine": {"cpu": "x", "flags": [], "threads": 2,
                                          "bounds": bounds}, "skipped": skipped or {}}


def test_ratios_are_against_each_peers_reference_at_the_same_level():
    doc = run([level("vllm-server", "1", 50), level("vllm-server", "16", 400),
               level("torch", "1", 65), level("torch", "16", 600),
               level("llamacpp-direct", "1", 90), level("llamacpp", "16", 180)],
              {"vllm": "no .venv-vllm"})
    ratios = {(row[0], row[2]): row[5] for row in peer_rows(doc)}
    assert ratios[("torch", "1")] == "1.30x" and ratios[("torch", "16")] == "1.50x"
    # llama.cpp serves one request at a time: its one-stream rate is the reference everywhere.
    assert ratios[("llamacpp", "16")] == "2.00x" and ratios[("vllm-server", "1")] == "-"
    assert "skipped vllm: no .venv-vllm" in peer_table(doc)


def test_rounds_are_reported_by_their_median():
    doc = run([level("vllm-server", "1", 50), level("vllm", "1", 40),
               level("vllm-server", "1", 60), level("vllm", "1", 58),
               level("vllm-server", "1", 100), level("vllm", "1", 57)])
    table = {row[0]: row for row in peer_rows(doc)}
    assert table["vllm-server"][3:6] == ("3", "60.0", "-")
    assert table["vllm"][3:6] == ("3", "57.0", "0.95x")


def test_the_bounds_are_the_highest_each_probe_found():
    from bench import probes

    first = {"read_gb_s": 31.0, "bf16_gflop_s": 206.0, "batch_bf16_tok_s": 764.0}
    last = {"read_gb_s": 28.7, "bf16_gflop_s": 426.0, "batch_bf16_tok_s": 1584.0}
    assert probes.highest(first, last) == {"read_gb_s": 31.0, "bf16_gflop_s": 426.0,
                                           "batch_bf16_tok_s": 1584.0}


def test_the_bounds_count_the_embedded_models_own_parameters_and_layers():
    from torch import nn

    from bench.peers import LAYERS, PARAMETERS
    from handlers.engine.torch.loader import load_model
    from handlers.model_source import default_model_path

    model = load_model(default_model_path(), dtype="fp32", device="cpu", quantize="none").model
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
    assert len(LAYERS) == len(linears)  # read with a layer's q/k/v as one, its gate/up as one
    assert sum(k * n for k, n in LAYERS) == sum(m.weight.numel() for m in linears)
