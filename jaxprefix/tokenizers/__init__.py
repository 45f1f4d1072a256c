"""Tokenizers: one interface (`Tokenizer`) over HF tokenizer.json, SentencePiece, GGUF vocabularies
and character vocabularies, with the model's own Jinja chat template.

    tok = tokenizers.load("path/to/hf_dir" | "tokenizer.model" | "model.gguf")
    ids = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
"""
from __future__ import annotations

import os

from jaxprefix import storage
from jaxprefix.tokenizers.chars import CHAR_VOCAB_FILE, CONCATENATE_CONTENTS, CharTokenizer
from jaxprefix.tokenizers.gguf_vocab import load_gguf_tokenizer
from jaxprefix.tokenizers.huggingface import HFTokenizer, load_tokenizer_json, \
    read_tokenizer_config
from jaxprefix.tokenizers.interface import Tokenizer
from jaxprefix.tokenizers.sentencepiece_model import SentencePieceTokenizer

_EXPECTED = ("an HF tokenizer directory (tokenizer.json, or tokenizer.model, with "
             "tokenizer_config.json), a tokenizer.json, a SentencePiece .model file, "
             f"a .gguf file, or a directory with {CHAR_VOCAB_FILE} (a task's characters)")


def _sentencepiece(model_file: str) -> SentencePieceTokenizer:
    special, template = read_tokenizer_config(storage.dirname(model_file))
    return SentencePieceTokenizer(model_file, special_tokens=special, chat_template=template)


def load(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path` (local or gs://): an HF directory, tokenizer.json, tokenizer.model
    or GGUF file, or a directory holding a character vocabulary (CHAR_VOCAB_FILE)."""
    path = os.fspath(path)
    if storage.isdir(path):
        if storage.isfile(storage.join(path, "tokenizer.json")):
            return load_tokenizer_json(path)
        if storage.isfile(storage.join(path, "tokenizer.model")):
            return _sentencepiece(storage.join(path, "tokenizer.model"))
        if storage.isfile(storage.join(path, CHAR_VOCAB_FILE)):
            return CharTokenizer(**storage.read_json(storage.join(path, CHAR_VOCAB_FILE)))
        raise FileNotFoundError(f"{path}: no tokenizer.json, tokenizer.model or "
                                f"{CHAR_VOCAB_FILE} in this directory (expected {_EXPECTED})")
    if not storage.isfile(path):
        raise FileNotFoundError(f"tokenizer not found: {path} (expected {_EXPECTED})")
    with storage.open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return load_gguf_tokenizer(path)
    if storage.basename(path) == "tokenizer.json":
        return load_tokenizer_json(storage.dirname(path) or ".")
    if path.endswith(".model"):
        return _sentencepiece(path)
    raise ValueError(f"{path}: unknown tokenizer format (expected {_EXPECTED})")


__all__ = ["CHAR_VOCAB_FILE", "CONCATENATE_CONTENTS", "CharTokenizer", "HFTokenizer",
           "SentencePieceTokenizer", "Tokenizer", "load", "load_gguf_tokenizer"]
