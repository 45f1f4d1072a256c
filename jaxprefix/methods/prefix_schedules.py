"""Prefix-length schedules shared by POPE and PrefixRL.

A method owns the prefix of each problem (POPE: the shortest solvable oracle prefix; PrefixRL:
a cut point of a successful trace) and asks its schedule how much of it to show now:

    length = schedule.length(key, base, step)   # 0 <= length <= base
    schedule.observe(keys, rewards)             # rewards [C, n] of the prefixed contexts

`key` names one prefix (a problem id, or `f'{id}/{cut}'` when a problem has several); `base` is
its full length and `step` the RL step. Units are whatever the method counts (solution steps or
tokens). `state()` returns a JSON-serialisable dict for checkpoints, `restore(state)` takes it
back.
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np


def _check_base(base: int) -> int:
    if int(base) != base or base < 0:
        raise ValueError(f'prefix schedule: base length must be an integer >= 0, got {base!r}')
    return int(base)


def _check_state(state: Mapping, kind: str):
    if state.get('kind') != kind:
        raise ValueError(f'{kind} prefix schedule: cannot restore a state of kind '
                         f'{state.get("kind")!r}')


class _StepOnly:
    """A schedule that depends on the step alone: it learns nothing and its state is its kind."""

    kind = ''

    def observe(self, keys: Sequence[str], rewards):
        pass

    def state(self) -> dict:
        return {'kind': self.kind}

    def restore(self, state: Mapping):
        _check_state(state, self.kind)


class FixedPrefix(_StepOnly):
    """The mined / cut prefix as is (POPE's and PrefixRL's default)."""

    kind = 'fixed'

    def length(self, key: str, base: int, step: int = 0) -> int:
        return _check_base(base)



class AnnealedPrefix(_StepOnly):
    """Keep a fraction of each prefix that moves from `start_fraction` to `end_fraction` over
    `steps` RL steps (linearly or along a half cosine), then stays at `end_fraction`.

    A function of the step alone, so its state is empty: resuming at step s resumes the schedule.
    """

    kind = 'annealed'

    def __init__(self, steps: int, start_fraction: float = 1.0, end_fraction: float = 0.0,
                 shape: str = 'linear'):
        if steps < 1:
            raise ValueError(f'annealed prefix schedule: steps must be >= 1, got {steps!r}')
        for name, f in (('start_fraction', start_fraction), ('end_fraction', end_fraction)):
            if not 0.0 <= f <= 1.0:
                raise ValueError(f'annealed prefix schedule: {name} must be in [0, 1], got {f!r}')
        if shape not in ('linear', 'cosine'):
            raise ValueError(f"annealed prefix schedule: shape must be 'linear' or 'cosine', "
                             f'got {shape!r}')
        self.steps, self.shape = int(steps), shape
        self.start_fraction, self.end_fraction = float(start_fraction), float(end_fraction)

    def fraction(self, step: int) -> float:
        t = min(max(step / self.steps, 0.0), 1.0)
        if self.shape == 'cosine':
            t = 0.5 * (1.0 - math.cos(math.pi * t))
        return self.start_fraction + (self.end_fraction - self.start_fraction) * t

    def length(self, key: str, base: int, step: int = 0) -> int:
        base = _check_base(base)
        # Round half up; the 1e-9 keeps exact halves like 10 * 0.35 from falling below .5 in floats.
        return min(base, math.floor(base * self.fraction(step) + 0.5 + 1e-9))



class AdaptivePrefix:
    """Per prefix: once its success rate over the last `window` prefixed rollouts reaches
    `threshold`, show `stride` units less (never below 0); with `lengthen`, show `stride` units
    more (never above the base) once that window holds no success at all.

    A rollout succeeds when its reward >= `success_reward`. After each change the window starts
    afresh, so every length is judged on rollouts sampled with it.
    """

    kind = 'adaptive'

    def __init__(self, window: int = 16, threshold: float = 0.5, stride: int = 1,
                 lengthen: bool = False, success_reward: float = 1.0):
        if window < 1 or stride < 1:
            raise ValueError(f'adaptive prefix schedule: window and stride must be >= 1, '
                             f'got window={window!r}, stride={stride!r}')
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f'adaptive prefix schedule: threshold must be in (0, 1], got {threshold!r}')
        self.window, self.threshold, self.stride = int(window), float(threshold), int(stride)
        self.lengthen, self.success_reward = bool(lengthen), float(success_reward)
        self._base: dict[str, int] = {}      # full prefix length, learnt from length()
        self._removed: dict[str, int] = {}   # units taken off the base
        self._outcomes: dict[str, list[int]] = {}  # 0/1 outcomes at the current length

    def length(self, key: str, base: int, step: int = 0) -> int:
        base = _check_base(base)
        self._base[key] = base
        return max(base - self._removed.get(key, 0), 0)

    def observe(self, keys: Sequence[str], rewards):
        rewards = np.asarray(rewards, dtype=np.float64)
        if rewards.ndim != 2 or rewards.shape[0] != len(keys):
            raise ValueError(f'adaptive prefix schedule: rewards must be [len(keys)={len(keys)}, n], '
                             f'got shape {rewards.shape}')
        for key, row in zip(keys, rewards):
            if key not in self._base:
                raise ValueError(f'adaptive prefix schedule: observe() got key {key!r} that length() '
                                 f'never saw')
            outcomes = self._outcomes.setdefault(key, [])
            outcomes.extend((row >= self.success_reward).astype(int).tolist())
            if len(outcomes) < self.window:
                continue
            del outcomes[:-self.window]  # slide: keep only the last `window`
            rate = sum(outcomes) / self.window
            removed, base = self._removed.get(key, 0), self._base[key]
            if rate >= self.threshold and removed < base:
                self._removed[key] = min(removed + self.stride, base)
                outcomes.clear()
            elif self.lengthen and rate == 0.0 and removed > 0:
                self._removed[key] = max(removed - self.stride, 0)
                outcomes.clear()

    def state(self) -> dict:
        return {'kind': self.kind, 'base': dict(self._base), 'removed': dict(self._removed),
                'outcomes': {k: list(v) for k, v in self._outcomes.items()}}

    def restore(self, state: Mapping):
        _check_state(state, self.kind)
        self._base = {str(k): int(v) for k, v in state['base'].items()}
        self._removed = {str(k): int(v) for k, v in state['removed'].items()}
        self._outcomes = {str(k): [int(o) for o in v] for k, v in state['outcomes'].items()}


PREFIX_SCHEDULES = {cls.kind: cls for cls in (FixedPrefix, AnnealedPrefix, AdaptivePrefix)}


def make_prefix_schedule(config: Mapping | None):
    """A schedule from a config section: `kind` in PREFIX_SCHEDULES plus that class's fields, e.g.
    {'kind': 'annealed', 'steps': 200, 'shape': 'cosine'}. None or {} gives FixedPrefix."""
    fields = dict(config.to_dict() if hasattr(config, 'to_dict') else (config or {}))
    kind = fields.pop('kind', 'fixed')
    if kind not in PREFIX_SCHEDULES:
        raise ValueError(f'prefix schedule: kind must be one of {sorted(PREFIX_SCHEDULES)}, got {kind!r}')
    try:
        return PREFIX_SCHEDULES[kind](**fields)
    except TypeError as e:
        raise ValueError(f'prefix schedule {kind!r}: bad fields {sorted(fields)} ({e})') from None


def schedule_settings(config) -> tuple:
    """config.schedule checked once: (('kind', k), (field, v), ...) of the chosen kind, hashable;
    `make_prefix_schedule(dict(settings))` makes a fresh one for each run (it learns as it goes)."""
    kind = config.schedule.kind
    settings = (("kind", kind), *sorted(dict(config.schedule.get(kind, {})).items()))
    make_prefix_schedule(dict(settings))  # raises naming the schedule's field
    return settings
