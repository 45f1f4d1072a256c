"""From a list of contexts to bucketed, padded arrays for one prefill and one decode loop.

Each context is split into three parts so that shared work is done once:
  prompt   prefilled once per distinct prompt (the PrefixRL problem prompt several prefixes share);
  suffix   all but the context's last token after the prompt, prefilled on top of its prompt;
  last     the context's last token, held back and fed as the first decode step of every sample.
Holding the last token back means the prefill never needs logits (XLA drops the unembedding),
and every sample draws its first token the same way as all later ones.

Shapes are powers of two (with floors) so that a run compiles a handful of times.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence, Union

import numpy as np

MIN_CONTEXT_BUCKET = 16
MIN_NEW_TOKENS_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class SharedContext:
    """A context given as a prompt shared with other contexts plus its own suffix (e.g. a prefix)."""
    prompt: Sequence[int]
    suffix: Sequence[int] = ()


Context = Union[Sequence[int], SharedContext]


def token_ids(context: Context) -> list[int]:
    """A context's ids in order (a SharedContext's prompt, then its suffix)."""
    if isinstance(context, SharedContext):
        return [*map(int, context.prompt), *map(int, context.suffix)]
    return list(map(int, context))


def bucket(size: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(size, minimum)."""
    return 1 << max(0, math.ceil(math.log2(max(size, minimum, 1))))


@dataclasses.dataclass(frozen=True)
class ContextLayout:
    """Padded arrays for C contexts (padded to C_pad) over P distinct prompts (padded to P_pad).

    Positions are -1 on padding slots (empty KV slots). Padding contexts have `valid` False.
    """
    prompt_tokens: np.ndarray     # int32 [P_pad, Sp]
    prompt_positions: np.ndarray  # int32 [P_pad, Sp]
    prompt_index: np.ndarray      # int32 [C_pad]  which prompt each context continues
    suffix_tokens: np.ndarray     # int32 [C_pad, Ss]  (Ss = 0 when no context has a suffix)
    suffix_positions: np.ndarray  # int32 [C_pad, Ss]
    last_tokens: np.ndarray       # int32 [C_pad]
    last_positions: np.ndarray    # int32 [C_pad]
    valid: np.ndarray             # bool [C_pad]
    full_contexts: list           # list[list[int]], the C real contexts as flat token lists

    @property
    def num_contexts(self) -> int:
        return len(self.full_contexts)

    @property
    def prompts_are_contexts(self) -> bool:
        """True when prompt p belongs to context p alone, so no gather of prompt KV is needed."""
        return (self.prompt_tokens.shape[0] == self.valid.shape[0] and
                np.array_equal(self.prompt_index, np.arange(self.valid.shape[0])))


def _split(context: Context, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(prompt, suffix) with a non-empty suffix whose last token is the context's last token."""
    if isinstance(context, SharedContext):
        prompt, suffix = tuple(context.prompt), tuple(context.suffix)
    else:
        prompt, suffix = (), tuple(context)
    if not suffix:
        prompt, suffix = prompt[:-1], prompt[-1:]
    if not suffix:
        raise ValueError(f'{where} is empty: a context needs at least one token (e.g. BOS)')
    if not isinstance(context, SharedContext):
        # A plain context is its own prompt: prefilled once, shared by its n samples.
        prompt, suffix = suffix[:-1], suffix[-1:]
    return prompt, suffix


def _check_ids(tokens: Sequence[int], vocab_size: int, where: str) -> None:
    ids = np.asarray(tokens)
    if ids.size and (ids.dtype.kind not in 'iu' or ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f'{where} must hold integer token ids in [0, {vocab_size}), got '
                         f'{ids.dtype} values in [{ids.min()}, {ids.max()}]')


def layout_contexts(contexts: Sequence[Context], vocab_size: int,
                    context_multiple: int = 1) -> ContextLayout:
    """Splits, deduplicates prompts, pads and buckets `contexts`.

    `context_multiple`: the padded context count is also a multiple of this (so that rows divide
    evenly over data-parallel devices).
    """
    if isinstance(contexts, np.ndarray) and contexts.ndim == 2:
        contexts = list(contexts)  # a [C, S] array of equal-length contexts
    if isinstance(contexts, SharedContext) or not isinstance(contexts, Sequence) or not contexts:
        raise ValueError('contexts must be a non-empty list of token-id lists or SharedContext, got '
                         f'{type(contexts).__name__}')
    splits, full = [], []
    for i, context in enumerate(contexts):
        prompt, suffix = _split(context, f'contexts[{i}]')
        _check_ids(prompt + suffix, vocab_size, f'contexts[{i}]')
        splits.append((prompt, suffix))
        full.append([int(t) for t in prompt + suffix])

    prompt_ids: dict[tuple[int, ...], int] = {}
    for prompt, _ in splits:
        prompt_ids.setdefault(prompt, len(prompt_ids))
    num_c = len(splits)
    c_pad = bucket(num_c)
    c_pad = c_pad * context_multiple // math.gcd(c_pad, context_multiple)
    p_pad = bucket(len(prompt_ids))
    if len(prompt_ids) == num_c:
        p_pad = c_pad  # keeps the identity layout when no prompt is shared
    sp = bucket(max(len(p) for p in prompt_ids), MIN_CONTEXT_BUCKET)
    longest_suffix = max(len(s) - 1 for _, s in splits)
    ss = bucket(longest_suffix, MIN_CONTEXT_BUCKET) if longest_suffix else 0

    prompt_tokens = np.zeros((p_pad, sp), np.int32)
    prompt_positions = np.full((p_pad, sp), -1, np.int32)
    for prompt, p in prompt_ids.items():
        prompt_tokens[p, :len(prompt)] = prompt
        prompt_positions[p, :len(prompt)] = np.arange(len(prompt))
    prompt_index = np.arange(c_pad, dtype=np.int32) % p_pad
    suffix_tokens = np.zeros((c_pad, ss), np.int32)
    suffix_positions = np.full((c_pad, ss), -1, np.int32)
    last_tokens = np.zeros(c_pad, np.int32)
    last_positions = np.zeros(c_pad, np.int32)
    for c, (prompt, suffix) in enumerate(splits):
        prompt_index[c] = prompt_ids[prompt]
        body = suffix[:-1]
        suffix_tokens[c, :len(body)] = body
        suffix_positions[c, :len(body)] = len(prompt) + np.arange(len(body))
        last_tokens[c] = suffix[-1]
        last_positions[c] = len(prompt) + len(body)
    valid = np.arange(c_pad) < num_c
    return ContextLayout(prompt_tokens, prompt_positions, prompt_index, suffix_tokens,
                         suffix_positions, last_tokens, last_positions, valid, full)
