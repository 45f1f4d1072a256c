"""DAPO dynamic sampling: keep groups whose rewards differ, refill, lay the batch out.

A group whose n rewards are all equal has zero advantage under GRPO: it costs a train step and
teaches nothing. The loop samples further problems until `target` informative groups are
collected or `max_refills` extra rounds are spent; a batch still short is filled with dropped
groups whose loss mask is zeroed, so the learner's batch shape never changes (no recompiles).
"""
from __future__ import annotations

import dataclasses

import numpy as np


def informative(group_rewards: np.ndarray) -> np.ndarray:
    """bool [C]: groups whose rewards are not all equal."""
    group_rewards = np.asarray(group_rewards)
    return group_rewards.max(axis=1) != group_rewards.min(axis=1)


def needs_refill(group_rewards: list[np.ndarray], target: int, refills_done: int,
                 max_refills: int) -> bool:
    """Whether to sample another round: too few informative groups and refills left."""
    have = sum(int(informative(r).sum()) for r in group_rewards)
    return have < target and refills_done < max_refills


@dataclasses.dataclass(frozen=True)
class GroupSelection:
    """Which groups make up the learner batch, in order.

    picks: (chunk index, group index) per batch group, len == target.
    trainable: bool [target], False for filler groups (zero-variance, loss masked out).
    zero_variance_fraction: fraction of all sampled groups whose rewards were all equal.
    """
    picks: list[tuple[int, int]]
    trainable: np.ndarray
    zero_variance_fraction: float


def select_groups(group_rewards: list[np.ndarray], target: int,
                  drop_zero_variance: bool = True) -> GroupSelection:
    """Informative groups first (in sampling order), then fillers, `target` groups in all."""
    good, rest = [], []
    for chunk, rewards in enumerate(group_rewards):
        for group, ok in enumerate(informative(rewards)):
            (good if ok or not drop_zero_variance else rest).append((chunk, group))
    total = sum(len(r) for r in group_rewards)
    if total < target:
        raise ValueError(f"select_groups: {total} groups sampled, the batch needs {target}")
    picks = (good + rest)[:target]
    trainable = np.arange(target) < len(good)
    zero = sum(int((~informative(r)).sum()) for r in group_rewards)
    return GroupSelection(picks, trainable, zero / max(total, 1))


def bucket(width: int, minimum: int = 16) -> int:
    """The batch width for rows of up to `width` tokens: the next power of two, and above 2,048
    the next quarter step between two powers (2,560, 3,072, ..., 20,480, 24,576, ...). A run
    compiles the update for a handful of widths, and a long row pads by at most a quarter
    instead of almost half: 2k context + 16k new tokens train at 20,480 instead of 32,768 (the
    paper variant's update then fits v6e-8 with room to spare; docs/SCALING.md)."""
    power = max(minimum, 1 << max(0, int(width) - 1).bit_length())
    if power <= 2048:
        return power
    step = power // 8  # a quarter of the power below
    return -(-int(width) // step) * step


def build_batch(chunks, advantages, selection: GroupSelection, *, mask_truncated: bool = False,
                width: int | None = None) -> dict[str, np.ndarray]:
    """Learner batch from the selected groups of several `Rollouts` chunks.

    chunks: list of Rollouts; advantages: list of [C_i, n] arrays, one per chunk.
    Returns numpy arrays, rows group-major (n rows per picked group), width bucketed:
      tokens, positions int32 [B, L]; token_mask bool [B, L] (real tokens);
      completion_mask f32 [B, L] (loss mask); old_logprobs f32 [B, L]; advantages f32 [B];
      and routes [B, L, sparse layers, k] (-1 past each row) when the chunks recorded experts
      (a mixture of experts' routing replay), following their rows.
    """
    n = chunks[0].n
    rows = [(c, g * n + j) for c, g in selection.picks for j in range(n)]
    need = max(int(chunks[c].context_lengths[r] + chunks[c].lengths[r]) for c, r in rows)
    width = bucket(need) if width is None else width
    if width < need:
        raise ValueError(f"build_batch: width {width} is shorter than the longest row ({need})")
    batch = {
        "tokens": np.zeros((len(rows), width), np.int32),
        "positions": np.zeros((len(rows), width), np.int32),
        "token_mask": np.zeros((len(rows), width), bool),
        "completion_mask": np.zeros((len(rows), width), np.float32),
        "old_logprobs": np.zeros((len(rows), width), np.float32),
        "advantages": np.zeros((len(rows),), np.float32),
    }
    recorded = chunks[0].routes
    if recorded is not None:
        batch["routes"] = np.full((len(rows), width, *recorded.shape[2:]), -1, recorded.dtype)
    for i, (c, r) in enumerate(rows):
        ro = chunks[c]
        length = int(ro.context_lengths[r] + ro.lengths[r])
        batch["tokens"][i, :length] = ro.tokens[r, :length]
        batch["positions"][i, :length] = np.arange(length)
        batch["token_mask"][i, :length] = True
        keep = selection.trainable[i // n] and (ro.stopped[r] or not mask_truncated)
        batch["completion_mask"][i, :length] = ro.completion_mask[r, :length] * keep
        batch["old_logprobs"][i, :length] = ro.logprobs[r, :length]
        batch["advantages"][i] = advantages[c][r // n, r % n]
        if recorded is not None:
            batch["routes"][i, :length] = ro.routes[r, :length]
    return batch
