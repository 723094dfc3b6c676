"""The compiled CPU decode step (handlers/engine/torch/decode_graphs.py) on the tiny Llama:
compiled for real in its subprocess (a few minutes, once per module), in float32 it gives the
eager step's tokens and logits at one row and at several, and its constants are stored once,
beside the code, and mapped; in bfloat16 one graph serves every row count and gives a row the
same logits whatever the count; a second start loads the cached packages without compiling; a
compile that fails leaves the eager step serving; and a server with the default
option.enforce_eager=false decodes through the graphs and answers as an eager one does.

Graphs compiled ahead (graphs_ahead.py, the image's build step) for the best x86-64 level this CPU
runs target that level's instruction sets, not this CPU's; they are found and loaded at start,
by the engine and by a server, with no compile process started and nothing written to the
writable cache; on a CPU lacking that level they are not used."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_process import running_server

from handlers.engine import native_build
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.machine import cpu_flags, has_native_bf16
from handlers.engine.torch import decode_graphs, decode_step, graph_target, quant_linear
from handlers.engine.torch.decode_graphs import DecodeGraphs, watch_compile
from handlers.engine.torch.decode_step import graph_specs
from handlers.engine.torch.graph_constants import SUFFIX
from handlers.engine.torch.loader import LoadedModel, load_model
from handlers.engine.torch.model_runner import ModelRunner

pytestmark = pytest.mark.slow
SLOTS = 32  # the servers' default option.max_rolling_batch_size: the server test reuses them
COMPILE_WAIT_S = 1800  # a hang guard only: compiling is minutes on two cores


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


def fresh(tiny_dir: Path, dtype: str = "fp32") -> LoadedModel:
    return load_model(tiny_dir, dtype=dtype, device="cpu")


def started(loaded: LoadedModel, cache_dir: Path) -> DecodeGraphs:
    graphs = DecodeGraphs.for_model(loaded, SLOTS, loaded.max_model_len, cache_dir)
    assert graphs is not None
    graphs.start()
    assert graphs.ready.wait(COMPILE_WAIT_S)
    return graphs


@pytest.fixture(scope="module")
def compiled(tiny_dir: Path, cache_dir: Path) -> tuple[LoadedModel, DecodeGraphs]:
    loaded = fresh(tiny_dir)
    graphs = started(loaded, cache_dir)
    assert graphs.counts() == {"decode_graphs_ready": 2, "decode_graphs_total": 2}
    return loaded, graphs


@pytest.mark.parametrize("rows", [1, 3])
def test_the_compiled_step_gives_the_eager_steps_tokens_and_logits(tiny_dir, compiled, rows):
    loaded, graphs = compiled
    assert graphs.kv_dtype == torch.float16  # option.kv_cache_dtype=auto under float32
    eager = ModelRunner(fresh(tiny_dir).model, SLOTS, loaded.max_model_len,
                        kv_dtype=torch.float16)
    fast = ModelRunner(loaded.model, SLOTS, loaded.max_model_len, graphs,
                       kv_dtype=torch.float16)
    assert graphs.for_rows(rows) is not None
    prompts = [list(range(5 + row, 20 + 7 * row)) for row in range(rows)]
    for runner in (eager, fast):
        runner.prefill([PrefillChunk(slot, ids, 0) for slot, ids in enumerate(prompts)])
    tokens, lengths = [ids[-1] for ids in prompts], [len(ids) for ids in prompts]
    for _ in range(40):
        want, got = eager.decode(tokens, lengths), fast.decode(tokens, lengths)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens, lengths = want.argmax(-1).tolist(), [n + 1 for n in lengths]


def test_a_second_start_loads_the_cached_graphs_without_compiling(tiny_dir, cache_dir, compiled,
                                                                  caplog):
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.decode_graphs"):
        graphs = started(fresh(tiny_dir), cache_dir)
    assert graphs.counts()["decode_graphs_ready"] == 2
    assert graphs.directory == compiled[1].directory
    assert sum("loaded in" in r.message for r in caplog.records) == 2
    assert not any("compiling" in r.message for r in caplog.records)


def test_the_constants_are_stored_once_beside_the_code_and_mapped(compiled):
    directory = compiled[1].directory
    for package in directory.glob("*.pt2"):
        with zipfile.ZipFile(package) as archive:
            assert not [n for n in archive.namelist() if "/data/weights/" in n]
    paths = sorted(directory.glob(f"*{SUFFIX}"))
    mapped = Path("/proc/self/maps").read_text()  # by the graphs: the test has not loaded them
    stores = [torch.load(p, mmap=True, weights_only=True) for p in paths]
    assert len(stores) == 2
    first, second = (set(s["tensors"]) for s in stores)
    assert not first & second  # each distinct tensor once
    assert set().union(*(s["names"].values() for s in stores)) == first | second
    assert len(first | second) < sum(len(s["names"]) for s in stores)  # the graphs share some
    assert all(str(p) in mapped for p, s in zip(paths, stores, strict=True) if s["tensors"])


def test_other_weights_batch_slots_or_kv_dtypes_get_graphs_of_their_own(tiny_dir, cache_dir):
    loaded = fresh(tiny_dir)
    directory = DecodeGraphs.for_model(loaded, SLOTS, 512, cache_dir).directory
    assert DecodeGraphs.for_model(loaded, 8, 512, cache_dir).directory != directory
    assert DecodeGraphs.for_model(loaded, SLOTS, 512, cache_dir,
                                  kv_cache_dtype="float16").directory == directory  # auto's
    others = {DecodeGraphs.for_model(loaded, SLOTS, 512, cache_dir, kv_cache_dtype=kv).directory
              for kv in ("float32", "bfloat16", "fp8", "fp8_e5m2")}
    assert len(others) == 4 and directory not in others
    with pytest.raises(ValueError, match="decode graphs over a torch.float16 KV cache"):
        ModelRunner(loaded.model, SLOTS, 512, DecodeGraphs.for_model(loaded, SLOTS, 512,
                                                                     cache_dir))
    with torch.no_grad():
        loaded.model.model.norm.weight[0] += 1
    assert DecodeGraphs.for_model(loaded, SLOTS, 512, cache_dir).directory != directory


def test_graphs_are_for_float32_and_bfloat16_on_the_cpu(tiny_dir, cache_dir, caplog):
    loaded = load_model(tiny_dir, dtype="fp16", device="cpu")
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.decode_graphs"):
        assert DecodeGraphs.for_model(loaded, SLOTS, 512, cache_dir) is None
    assert "compiled only for float32 and bfloat16 on the CPU" in caplog.text


@pytest.mark.skipif(not has_native_bf16(),
                    reason="this CPU has no bf16 matmul kernels (AVX512-BF16 or AMX): oneDNN "
                    "widens bf16 by the batch's shape there, and auto serves float32")
def test_in_bfloat16_one_graph_gives_a_row_the_same_logits_whatever_the_row_count(
        tiny_dir, cache_dir):
    loaded = fresh(tiny_dir, "bf16")
    graphs = started(loaded, cache_dir)
    assert graphs.counts() == {"decode_graphs_ready": 1, "decode_graphs_total": 1}
    eager = ModelRunner(fresh(tiny_dir, "bf16").model, SLOTS, loaded.max_model_len,
                        kv_dtype=torch.bfloat16)
    fast = ModelRunner(loaded.model, SLOTS, loaded.max_model_len, graphs,
                       kv_dtype=graphs.kv_dtype)
    prompts = [list(range(5 + row, 20 + 7 * row)) for row in range(8)]
    for runner in (eager, fast):
        runner.prefill([PrefillChunk(slot, ids, 0) for slot, ids in enumerate(prompts)])
    token, length = prompts[0][-1], len(prompts[0])
    for _ in range(20):
        alone = fast.decode([token], [length])[0]
        for rows in (3, 8):  # the other rows write their slots at the same positions each time
            crowd = fast.decode([token] + [p[-1] for p in prompts[1:rows]],
                                [length] + [len(p) for p in prompts[1:rows]])[0]
            assert torch.equal(crowd, alone)
        want = eager.decode([token], [length])[0]
        torch.testing.assert_close(alone, want, rtol=0.05, atol=0.05)  # bf16's roundings
        token, length = int(alone.argmax()), length + 1


def test_on_quantized_linears_one_graph_gives_a_row_the_eager_steps_logits_in_any_batch(
        tiny_dir, cache_dir):
    """int4 linears round each input to int8: the two float32 graphs' ~1e-6 apart would move
    whole steps there, so there is one graph, and a row's logits do not depend on its batch;
    nor on whether the step was compiled (the eager step before the graphs load, or beside a
    LoRA row): RMSNorm is one op in both and the rotary angles a table."""
    if not quant_linear.available():
        pytest.skip("no C++ compiler here")
    loaded = load_model(tiny_dir, dtype="fp32", device="cpu", quantize="int4")
    graphs = started(loaded, cache_dir)
    assert graphs.counts() == {"decode_graphs_ready": 1, "decode_graphs_total": 1}
    # The graph reads the server's own blocks, not a mapped copy of them (issue 50's item 4).
    blocks = {id(buffer) for module in loaded.model.modules()
              if isinstance(module, (quant_linear.QuantLinear, quant_linear.QuantEmbedding))
              for buffer in module.buffers()}
    [shared] = graphs.shared_constants.values()
    assert shared >= len(blocks) > 0
    fast = ModelRunner(loaded.model, SLOTS, loaded.max_model_len, graphs,
                       kv_dtype=graphs.kv_dtype)
    eager = ModelRunner(load_model(tiny_dir, dtype="fp32", device="cpu", quantize="int4").model,
                        SLOTS, loaded.max_model_len, kv_dtype=graphs.kv_dtype)
    prompts = [list(range(5 + row, 20 + 7 * row)) for row in range(8)]
    for runner in (fast, eager):
        runner.prefill([PrefillChunk(slot, ids, 0) for slot, ids in enumerate(prompts)])
    token, length = prompts[0][-1], len(prompts[0])
    for _ in range(20):
        alone = fast.decode([token], [length])[0]
        assert torch.equal(alone, eager.decode([token], [length])[0])
        for rows in (3, 8):
            crowd = fast.decode([token] + [p[-1] for p in prompts[1:rows]],
                                [length] + [len(p) for p in prompts[1:rows]])[0]
            assert torch.equal(crowd, alone)
        token, length = int(alone.argmax()), length + 1


def test_a_compile_that_fails_leaves_the_eager_step_serving(tiny_dir, tmp_path, caplog):
    loaded = fresh(tiny_dir)
    graphs = DecodeGraphs.for_model(loaded, 4, loaded.max_model_len, tmp_path)
    graphs._job["source"] = str(tmp_path / "gone")  # the subprocess finds no model there
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.decode_graphs"):
        graphs.start()
        assert graphs.ready.wait(COMPILE_WAIT_S)
    assert graphs.counts()["decode_graphs_ready"] == 0
    assert "were not compiled (exit code 1" in caplog.text
    runner = ModelRunner(loaded.model, 4, loaded.max_model_len, graphs, kv_dtype=graphs.kv_dtype)
    runner.prefill([PrefillChunk(0, [5, 6, 7], 0)])
    assert runner.decode([8], [3]).shape == (1, runner.vocab_size)


def metric(url: str, name: str) -> float | None:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == name), None)


def completion(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=24, temperature=0).choices[0].text


def test_a_default_server_decodes_through_the_graphs_and_answers_as_an_eager_one(
        tiny_dir, cache_dir, compiled, tmp_path):
    # float32 (the graphs compiled above), where compiled and eager logits agree to ~1e-6
    server = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none", "option.dtype=fp32")
    env = {"LMI_CACHE_DIR": str(cache_dir), "OPTION_ENFORCE_EAGER": "false"}
    with running_server(*server, env=env, log_path=tmp_path / "compiled.log") as url:
        assert metric(url, "lmi_decode_graphs_total") == 2
        deadline = time.monotonic() + COMPILE_WAIT_S  # loading the cached two: seconds
        while metric(url, "lmi_decode_graphs_ready") != 2:
            assert time.monotonic() < deadline, "the cached graphs were not loaded"
            time.sleep(0.5)
        text = completion(url)
    log = (tmp_path / "compiled.log").read_text()
    assert "loaded in" in log and "compiling" not in log
    eager_env = {"LMI_CACHE_DIR": str(cache_dir), "OPTION_ENFORCE_EAGER": "true"}
    with running_server(*server, env=eager_env, log_path=tmp_path / "eager.log") as url:
        assert metric(url, "lmi_decode_graphs_total") is None
        assert completion(url) == text


def test_a_compile_that_left_every_graph_is_reaped_once_it_exits(tmp_path):
    """Every graph loads while the compile process still runs (it exits a moment after
    writing them): it is still waited for, never left <defunct>."""
    done = tmp_path / "written"
    script = f"import pathlib, time; pathlib.Path({str(done)!r}).touch(); time.sleep(0.5)"
    process = subprocess.Popen([sys.executable, "-c", script])
    specs = graph_specs(4, "float32")
    left = watch_compile(process, list(specs), lambda spec: done.exists(), poll_s=0.01)
    assert left == []
    assert process.returncode == 0  # waited for: its exit status was collected
    with pytest.raises(ChildProcessError):
        os.waitpid(process.pid, os.WNOHANG)  # no child of that pid is left to reap


# --- graphs compiled ahead (an image's build step) -------------------------------------------


@pytest.fixture(scope="module")
def built_ahead(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """graphs_ahead run as the Dockerfile runs it, for the tiny model and the best level this
    CPU runs: (the level, the folder it built into)."""
    levels = graph_target.runnable()
    if not levels:
        pytest.skip("this CPU runs no x86-64 level graphs are built ahead for")
    image = tmp_path_factory.mktemp("image")
    env = {**os.environ, "LMI_CACHE_DIR": str(tmp_path_factory.mktemp("build-cache"))}
    subprocess.run([sys.executable, "-m", "handlers.engine.torch.graphs_ahead", "--into",
                    str(image), "--levels", levels[0], "--option", f"option.model_id={tiny_dir}",
                    "--option", "option.embedding_model_id=none"],
                   check=True, timeout=COMPILE_WAIT_S, env=env)
    return levels[0], image


@pytest.fixture()
def spawned(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every decode-graph compile process started from here on."""
    started: list[list[str]] = []
    real = subprocess.Popen

    def popen(argv, *args, **kwargs):
        if decode_step.__name__ in argv:
            started.append(list(argv))
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(decode_graphs.subprocess, "Popen", popen)
    return started


