"""Several models on one real `lmi-serve`, as a SageMaker multi-model endpoint drives it: two
random-weight models loaded through `POST /models` from SageMaker's layout
(`<root>/<name>/model`) each answer under their own name, through `/models/{name}/invoke` and
through `X-Amzn-SageMaker-Target-Model`; unloading one gives its memory back (the server's RSS,
measured); a model that cannot fit is 507 and one not loaded is 404. The embedded default
embedding model loaded the same way answers embeddings, as sentence-transformers computes them."""

from __future__ import annotations

import shutil

import httpx
import numpy as np
import psutil
from sentence_transformers import SentenceTransformer
from server_process import server_process
from tiny_model import make_tiny_model_dir

from handlers.model_source import default_embedding_model_path

# ~60-80 MB of float32 weights each, well above the allocator's noise; two widths, so two
# different models (the tiny models' weights come from one seed).
WIDTHS = {"alpha": 384, "beta": 320}
TARGET = "X-Amzn-SageMaker-Target-Model"


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def test_models_load_answer_unload_and_free_their_memory(tiny_dir, tmp_path):
    root = tmp_path / "models"
    for name, width in WIDTHS.items():
        make_tiny_model_dir(root / name / "model", width=width)
    huge = root / "huge" / "model"
    huge.mkdir(parents=True)
    (huge / "config.json").write_text("{}")  # a checkpoint's layout: refused for its size alone
    with open(huge / "model.safetensors", "wb") as weights:  # sparse: no disk, no memory
        weights.truncate(1 << 40)
    options = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
               "option.enforce_eager=true", "option.dtype=fp32")
    with server_process(*options, model_dir=root, log_path=tmp_path / "server.log") as (
            process, url):
        def load(name: str) -> httpx.Response:
            return httpx.post(f"{url}/models", timeout=300, json={
                "model_name": name, "url": str(root / name / "model")})

        before = rss(process.pid)
        assert load("alpha").status_code == 200
        assert load("beta").status_code == 200
        loaded = rss(process.pid)
        answers = {}
        for name in ("alpha", "beta"):
            invoked = httpx.post(f"{url}/models/{name}/invoke", timeout=120, json={
                "inputs": "Hello", "parameters": {"max_new_tokens": 4, "details": True}})
            targeted = httpx.post(f"{url}/invocations", headers={TARGET: name}, timeout=120,
                                  json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}})
            assert invoked.status_code == targeted.status_code == 200
            answers[name] = invoked.json()["generated_text"]
            assert targeted.json()["generated_text"] == answers[name]  # greedy: the same
        assert answers["alpha"] != answers["beta"]  # two models, not one twice
        own = httpx.post(f"{url}/invocations", json={"inputs": "Hello",
                                                     "parameters": {"max_new_tokens": 4}})
        assert own.json()["generated_text"] not in answers.values()

        refused = load("huge")
        assert refused.status_code == 507, refused.text
        assert httpx.delete(f"{url}/models/beta").status_code == 200
        after = rss(process.pid)
        assert httpx.post(f"{url}/models/beta/invoke", json={"inputs": "Hello"}).status_code \
            == 404
        assert httpx.post(f"{url}/models/alpha/invoke", timeout=120, json={
            "inputs": "Hello", "parameters": {"max_new_tokens": 4}}).json()["generated_text"] \
            == answers["alpha"]
    per_model = (loaded - before) / 2
    assert per_model > 40 << 20, f"two models took {loaded - before} bytes"
    assert loaded - after > 0.6 * per_model, \
        f"unloading freed {loaded - after} bytes of ~{per_model:.0f}"


def test_an_embedding_model_loaded_at_runtime_answers_embeddings(tiny_dir, tmp_path):
    """SageMaker's layout holding a sentence-transformers model: `input` sent to it is
    embeddings (it was answered as an OpenAI Responses request), as the model computes them."""
    root = tmp_path / "models"
    shutil.copytree(default_embedding_model_path(), root / "minilm" / "model")
    texts = ["The cat sat on the mat.", "A feline rested on the rug.", "Stock prices fell."]
    options = (f"option.model_id={tiny_dir}", "option.embedding_model_id=none",
               "option.enforce_eager=true", "option.dtype=fp32")
    with server_process(*options, model_dir=root, log_path=tmp_path / "server.log") as (
            _process, url):
        loaded = httpx.post(f"{url}/models", timeout=300, json={
            "model_name": "minilm", "url": str(root / "minilm" / "model")})
        assert loaded.status_code == 200, loaded.text
        invoked = httpx.post(f"{url}/models/minilm/invoke", timeout=120, json={"input": texts})
        assert invoked.status_code == 200, invoked.text
        targeted = httpx.post(f"{url}/invocations", headers={TARGET: "minilm"}, timeout=120,
                              json={"input": texts})
        generated = httpx.post(f"{url}/models/minilm/invoke", timeout=120, json={
            "inputs": "Hello", "parameters": {"max_new_tokens": 4}})
        own = httpx.post(f"{url}/invocations", timeout=120, json={
            "inputs": "Hello", "parameters": {"max_new_tokens": 4}})
    vectors = np.array([item["embedding"] for item in invoked.json()["data"]])
    expected = SentenceTransformer(str(root / "minilm" / "model"), device="cpu").encode(texts)
    assert invoked.json()["model"] == "minilm" and vectors.shape == (3, 384)
    np.testing.assert_allclose(vectors, expected, atol=1e-4)
    assert targeted.json()["data"] == invoked.json()["data"]
    assert generated.status_code == 424 and "is an embedding model" in generated.text
    assert own.status_code == 200 and own.json()["generated_text"]
