"""A SentencePiece tokenizer.model (Llama 2, Gemma, T5 style vocabularies) behind the interface."""
from __future__ import annotations

import os
from typing import Sequence

import sentencepiece

from jaxprefix import storage
from jaxprefix.tokenizers.interface import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """Encodes with the SentencePiece processor itself.

    `encode(add_special_tokens=True)` prepends BOS (as Llama-style tokenizers do). Control pieces
    (<s>, </s>) are rendered by `decode` unless skipped. `special_tokens` (from a
    tokenizer_config.json beside the model) override the model's own bos/eos/unk/pad pieces.
    """

    def __init__(self, model_file: str | os.PathLike, *,
                 special_tokens: dict[str, str] | None = None, chat_template: str | None = None):
        self.source = os.fspath(model_file)
        if not storage.isfile(self.source):
            raise FileNotFoundError(f"SentencePiece model not found: {self.source}")
        self.model_proto = storage.read_bytes(self.source)  # what save writes back
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=self.model_proto)
        except Exception as e:  # RuntimeError / OSError from the C++ parser
            raise ValueError(f"{self.source}: not a SentencePiece model ({e})") from e
        sp = self._sp
        own = {name: sp.id_to_piece(i) for name, i in (
            ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id()),
            ("pad_token", sp.pad_id())) if i >= 0}
        self.special_tokens = {**own, **(special_tokens or {})}
        ids = {name: self._id_of(name, piece) for name, piece in self.special_tokens.items()}
        if "eos_token" not in ids:
            raise ValueError(f"{self.source}: the SentencePiece model defines no eos piece")
        self.vocab_size = sp.get_piece_size()
        self.eos_id = ids["eos_token"]
        self.bos_id = ids.get("bos_token")
        self.pad_id = ids.get("pad_token", self.eos_id)
        self.chat_template = chat_template

    def _id_of(self, name: str, piece: str) -> int:
        i = self._sp.piece_to_id(piece)
        if self._sp.id_to_piece(i) != piece:  # unknown pieces map to unk
            raise ValueError(f"{self.source}: {name} {piece!r} is not in the vocabulary")
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = self._sp.encode(text)
        if add_special_tokens and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def save(self, directory: str) -> None:
        storage.write_atomic(storage.join(directory, "tokenizer.model"), self.model_proto)
        config = {"tokenizer_class": "LlamaTokenizer", **self.special_tokens}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        storage.write_json(storage.join(directory, "tokenizer_config.json"), config, indent=2)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        # The processor drops control pieces silently; decode the runs between them and put
        # the control pieces back unless asked to skip them.
        parts, run = [], []
        for i in (int(i) for i in ids):
            if self._sp.is_control(i):
                parts.append(self._sp.decode(run))
                run = []
                if not skip_special_tokens:
                    parts.append(self._sp.id_to_piece(i))
            else:
                run.append(i)
        parts.append(self._sp.decode(run))
        return "".join(parts)