def test_graphs_built_ahead_target_their_level_not_this_cpu(built_ahead):
    """Every C++ file of the packages was compiled with the level's -march and vector ISA:
    none with -march=native, or an ISA no CPU of the level has (AVX512-BF16, AMX), though
    inductor picks those on a CPU that has them."""
    level, image = built_ahead
    commands = []
    for package in image.rglob("*.pt2"):
        with zipfile.ZipFile(package) as archive:
            for name in (n for n in archive.namelist() if n.endswith(".cpp")):
                text = archive.read(name).decode()
                commands += re.findall(r"^// g\+\+ .*$", text, flags=re.MULTILINE)
    assert commands
    capability = "AVX2" if level == "x86-64-v3" else "AVX512"
    for command in commands:
        assert f"-march={level} " in command and "native" not in command
        assert "bf16" not in command and "amx" not in command
        assert f"CPU_CAPABILITY_{capability} " in command


def test_graphs_built_ahead_for_this_cpus_level_load_at_start_without_compiling(
        tiny_dir, built_ahead, tmp_path, spawned, caplog):
    level, image = built_ahead
    loaded = fresh(tiny_dir)
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.decode_graphs"):
        graphs = DecodeGraphs.for_model(loaded, SLOTS, loaded.max_model_len, tmp_path / "cache",
                                        prebuilt_dir=image)
        graphs.start()
        assert graphs.ready.wait(COMPILE_WAIT_S)
    assert graphs.counts() == {"decode_graphs_ready": 2, "decode_graphs_total": 2}
    assert graphs.directory.parent.parent == image
    assert spawned == []  # no compile process
    assert not (tmp_path / "cache").exists()  # nothing compiled into the writable cache
    assert f"decode graphs compiled ahead for {level} found in {graphs.directory}" in caplog.text
    assert sum("loaded in" in r.message for r in caplog.records) == 2
    assert "compiling" not in caplog.text
    eager = ModelRunner(fresh(tiny_dir).model, SLOTS, loaded.max_model_len,
                        kv_dtype=graphs.kv_dtype)
    fast = ModelRunner(loaded.model, SLOTS, loaded.max_model_len, graphs,
                       kv_dtype=graphs.kv_dtype)
    for runner in (eager, fast):
        runner.prefill([PrefillChunk(0, list(range(5, 20)), 0)])
    tokens, lengths = [19], [15]
    for _ in range(10):
        want, got = eager.decode(tokens, lengths), fast.decode(tokens, lengths)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        tokens, lengths = want.argmax(-1).tolist(), [lengths[0] + 1]


