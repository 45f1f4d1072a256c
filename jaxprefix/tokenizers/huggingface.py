"""Tokenizers backed by the `tokenizers` library: an HF directory's tokenizer.json, plus the
special tokens and chat template of its JSON/Jinja files. (gguf_vocab.py builds the same object
from a GGUF vocabulary.)"""
from __future__ import annotations

import json
from typing import Sequence

import tokenizers

from jaxprefix import storage
from jaxprefix.tokenizers.interface import Tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` with the special tokens and chat template of its model."""

    def __init__(self, backend: tokenizers.Tokenizer, *, special_tokens: dict[str, str],
                 chat_template: str | None, source: str):
        self.backend = backend
        self.source = source
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in special_tokens.items() if v is not None}
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        ids = {name: self._id_of(name, token) for name, token in self.special_tokens.items()}
        if "eos_token" not in ids:
            raise ValueError(f"{source}: no eos_token (expected one in tokenizer_config.json, "
                             "special_tokens_map.json or GGUF tokenizer.ggml.eos_token_id)")
        self.eos_id = ids["eos_token"]
        self.bos_id = ids.get("bos_token")
        self.pad_id = ids.get("pad_token", self.eos_id)

    def _id_of(self, name: str, token: str) -> int:
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.source}: {name} {token!r} is not in the vocabulary")
        return token_id

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def save(self, directory: str) -> None:
        """tokenizer.json, tokenizer_config.json (special tokens) and chat_template.jinja, as
        transformers writes them: `load_tokenizer_json` and transformers read them back."""
        storage.write_atomic(storage.join(directory, "tokenizer.json"), self.backend.to_str())
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        storage.write_json(storage.join(directory, "tokenizer_config.json"), config, indent=2)
        if self.chat_template:
            storage.write_atomic(storage.join(directory, "chat_template.jinja"),
                                 self.chat_template)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def _read_json(path: str) -> dict:
    try:
        return json.loads(storage.read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON ({e})") from e


def _token_string(value, where: str) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or {'content': ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a token string or {{'content': str}}, got {value!r}")


def _pick_template(value, where: str) -> str | None:
    # A list of named templates (tool use, RAG, ...): the chat one is called 'default'.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
    raise ValueError(f"{where}: chat_template must be a string or a list with a 'default' entry")


def read_tokenizer_config(directory: str) -> tuple[dict[str, str], str | None]:
    """(special tokens by name, chat template) from an HF tokenizer directory's JSON/Jinja files."""
    config_path = storage.join(directory, "tokenizer_config.json")
    map_path = storage.join(directory, "special_tokens_map.json")
    config = _read_json(config_path) if storage.isfile(config_path) else {}
    special_map = _read_json(map_path) if storage.isfile(map_path) else {}
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        where = config_path if name in config else map_path
        token = _token_string(config.get(name, special_map.get(name)), f"{where} field {name!r}")
        if token is not None:
            special[name] = token
    # Newer transformers save the template beside the config; it then takes precedence.
    jinja_path = storage.join(directory, "chat_template.jinja")
    json_path = storage.join(directory, "chat_template.json")
    if storage.isfile(jinja_path):
        template = storage.read_text(jinja_path)
    elif storage.isfile(json_path):
        template = _pick_template(_read_json(json_path).get("chat_template"), json_path)
    else:
        template = _pick_template(config.get("chat_template"), config_path)
    return special, template


def load_tokenizer_json(directory: str) -> HFTokenizer:
    """The tokenizer of an HF directory holding tokenizer.json."""
    path = storage.join(directory, "tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_str(storage.read_text(path))
    except Exception as e:  # the Rust side raises a bare Exception on malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
    special, template = read_tokenizer_config(directory)
    return HFTokenizer(backend, special_tokens=special, chat_template=template, source=directory)
