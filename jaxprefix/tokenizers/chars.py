"""A character-level vocabulary for the built-in procedural tasks (a dozen or so symbols)."""
from __future__ import annotations

import re
from typing import Iterable, Sequence

from jaxprefix import storage
from jaxprefix.tokenizers.interface import Tokenizer

# The "chat template" of a character vocabulary: the contents, concatenated, with nothing between
# turns and no generation header. A task's prompt is the user content; an assistant prefix
# (continue_final_message) is simply appended to it.
CONCATENATE_CONTENTS = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# The file a character vocabulary is saved in, beside the model (CharTokenizer.save, tokenizers.load).
CHAR_VOCAB_FILE = "task_tokenizer.json"


class CharTokenizer(Tokenizer):
    """One token per character: id 0 = pad, 1 = eos, then `symbols` in order.

    Pad is id 0 because the sampler pads with 0. There is no BOS. The special-token strings
    (`pad`, `eos`) written in text encode to their ids.
    """

    def __init__(self, symbols: Iterable[str], eos: str = "<eos>", pad: str = "<pad>"):
        symbols = list(symbols)
        bad = [s for s in symbols if not isinstance(s, str) or len(s) != 1]
        if bad:
            raise ValueError(f"CharTokenizer: symbols must be single characters, got {bad!r}")
        if len(set(symbols)) != len(symbols):
            raise ValueError(f"CharTokenizer: repeated symbols in {''.join(symbols)!r}")
        if pad == eos or len(pad) < 2 or len(eos) < 2:
            raise ValueError(f"CharTokenizer: pad {pad!r} and eos {eos!r} must be distinct "
                             "multi-character strings (single characters are symbols)")
        self.symbols = "".join(symbols)
        self._pieces = [pad, eos, *symbols]
        self._ids = {piece: i for i, piece in enumerate(self._pieces)}
        self._special = re.compile("(" + "|".join(map(re.escape, (pad, eos))) + ")")
        self.vocab_size = len(self._pieces)
        self.pad_id, self.eos_id, self.bos_id = 0, 1, None
        self.special_tokens = {"pad_token": pad, "eos_token": eos}
        self.chat_template = CONCATENATE_CONTENTS
        self.source = f"CharTokenizer({self.symbols!r})"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = []
        for i, part in enumerate(self._special.split(text)):
            if i % 2:  # the separators re.split keeps: special-token strings
                ids.append(self._ids[part])
                continue
            for c in part:
                if c not in self._ids:
                    raise ValueError(f"{self.source}: character {c!r} is not in the vocabulary")
                ids.append(self._ids[c])
        return ids

    def to_json(self) -> dict:
        """What CHAR_VOCAB_FILE holds; `CharTokenizer(**d)` rebuilds the tokenizer."""
        return {"symbols": list(self.symbols), "eos": self._pieces[1], "pad": self._pieces[0]}

    def save(self, directory: str) -> None:
        storage.write_json(storage.join(directory, CHAR_VOCAB_FILE), self.to_json())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        out = []
        for i in (int(i) for i in ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"{self.source}: token id {i} outside [0, {self.vocab_size})")
            if i >= 2 or not skip_special_tokens:
                out.append(self._pieces[i])
        return "".join(out)
