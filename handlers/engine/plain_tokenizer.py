"""A checkpoint's tokenizer without importing transformers (~1 s of a ~3.5 s start): the Rust
tokenizer of its tokenizer.json, the special tokens its tokenizer_config.json names, and its chat
template rendered with jinja2 as transformers renders it (the same sandbox, options, filters and
globals). It answers the part of transformers' tokenizer API the engines use.

`load` takes only checkpoints transformers would not alter: a generic tokenizers-backed class and
configuration keys that change nothing in the Rust tokenizer. Anything else returns None, and the
caller loads transformers' class.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # transformers' order (special_tokens_map, all_special_ids)
_EXTRA_SPECIALS = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json keys that leave the Rust tokenizer and the methods here as they are.
_INERT_KEYS = {"backend", "tokenizer_class", "model_max_length", "is_local", "local_files_only",
               "padding_side", "truncation_side", "model_input_names", "chat_template",
               "added_tokens_decoder", "clean_up_tokenization_spaces",
               *NAMED_SPECIALS, *_EXTRA_SPECIALS}
_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")  # an added token's
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks the end of the message to continue


class PlainTokenizer:
    def __init__(self, source: Path, backend: Tokenizer, specials: dict[str, str],
                 extras: list[str], chat_template: str | dict[str, str] | None) -> None:
        self.source = source
        self.backend_tokenizer = backend
        self.special_tokens_map = specials
        self.chat_template = chat_template
        named = list(dict.fromkeys([*specials.values(), *extras]))
        self.all_special_ids = [backend.token_to_id(token) for token in named]
        eos = specials.get("eos_token")
        self.eos_token_id = None if eos is None else backend.token_to_id(eos)
        self._transformers: Any = None

    def transformers(self) -> Any:
        """transformers' tokenizer for the same files, for libraries that read only those
        (xgrammar); loaded on first use."""
        if self._transformers is None:
            from transformers import TokenizersBackend

            self._transformers = TokenizersBackend.from_pretrained(self.source,
                                                                   local_files_only=True)
        return self._transformers

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it tokenizes (encode holds it: a 5 MB prompt
        # held every other thread, the server's event loop included, for 4 s).
        [encoding] = self.backend_tokenizer.encode_batch([text],
                                                         add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_chat_template(self, chat_template: str | None = None,
                          tools: list[dict[str, Any]] | None = None) -> str:
        """The template to render: `chat_template`, else the model's (its `tool_use` one when
        there are tools); ValueError where there is none, as transformers raises."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            if name not in templates:
                raise ValueError("The model has several chat templates and none named default: "
                                 f"{sorted(templates)}")
            return templates[name]
        if chat_template is None and templates is None:
            raise ValueError("The model has no chat template; set option.chat_template")
        return chat_template or templates

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template: str | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool = False, **variables: Any) -> str:
        """The rendered conversation (text only: `tokenize` must be False), with more
        `variables` for the template, as transformers passes its extra keyword arguments."""
        if tokenize:
            raise ValueError("PlainTokenizer renders chats as text only")
        template = self.get_chat_template(chat_template, tools)
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each other")
        final, messages = (_tag_final(messages, template) if continue_final_message
                           else (None, messages))
        text = _compiled(template).render(**{**self.special_tokens_map, **variables},
                                          messages=messages, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt)
        return text if final is None else _cut_at_tag(text, final)


def load(source: Path) -> PlainTokenizer | None:
    """The tokenizer of the checkpoint at `source`, or None where transformers must load it."""
    config_file, tokenizer_file = source / "tokenizer_config.json", source / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()) \
            or (source / "additional_chat_templates").exists():
        return None
    config = json.loads(config_file.read_text())
    if config.get("tokenizer_class") not in GENERIC_CLASSES or set(config) - _INERT_KEYS \
            or config.get("clean_up_tokenization_spaces"):
        return None
    backend = Tokenizer.from_file(str(tokenizer_file))
    if backend.truncation or backend.padding or backend.post_processor is None \
            or backend.get_vocab_size() > 100_000:  # transformers patches these
        return None
    specials = {name: _content(config[name]) for name in NAMED_SPECIALS
                if config.get(name) is not None}
    extras = [_content(token) for key in _EXTRA_SPECIALS for token in config.get(key) or []]
    declared = {str(i): token for i, token in (config.get("added_tokens_decoder") or {}).items()}
    if not _all_added(backend, [*specials.values(), *extras], declared):
        return None  # transformers would add tokens to the vocabulary
    return PlainTokenizer(source, backend, specials, extras, _chat_templates(source, config))


def _content(token: str | dict[str, Any]) -> str:
    return token["content"] if isinstance(token, dict) else token


def _all_added(backend: Tokenizer, specials: list[str], declared: dict[str, Any]) -> bool:
    """Whether every special token is already a special added token of the tokenizer, and every
    token of added_tokens_decoder one with the same id and flags."""
    added = backend.get_added_tokens_decoder()
    by_content = {token.content: token for token in added.values()}
    if not all(token in by_content and by_content[token].special for token in specials):
        return False
    return all(int(i) in added and isinstance(token, dict) and all(
        getattr(added[int(i)], key) == value for key, value in token.items() if key in _FLAGS)
        for i, token in declared.items())


def _chat_templates(source: Path, config: dict[str, Any]) -> str | dict[str, str] | None:
    """The model's template (chat_template.jinja before tokenizer_config.json's), or its named
    templates."""
    jinja_file = source / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    named = config.get("chat_template")
    if isinstance(named, list):
        return {entry["name"]: entry["template"] for entry in named}
    return named


def _tag_final(messages: list[dict[str, Any]], template: str) -> tuple[str, list[dict[str, Any]]]:
    """The final message's text, and the messages with a tag after it, where the rendered text is
    to end (the rendering then leaves that message open)."""
    if "content" not in template:
        raise ValueError("continue_final_message: the chat template has no message content")
    messages = deepcopy(messages)
    content = messages[-1].get("content")
    if content is None:
        raise ValueError("continue_final_message: the final message has no content to continue")
    if isinstance(content, str):
        messages[-1]["content"] = content + _CONTINUE_TAG
        return content, messages
    for block in reversed(content):
        if "text" in block:
            final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return final, messages
    raise ValueError("continue_final_message: the final message has no text to continue")


def _cut_at_tag(text: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError("continue_final_message: the chat template drops part of the final "
                         "message, so it cannot be continued")
    at = text.rindex(tag)
    # A template that strips the message's end leaves no space after the tag: cut its spaces too.
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-token mask markers)
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[Any]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Not jinja's own tojson: that one escapes HTML characters.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
