"""model.py files in the shapes DJL LMI's documentation and SageMaker's inference toolkit show
(written here), for the tests of a model.py at LMI's entry (handlers/djl/model_code.py,
custom_entry.py). `write(folder, text)` puts one in place."""

from __future__ import annotations

import textwrap
from pathlib import Path

# DJL LMI's custom formatters: a schema of the user's own in, a shape of their own out; a
# streamed chunk arrives as vLLM's SSE text.
FORMATTERS = '''
import json

from djl_python.input_parser import input_formatter
from djl_python.output_formatter import output_formatter


@input_formatter
def custom_input_formatter(decoded_payload: dict, tokenizer=None, **kwargs) -> dict:
    return {"inputs": decoded_payload["question"],
            "parameters": {"max_new_tokens": decoded_payload.get("length", 4),
                           "do_sample": False},
            "stream": decoded_payload.get("stream", False)}


@output_formatter
def custom_output_formatter(output):
    if isinstance(output, str):  # a streamed chunk
        data = output.removeprefix("data: ").strip()
        if data == "[DONE]":
            return {"done": True}
        chunk = json.loads(data)
        if not chunk["choices"]:
            return {"generated_tokens": chunk["usage"]["completion_tokens"]}
        return {"token": chunk["choices"][0]["text"]}
    choice = output.choices[0]
    text = choice.text if hasattr(choice, "text") else choice.message.content
    return {"answer": text, "finish_reason": choice.finish_reason, "model": output.model}
'''

# An adapter's own input formatter (its output formatter is the base model's); the call gives
# it the tokenizer alone.
ADAPTER_INPUT = '''
from djl_python.input_parser import input_formatter


@input_formatter
def adapter_input(decoded_payload, tokenizer=None):
    words = len(tokenizer.encode(decoded_payload["question"]))
    return {"inputs": f"alpha says {decoded_payload['question']}",
            "parameters": {"max_new_tokens": words + 1},
            "stream": decoded_payload.get("stream", False)}
'''

# An adapter's own output formatter (its input formatter is the base model's).
ADAPTER_OUTPUT = '''
from djl_python.output_formatter import output_formatter


@output_formatter
def adapter_output(output):
    if isinstance(output, str):
        return output.strip()
    return {"adapter_text": output.choices[0].text.upper()}
'''

# An output formatter that hands the object back: DJL sends a pydantic model as its JSON.
PASS_THROUGH = '''
from djl_python.output_formatter import output_formatter


@output_formatter
def unchanged(output):
    return output
'''

# DJL's prediction handler with the served model (no init handler made one).
PREDICTION_HANDLER = '''
from djl_python.input_parser import input_formatter, prediction_handler
from djl_python.output_formatter import output_formatter


@input_formatter
def questions(decoded_payload, **kwargs):
    return decoded_payload["questions"]


@prediction_handler
def answer_each(X, model, **kwargs):
    answers = []
    for question in X:
        completion = model.predict({"inputs": question, "parameters": {"max_new_tokens": 2}})
        answers.append(completion.choices[0].text)
    return answers


@output_formatter
def numbered(predictions):
    return {"answers": {str(i): text for i, text in enumerate(predictions)}}
'''

# DJL's init handler making the model (DJL's scikit-learn handler's way): its predict() runs.
INIT_HANDLER = '''
import os

from djl_python.input_parser import init_handler


class KeywordModel:
    def __init__(self, words):
        self.words = words

    def predict(self, X):
        return {"matches": [w for w in self.words if w in X["text"]], "loaded": len(self.words)}


@init_handler
def load(model_dir, **kwargs):
    with open(os.path.join(model_dir, "keywords.txt")) as f:
        return KeywordModel(f.read().split())
'''

# SageMaker's inference toolkit's four functions, over the served LLM: model_fn makes no model
# of its own, so predict_fn gets the served one.
SAGEMAKER_LLM = '''
import json


def model_fn(model_dir):
    return None


def input_fn(request_body, request_content_type):
    if request_content_type == "text/plain":
        return {"inputs": request_body.decode("utf-8"), "parameters": {"max_new_tokens": 3}}
    return json.loads(request_body)


def predict_fn(input_data, model):
    completion = model.predict(input_data)
    return {"text": completion.choices[0].text, "tokens": completion.usage.completion_tokens}


def output_fn(prediction, accept):
    if accept == "text/csv":
        return f"{prediction['tokens']},{prediction['text'].strip()}"
    return json.dumps(prediction), "application/json"
'''

# SageMaker's inference toolkit's four functions over a model of their own, as a scikit-learn
# script has them: DJL's own handler for such scripts runs the same file.
SAGEMAKER_TABULAR = '''
import json
import os

import numpy as np


def model_fn(model_dir):
    with open(os.path.join(model_dir, "weights.json")) as f:
        return np.array(json.load(f))


def input_fn(request_body, request_content_type):
    if request_content_type == "text/csv":
        rows = [line.split(",") for line in request_body.decode().splitlines() if line]
        return np.array(rows, dtype=float)
    return np.array(json.loads(request_body)["instances"], dtype=float)


def predict_fn(input_data, model):
    return input_data @ model


def output_fn(prediction, accept):
    if accept == "text/csv":
        return "\\n".join(f"{value:g}" for value in prediction)
    return json.dumps({"predictions": prediction.tolist()})
'''


def write(folder: Path, text: str, files: dict[str, str] | None = None) -> Path:
    """`folder` with `text` as its model.py, and `files` (name: content) beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.py").write_text(textwrap.dedent(text))
    for name, content in (files or {}).items():
        (folder / name).write_text(content)
    return folder