def test_graphs_built_ahead_for_a_level_this_cpu_lacks_are_not_used(
        tiny_dir, built_ahead, tmp_path, spawned, caplog, monkeypatch):
    """This CPU without the level's instruction sets (and so every level above it): the image's
    graphs would fault on it, so the engine compiles its own, into the writable cache."""
    level, image = built_ahead
    lacking = " ".join(set(cpu_flags().split()) - native_build.LEVELS[level])
    monkeypatch.setattr(native_build, "cpu_flags", lambda: lacking)
    assert level not in graph_target.runnable()
    loaded = fresh(tiny_dir)
    with caplog.at_level(logging.INFO, logger="handlers.engine.torch.decode_graphs"):
        graphs = DecodeGraphs.for_model(loaded, SLOTS, loaded.max_model_len, tmp_path / "cache",
                                        prebuilt_dir=image)
        assert graphs.directory.parent == tmp_path / "cache" / "decode-graphs"
        assert graphs._job["target"] != level
        graphs._job["source"] = str(tmp_path / "gone")  # its compile fails at once
        graphs.start()
        assert graphs.ready.wait(COMPILE_WAIT_S)
    assert graphs.counts()["decode_graphs_ready"] == 0
    assert "loaded in" not in caplog.text  # not the image's
    assert len(spawned) == 1 and "compiling decode graphs" in caplog.text
    assert f"no decode graphs compiled ahead in {image}" in caplog.text


def test_a_server_finds_the_graphs_built_ahead_and_compiles_nothing(tiny_dir, built_ahead,
                                                                    tmp_path):
    """As a container starts: $LMI_PREBUILT_GRAPHS holds the image's graphs, the writable cache
    is empty."""
    level, image = built_ahead
    cache = tmp_path / "cache"
    env = {"LMI_CACHE_DIR": str(cache), "LMI_PREBUILT_GRAPHS": str(image),
           "OPTION_ENFORCE_EAGER": "false"}
    server = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
              "option.dtype=fp32")
    with running_server(*server, env=env, log_path=tmp_path / "server.log") as url:
        deadline = time.monotonic() + COMPILE_WAIT_S  # loading them: seconds
        while metric(url, "lmi_decode_graphs_ready") != 2:
            assert time.monotonic() < deadline, "the graphs built ahead were not loaded"
            time.sleep(0.5)
        assert completion(url)
    log = (tmp_path / "server.log").read_text()
    assert f"decode graphs compiled ahead for {level} found in {image}" in log
    assert "compiling" not in log and not (cache / "decode-graphs").exists()
