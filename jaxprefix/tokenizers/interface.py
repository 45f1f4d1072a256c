"""The one tokenizer interface the rest of the library uses, whatever the vocabulary's origin."""
from __future__ import annotations

import abc
from typing import Sequence

from jaxprefix.tokenizers import chat_template


class Tokenizer(abc.ABC):
    """Text <-> token ids, special-token ids and the model's chat template.

    Subclasses set `vocab_size`, `bos_id` (None when the vocabulary has none), `eos_id`, `pad_id`
    (the pad token, or EOS when there is none), `chat_template` (Jinja source or None),
    `special_tokens` (name -> string, e.g. {'eos_token': '<|im_end|>'}, visible to the template)
    and `source` (where it was loaded from, for error messages).
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int
    chat_template: str | None
    special_tokens: dict[str, str]
    source: str

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids.

        `add_special_tokens` adds what the tokenizer adds around a sequence (e.g. Llama 3's BOS).
        """

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; with `skip_special_tokens` special tokens are left out."""

    @abc.abstractmethod
    def save(self, directory: str) -> None:
        """Writes this tokenizer's files into an HF model directory (local or gs://), so that
        `tokenizers.load` (and, except for a character vocabulary, transformers) reads the same
        tokenizer back."""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tokenize: bool = False,
                            tools: list[dict] | None = None):
        """The model's chat template applied to `messages` (dicts with 'role' and 'content').

        `add_generation_prompt` appends the header of a new assistant turn.
        `continue_final_message` instead leaves the final message open (no end-of-turn markup) so
        the model continues it; it overrides `add_generation_prompt`. With `tokenize` returns ids
        (special tokens not added again, as in transformers), else the text. `tools`: function
        schemas the template lists (tools.Registry.schemas()), where it has a tool section.
        """
        if self.chat_template is None:
            raise ValueError(f"{self.source}: this tokenizer has no chat template (expected "
                             "tokenizer_config.json 'chat_template', a chat_template.jinja file, "
                             "or GGUF tokenizer.chat_template)")
        text = chat_template.render(
            self.chat_template, messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, tools=tools, **self.special_tokens)
        return self.encode(text) if tokenize else text

    def __repr__(self):
        return (f"{type(self).__name__}(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"bos_id={self.bos_id}, eos_id={self.eos_id}, pad_id={self.pad_id})")
