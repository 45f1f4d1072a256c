"""Tokenizers: one interface (`Tokenizer`) over HF tokenizer.json, SentencePiece, GGUF vocabularies
and character vocabularies, with the model's own Jinja chat template.

    tok = tokenizers.load("path/to/hf_dir" | "tokenizer.model" | "model.gguf")
    ids = tok.apply_chat_template(messages, continue_final_message=True, tokenize=True)
"""
from __future__ import annotations

import os

from jaxprefix.tokenizers.chars import CONCATENATE_CONTENTS, CharTokenizer
from jaxprefix.tokenizers.gguf_vocab import load_gguf_tokenizer
from jaxprefix.tokenizers.huggingface import HFTokenizer, load_tokenizer_json, read_tokenizer_config
from jaxprefix.tokenizers.interface import Tokenizer
from jaxprefix.tokenizers.sentencepiece_model import SentencePieceTokenizer

_EXPECTED = ("an HF tokenizer directory (tokenizer.json, or tokenizer.model, with "
             "tokenizer_config.json), a tokenizer.json, a SentencePiece .model file, "
             "or a .gguf file")


def _sentencepiece(model_file: str) -> SentencePieceTokenizer:
    special, template = read_tokenizer_config(os.path.dirname(model_file))
    return SentencePieceTokenizer(model_file, special_tokens=special, chat_template=template)


def load(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: an HF directory, tokenizer.json, tokenizer.model or GGUF file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return load_tokenizer_json(path)
        if os.path.isfile(os.path.join(path, "tokenizer.model")):
            return _sentencepiece(os.path.join(path, "tokenizer.model"))
        raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model in this directory "
                                f"(expected {_EXPECTED})")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"tokenizer not found: {path} (expected {_EXPECTED})")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return load_gguf_tokenizer(path)
    if os.path.basename(path) == "tokenizer.json":
        return load_tokenizer_json(os.path.dirname(path) or ".")
    if path.endswith(".model"):
        return _sentencepiece(path)
    raise ValueError(f"{path}: unknown tokenizer format (expected {_EXPECTED})")


__all__ = ["CONCATENATE_CONTENTS", "CharTokenizer", "HFTokenizer", "SentencePieceTokenizer",
           "Tokenizer", "load", "load_gguf_tokenizer"]
