"""The management routes of a real `lmi-serve` (the torch engine with LoRA on, loading models at
runtime) answer a client's mistakes with a 400 naming what it sent: never a 500 with a
traceback, never a path of the server's own (its model directory, its cache, its checkout)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_process import running_server

CHECKOUT = str(Path(__file__).resolve().parents[2])


@pytest.mark.e2e
def test_client_mistakes_are_400s_naming_what_was_sent(tiny_dir, tmp_path):
    model_dir = tmp_path / "model"
    (model_dir / "notes").mkdir(parents=True)
    (model_dir / "notes" / "README.md").write_text("no weights, no adapter here")
    options = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
               "option.enable_lora=true", "option.dtype=fp32")
    with running_server(*options, model_dir=model_dir, env={"LMI_CACHE_DIR": str(tmp_path)},
                        log_path=tmp_path / "server.log") as url:
        def model(source: str) -> httpx.Response:
            return httpx.post(f"{url}/models", json={"model_name": "m", "url": source},
                              timeout=120)

        def adapter(source: str) -> httpx.Response:
            return httpx.post(f"{url}/adapters", params={"name": "a", "src": source},
                              timeout=120)

        answers = {
            "model notes": model("notes"), "model a/..": model("a/.."),
            "adapter notes": adapter("notes"), "adapter a/..": adapter("a/.."),
            "adapter /etc": adapter("/etc"),
            "vllm notes": httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                                     json={"lora_name": "a", "lora_path": "notes"}),
        }
    for what, answer in answers.items():
        assert answer.status_code == 400, (what, answer.text)
        assert str(tmp_path) not in answer.text and CHECKOUT not in answer.text, what
    messages = {what: answer.json()["message"] for what, answer in answers.items()
                if not what.startswith("vllm")}
    assert messages["model notes"] == ("url='notes' holds no model files (config.json with "
                                       "*.safetensors, or one .gguf file)")
    assert messages["model a/.."].startswith("url: a/..: not a Hugging Face Hub id")
    assert messages["adapter a/.."].startswith("src: a/..: not a Hugging Face Hub id")
    assert messages["adapter /etc"] == (
        "src='/etc' is outside the directories adapters may be read from")
    assert "notes/adapter_config.json" in messages["adapter notes"]
    assert "notes/adapter_config.json" in answers["vllm notes"].json()["error"]["message"]
