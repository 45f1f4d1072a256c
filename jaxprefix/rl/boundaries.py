"""Shapes and dtypes asserted (chex, on host arrays, outside jit) where arrays cross modules.

Between modules a wrong shape is otherwise silent: advantages of shape [C, n] broadcast against
[B] rows, a token id past the vocabulary gathers a clamped embedding row, a float mask indexes
nothing. Each check runs before the jitted call it guards and names the array that is off. A
failure is a bug in the code that built the arrays, so it is an AssertionError (main keeps its
traceback).

- contexts into the sampler (`check_contexts`, called by the loop and the prober),
- the sampler's Rollouts into the loop (`check_rollouts`; a MoE's recorded experts too),
- a learner batch into the update (`check_batch`).
"""
from __future__ import annotations

from collections.abc import Sequence

import chex
import numpy as np

from jaxprefix.sampling import token_ids


def _expect(where: str, name: str, array, shape, dtype) -> None:
    try:
        chex.assert_shape(array, shape)
        chex.assert_type(array, dtype)
    except AssertionError as e:
        raise AssertionError(f"{where}: {name}: {e}") from None


def check_contexts(contexts: Sequence, *, vocab_size: int, where: str = "contexts") -> None:
    """Every context (token ids, or a SharedContext's prompt + suffix) is non-empty and within
    [0, vocab_size)."""
    for i, context in enumerate(contexts):
        ids = token_ids(context)
        if not ids:
            raise AssertionError(f"{where}: context {i} is empty; expected at least one token")
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab_size:
            raise AssertionError(f"{where}: context {i} holds token id {high if high >= vocab_size else low}, "
                                 f"outside the model's vocabulary [0, {vocab_size})")


def check_rollouts(rollouts, *, contexts: int, n: int, where: str = "rollouts") -> None:
    """Rows [contexts * n, L]: tokens, masks and log-probs [N, L], per-row arrays [N]."""
    rows, width = contexts * n, rollouts.tokens.shape[-1]
    for name, dtype in (("tokens", np.int32), ("positions", np.int32),
                        ("completion_mask", np.int32), ("logprobs", np.float32)):
        _expect(where, name, getattr(rollouts, name), (rows, width), dtype)
    for name, dtype in (("context_lengths", np.int32), ("lengths", np.int32),
                        ("stopped", bool), ("group_ids", np.int32)):
        _expect(where, name, getattr(rollouts, name), (rows,), dtype)
    if rollouts.n != n:
        raise AssertionError(f"{where}: n={rollouts.n}, expected {n} samples per context")
    if rollouts.routes is not None:
        _expect_routes(where, rollouts.routes, rows, width)


def _expect_routes(where: str, routes, rows: int, width: int) -> None:
    """Recorded experts: integers [rows, width, sparse layers, k]."""
    try:
        chex.assert_shape(routes, (rows, width, None, None))
        chex.assert_type(routes, int)
    except AssertionError as e:
        raise AssertionError(f"{where}: routes: {e}") from None


def check_batch(batch: dict, *, where: str = "learner batch") -> None:
    """tokens, positions int32 [B, L]; token_mask bool [B, L]; completion_mask, old_logprobs
    (and ref_logprobs) f32 [B, L]; advantages f32 [B]; routes (routing replay) integers
    [B, L, sparse layers, k]."""
    rows, width = np.shape(batch["tokens"])
    expected = {"tokens": np.int32, "positions": np.int32, "token_mask": bool,
                "completion_mask": np.float32, "old_logprobs": np.float32}
    if "ref_logprobs" in batch:
        expected["ref_logprobs"] = np.float32
    for name, dtype in expected.items():
        _expect(where, name, batch[name], (rows, width), dtype)
    _expect(where, "advantages", batch["advantages"], (rows,), np.float32)
    if "routes" in batch:
        _expect_routes(where, batch["routes"], rows, width)
