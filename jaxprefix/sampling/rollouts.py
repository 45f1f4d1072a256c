"""Rollouts: the sampler's output and the learner's input, as host-side numpy arrays.

Row layout: the n samples of context i are rows i*n .. i*n+n-1. Each row holds the context's
tokens, then the sampled completion, then padding (pad id 0). Only sampled tokens are trained on,
so `completion_mask` is 1 on completion tokens alone, never on context or prefix tokens.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """n sampled continuations of each of a list of contexts.

    Fields ([N] = len(contexts) * n rows, L = longest context + longest completion):
      tokens           int32 [N, L]  context, completion, then 0-padding
      positions        int32 [N, L]  0 .. len-1 on real tokens, 0 on padding
      completion_mask  int32 [N, L]  1 only on sampled tokens
      logprobs         f32 [N, L]    log-probability of each sampled token (0 elsewhere)
      context_lengths  int32 [N]
      lengths          int32 [N]     completion lengths (a sampled stop token counts)
      stopped          bool [N]      ended on a stop id (False: truncated at max_new_tokens)
      group_ids        int32 [N]     index of the context the row continues
      n                int           samples per context
      routes           int8 or int16 [N, L, sparse layers, k], or None: a mixture of experts'
                       experts of each token as the sampler computed them (generate's
                       record_routes; sampling/routes.py), -1 where none was (a row's last
                       token, padding)
    """
    tokens: np.ndarray
    positions: np.ndarray
    completion_mask: np.ndarray
    logprobs: np.ndarray
    context_lengths: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    group_ids: np.ndarray
    n: int
    routes: np.ndarray | None = None

    @classmethod
    def from_parts(cls, contexts: Sequence[Sequence[int]], completions: np.ndarray,
                   completion_logprobs: np.ndarray, lengths: np.ndarray, stopped: np.ndarray,
                   n: int, *, context_routes: Sequence[np.ndarray] | None = None,
                   row_routes: np.ndarray | None = None) -> 'Rollouts':
        """Lays out rows from contexts and per-sample completions.

        `completions` / `completion_logprobs` are [N, T] with the first lengths[row] entries valid;
        `stopped` [N]. Row i*n + j is sample j of contexts[i]. Recorded experts (a MoE):
        `context_routes[i]` [len(contexts[i]) - 1, ...] of each context's tokens but its last,
        `row_routes` [N, T, ...] of the token each row fed at each decode step (its context's
        last token, then its own).
        """
        num_rows = len(contexts) * n
        if completions.shape[0] != num_rows:
            raise ValueError(f'completions has {completions.shape[0]} rows, expected '
                             f'len(contexts) * n = {num_rows}')
        group_ids = np.repeat(np.arange(len(contexts), dtype=np.int32), n)
        context_lengths = np.array([len(contexts[g]) for g in group_ids], dtype=np.int32)
        lengths = np.asarray(lengths, dtype=np.int32)
        width = int((context_lengths + lengths).max(initial=1))
        tokens = np.zeros((num_rows, width), np.int32)
        completion_mask = np.zeros((num_rows, width), np.int32)
        logprobs = np.zeros((num_rows, width), np.float32)
        routes = None
        if row_routes is not None:
            routes = np.full((num_rows, width, *row_routes.shape[2:]), -1, row_routes.dtype)
        for row, g in enumerate(group_ids):
            start, length = context_lengths[row], lengths[row]
            tokens[row, :start] = contexts[g]
            tokens[row, start:start + length] = completions[row, :length]
            completion_mask[row, start:start + length] = 1
            logprobs[row, start:start + length] = completion_logprobs[row, :length]
            if routes is not None:
                routes[row, :start - 1] = context_routes[g]
                routes[row, start - 1:start - 1 + length] = row_routes[row, :length]
        columns = np.arange(width, dtype=np.int32)[None, :]
        positions = np.where(columns < (context_lengths + lengths)[:, None], columns, 0)
        return cls(tokens=tokens, positions=positions.astype(np.int32),
                   completion_mask=completion_mask, logprobs=logprobs,
                   context_lengths=context_lengths, lengths=lengths,
                   stopped=np.asarray(stopped, dtype=bool), group_ids=group_ids, n=n,
                   routes=routes)

    @property
    def num_samples(self) -> int:
        return self.tokens.shape[0]

    @property
    def token_mask(self) -> np.ndarray:
        """int32 [N, L]: 1 on context and completion tokens, 0 on padding."""
        columns = np.arange(self.tokens.shape[1])[None, :]
        return (columns < (self.context_lengths + self.lengths)[:, None]).astype(np.int32)

    @property
    def truncated(self) -> np.ndarray:
        return ~self.stopped

    def completions(self, keep_stop: bool = False) -> list[list[int]]:
        """The sampled token ids of each row, without the stop token that ended it (a row that
        stopped ends on one; `keep_stop` keeps it, as a trace to train on needs)."""
        return [self.tokens[row, start:start + length - (self.stopped[row] and not keep_stop)]
                .tolist()
                for row, (start, length) in enumerate(zip(self.context_lengths, self.lengths))]

    def completion_texts(self, tokenizer, keep_stop: bool = False) -> list[str]:
        """Decoded completions (without the stop token unless `keep_stop`); `tokenizer` needs a
        `decode(list[int]) -> str` method."""
        decode: Callable[[list[int]], str] = tokenizer.decode
        return [decode(ids) for ids in self.completions(keep_stop)]

    def grouped(self, values: np.ndarray) -> np.ndarray:
        """Reshapes a per-row array [N, ...] to [contexts, n, ...] (e.g. rewards for advantages)."""
        values = np.asarray(values)
        return values.reshape((self.num_samples // self.n, self.n) + values.shape[1:])
