"""A tokenizer rebuilt from a GGUF file's vocabulary metadata.

A GGUF carries no tokenizer.json; llama.cpp stores the pieces instead: `tokenizer.ggml.tokens`,
`.merges`, `.token_type` (3 = control, 4 = user-defined), the special ids, the name of the
pre-tokenizer (`tokenizer.ggml.pre`: how text is split before BPE) and the chat template. For
gpt2-style byte-level BPE vocabularies (SmolLM2, Llama 3, Qwen2, StarCoder) these are exactly the
parts of a `tokenizers` BPE model: the vocabulary is already spelled in the byte alphabet.
"""
from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

from jaxprefix.checkpoints.gguf import metadata_value, open_gguf
from jaxprefix.tokenizers.huggingface import HFTokenizer

_CONTROL, _USER_DEFINED = 3, 4

# Split patterns of llama.cpp's pre-tokenizer types (llama-vocab.cpp), as `tokenizers` regexes.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _gpt2():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2():
    # llama.cpp's smollm/starcoder/refact: every digit alone, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _split(pattern):
    return lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# 'default' (files older than the key) is read as GPT-2's split, as transformers reads it.
PRE_TOKENIZERS = {
    "default": _gpt2, "gpt2": _gpt2, "gpt-2": _gpt2,
    "smollm": _digits_then_gpt2, "starcoder": _digits_then_gpt2, "refact": _digits_then_gpt2,
    "llama-bpe": _split(_LLAMA3_SPLIT), "llama3": _split(_LLAMA3_SPLIT),
    "llama-v3": _split(_LLAMA3_SPLIT), "smaug-bpe": _split(_LLAMA3_SPLIT),
    "qwen2": _split(_QWEN2_SPLIT), "deepseek-r1-qwen": _split(_QWEN2_SPLIT),
}


def _special_token(tokens, reader, key):
    token_id = metadata_value(reader, f"tokenizer.ggml.{key}")
    return None if token_id is None else tokens[int(token_id)]


def load_gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata (byte-level BPE vocabularies)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    kind = metadata_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: GGUF tokenizer.ggml.model is {kind!r}; only byte-level BPE vocabularies "
            "('gpt2': SmolLM2, Llama 3, Qwen2) are rebuilt from GGUF. For a SentencePiece "
            "vocabulary load the model's tokenizer.model or tokenizer.json instead.")
    pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                         f"(expected one of {sorted(PRE_TOKENIZERS)})")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    merges = metadata_value(reader, "tokenizer.ggml.merges")
    if tokens is None or merges is None:
        raise ValueError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens or .merges")
    types = metadata_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)

    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) and user-defined ones (<think>) are matched whole in text.
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])

    special = {name: _special_token(tokens, reader, key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    bos = special["bos_token"]
    if metadata_value(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return HFTokenizer(backend, special_tokens=special,
                       chat_template=metadata_value(reader, "tokenizer.chat_template"), source=path)
