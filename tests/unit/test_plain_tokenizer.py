"""The tokenizer read without transformers gives what transformers' own gives for the same files
(ids, text, special tokens, rendered chats and their errors), and is not used where transformers
would change the tokenizer."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import jinja2
import pytest
from transformers import AutoTokenizer

from handlers.engine import plain_tokenizer
from handlers.engine.gguf.cache import cached_gguf_dir
from handlers.model_source import default_model_path

TEXTS = ["Hello world", "<|im_start|>user\nhé 你好 🤖<|im_end|>", "  two spaces", "", "a\n\n\tb"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello there "}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now>",
                                           "parameters": {"type": "object", "properties": {}}}}]
# Uses what transformers' renderer gives a template: its tojson (no HTML escaping), loop
# controls, raise_exception, the special tokens, and {% generation %} blocks.
TOOL_TEMPLATE = (
    "{% if tools %}{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}"
    "{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "{{ bos_token }}{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded model's tokenizer files (its conversion's), in a directory of their own."""
    path = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(cached_gguf_dir(default_model_path()) / name, path / name)
    return path


def _edit_config(path: Path, **changes: object) -> Path:
    config_file = path / "tokenizer_config.json"
    config = {**json.loads(config_file.read_text()), **changes}
    config_file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path


def _both(path: Path):
    plain = plain_tokenizer.load(path)
    assert plain is not None
    return plain, AutoTokenizer.from_pretrained(path, local_files_only=True)


def test_ids_text_and_special_tokens_match_transformers(files: Path) -> None:
    plain, hf = _both(files)
    assert len(plain) == len(hf) == 49152
    assert plain.all_special_ids == hf.all_special_ids
    assert plain.eos_token_id == hf.eos_token_id == 2
    assert plain.special_tokens_map == hf.special_tokens_map
    assert plain.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    for text in TEXTS:
        for special in (True, False):
            ids = plain.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special)
            assert plain.decode(ids, skip_special_tokens=special) == \
                hf.decode(ids, skip_special_tokens=special)
            assert plain.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:2], [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "First, "}, {"type": "image"}]}]])
def test_the_models_template_renders_as_transformers_renders_it(files: Path, messages) -> None:
    plain, hf = _both(files)
    assert plain.get_chat_template() == hf.get_chat_template()
    template = plain.get_chat_template()
    for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                    {"continue_final_message": True}):
        if options.get("continue_final_message") and messages[-1]["role"] != "assistant":
            continue
        try:
            want = hf.apply_chat_template(messages, chat_template=template, tokenize=False,
                                          **options)
        except (TypeError, ValueError) as error:  # the list content: SmolLM2's template concats
            with pytest.raises(type(error)):
                plain.apply_chat_template(messages, chat_template=template, **options)
            continue
        assert plain.apply_chat_template(messages, chat_template=template, **options) == want


def test_named_templates_tools_and_template_errors_match_transformers(
        files: Path, tmp_path: Path) -> None:
    path = shutil.copytree(files, tmp_path / "named")
    (path / "chat_template.jinja").unlink()
    default = "{{ messages[0]['content'] }}"
    _edit_config(path, chat_template=[{"name": "default", "template": default},
                                      {"name": "tool_use", "template": TOOL_TEMPLATE}])
    plain, hf = _both(path)
    assert plain.get_chat_template() == hf.get_chat_template() == default
    assert plain.get_chat_template(tools=TOOLS) == hf.get_chat_template(tools=TOOLS) == \
        TOOL_TEMPLATE
    for messages in (CHAT, CHAT * 3):
        for tools in (None, TOOLS):
            want = hf.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE,
                                          tokenize=False, add_generation_prompt=True)
            assert plain.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE,
                                             add_generation_prompt=True) == want
    assert "Weather <now>" in want  # not HTML-escaped
    with pytest.raises(jinja2.exceptions.TemplateError, match="no bad roles"):
        plain.apply_chat_template([{"role": "bad", "content": "x"}], chat_template=TOOL_TEMPLATE)
    with pytest.raises(ValueError):
        plain.apply_chat_template(CHAT, continue_final_message=True, add_generation_prompt=True)


def test_a_model_without_a_template_says_so(files: Path, tmp_path: Path) -> None:
    path = shutil.copytree(files, tmp_path / "bare")
    (path / "chat_template.jinja").unlink()
    plain, hf = _both(path)
    for tokenizer in (plain, hf):
        with pytest.raises(ValueError):
            tokenizer.get_chat_template()


@pytest.mark.parametrize("changes", [
    {"add_bos_token": True},  # transformers rebuilds the post-processor
    {"clean_up_tokenization_spaces": True},  # transformers edits decoded text
    {"tokenizer_class": "GPT2Tokenizer"},  # a class of its own
    {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},  # remote code
    {"extra_special_tokens": ["<|not in the vocabulary|>"]},  # transformers adds it
    {"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "lstrip": True,
                                    "rstrip": False, "normalized": False, "single_word": False,
                                    "special": True}}},  # transformers re-adds it, stripping
])
def test_what_transformers_would_change_is_left_to_transformers(
        files: Path, tmp_path: Path, changes: dict) -> None:
    path = _edit_config(shutil.copytree(files, tmp_path / "changed"), **changes)
    assert plain_tokenizer.load(path) is None


def test_encoding_a_long_text_lets_other_threads_run(files: Path) -> None:
    """The server tokenizes in worker threads: a long prompt must not hold the GIL (and so
    the event loop) while it is encoded. This thread counts its turns; the worker reads the
    count as it starts encoding and as it returns. Held throughout, the GIL lets in at most a
    turn or two at the edges; let go, this thread turns thousands of times meanwhile."""
    plain = plain_tokenizer.load(files)
    text = "the quick brown fox jumps over a lazy dog " * 50_000  # 2 MB
    turns = [0]
    seen: list[int] = []

    def encode() -> None:
        seen.append(turns[0])
        plain.encode(text)
        seen.append(turns[0])

    worker = threading.Thread(target=encode)
    worker.start()
    while worker.is_alive():
        turns[0] += 1
        time.sleep(0)  # gives the GIL up; it comes back at once unless the worker holds it
    worker.join()
    before, after = seen
    assert after - before >= 100, f"{after - before} turns while it encoded"
