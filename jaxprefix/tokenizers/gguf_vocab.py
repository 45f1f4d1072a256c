"""A tokenizer rebuilt from a GGUF file's vocabulary metadata.

A GGUF carries no tokenizer.json; llama.cpp stores the pieces instead: `tokenizer.ggml.tokens`,
`.merges`, `.token_type` (3 = control, 4 = user-defined), the special ids, the name of the
pre-tokenizer (`tokenizer.ggml.pre`: how text is split before BPE) and the chat template. For
gpt2-style byte-level BPE vocabularies (SmolLM2, Llama 3, Qwen2, StarCoder) these are exactly the
parts of a `tokenizers` BPE model: the vocabulary is already spelled in the byte alphabet.
SentencePiece BPE vocabularies ('llama': Llama 2, Mistral, TinyLlama) carry scores instead of
merges; the merges are recovered from the scores, with byte fallback for unknown characters.
"""
from __future__ import annotations

import os

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

from jaxprefix.checkpoints.gguf import metadata_value, open_gguf
from jaxprefix.tokenizers.huggingface import HFTokenizer

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

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


def _byte_level_bpe(reader, tokens: list[str], path: str) -> tokenizers.Tokenizer:
    pre = metadata_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported "
                         f"(expected one of {sorted(PRE_TOKENIZERS)})")
    merges = metadata_value(reader, "tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path}: GGUF metadata lacks tokenizer.ggml.merges")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]):
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces,
    ranked by the merged piece's score (SentencePiece merges the best-scoring pair first)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == _NORMAL}
    ranked = []
    for piece, i in ids.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def _sentencepiece_bpe(reader, tokens: list[str], path: str) -> tokenizers.Tokenizer:
    """Llama 2 / Mistral style: '▁' for spaces, a dummy-prefix space, bytes as <0xXX>."""
    scores = metadata_value(reader, "tokenizer.ggml.scores")
    types = metadata_value(reader, "tokenizer.ggml.token_type")
    if scores is None or types is None:
        raise ValueError(f"{path}: GGUF metadata lacks tokenizer.ggml.scores or .token_type")
    unk = metadata_value(reader, "tokenizer.ggml.unknown_token_id")
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(
        vocab, _merges_from_scores(tokens, scores, types), byte_fallback=True, fuse_unk=True,
        unk_token=None if unk is None else tokens[int(unk)]))
    dummy_prefix = metadata_value(reader, "tokenizer.ggml.add_space_prefix", True)
    space = [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁")] + space if dummy_prefix else space)
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else []))
    return backend


def load_gguf_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The tokenizer described by a GGUF file's metadata (byte-level or SentencePiece BPE)."""
    path = os.fspath(path)
    reader = open_gguf(path)
    kind = metadata_value(reader, "tokenizer.ggml.model")
    tokens = metadata_value(reader, "tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens")
    if kind == "gpt2":
        backend = _byte_level_bpe(reader, tokens, path)
    elif kind == "llama":
        backend = _sentencepiece_bpe(reader, tokens, path)
    else:
        raise ValueError(f"{path}: GGUF tokenizer.ggml.model {kind!r} is not supported (expected "
                         "'gpt2', byte-level BPE, or 'llama', SentencePiece BPE); load the "
                         "model's tokenizer.json or tokenizer.model instead")
    types = metadata_value(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)
    # Control tokens (<|im_end|>) and user-defined ones (<think>) are matched whole in text.
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                for t, k in zip(tokens, types) if k == _CONTROL])
    backend.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])

    special = {name: _special_token(tokens, reader, key) for name, key in (
        ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    bos = special["bos_token"]
    # llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
    add_bos = metadata_value(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))])
    return HFTokenizer(backend, special_tokens=special,
                       chat_template=metadata_value(reader, "tokenizer.chat_template"), source=path)
