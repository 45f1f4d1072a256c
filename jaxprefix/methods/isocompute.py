"""IsoCompute: account sampling compute, allocate it over (n, B, M), fit the compute frontier.

Following the IsoCompute Playbook (arXiv 2603.12151), the sampling budget of an RL run is
C = B * n * M rollouts: B problems per batch, n rollouts per problem, M update steps. The paper's
rule is to choose n from the budget first (the optimal n* grows with C as a sigmoid in log C,
then saturates), hold B at a moderate constant and give the rest of the budget to M.

Everything here is plain numpy and Python (no jit): the run's ledger, the allocation rule, the
sweep grid and the frontier fit that turns a sweep's eval curves into a fitted n*(C). Compute is
measured in log2 of rollouts throughout the fit.
"""
from __future__ import annotations

import dataclasses
import math
import shlex
from typing import Iterable, Mapping, Sequence

import numpy as np

from jaxprefix import storage

# ---------------------------------------------------------------------------------------------
# Compute accounting
# ---------------------------------------------------------------------------------------------


def rollouts(batch: int, n: int, steps: int) -> int:
    """C = B * n * M: rollouts sampled by a run of `steps` updates on `batch` problems x `n`."""
    return int(batch) * int(n) * int(steps)


# ---------------------------------------------------------------------------------------------
# Sigmoids: the shape of reward(log C) and of log2 n*(log C)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sigmoid:
    """y = floor + (ceiling - floor) * sigmoid((x - center) / width); monotone for width > 0:
    rising when ceiling > floor, falling when ceiling < floor."""

    floor: float
    ceiling: float
    center: float
    width: float

    def __call__(self, x):
        z = (np.asarray(x, dtype=np.float64) - self.center) / self.width
        return self.floor + (self.ceiling - self.floor) * _logistic(z)

    def to_dict(self) -> dict:
        return {k: float(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping) -> 'Sigmoid':
        return cls(**{f.name: float(d[f.name]) for f in dataclasses.fields(cls)})


def _logistic(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # overflow-free form of 1 / (1 + exp(-z))


def fit_sigmoid(x: Sequence[float], y: Sequence[float], *,
                bounds: tuple[float, float] | None = None, rising_only: bool = True) -> Sigmoid:
    """Least-squares monotone sigmoid through (x, y): non-decreasing (`rising_only`, a reward
    against compute), or rising or falling, whichever fits (log2 n* against compute: the data
    decide its direction).

    Variable projection: for each (center, width) on a grid, floor and span have a closed-form
    least-squares solution (with `rising_only` the span is clipped to >= 0, so the curve never
    decreases); the best grid cell is refined by zooming in. Deterministic and numpy only.
    `bounds` (e.g. (0, 1) for a reward) clip floor and ceiling.
    """
    x = np.asarray(x, dtype=np.float64).ravel()
    y = np.asarray(y, dtype=np.float64).ravel()
    if x.shape != y.shape:
        raise ValueError(f'fit_sigmoid: x and y must have the same length, got {x.size} and {y.size}')
    if np.unique(x).size < 2 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError(f'fit_sigmoid: need finite values at >= 2 distinct x, got x={x.tolist()}')
    span_x = float(x.max() - x.min())
    centers = np.linspace(x.min() - span_x, x.max() + span_x, 61)
    log_widths = np.linspace(np.log(span_x / 200), np.log(span_x * 2), 41)
    for _ in range(4):
        best = _best_on_grid(x, y, centers, np.exp(log_widths), bounds, rising_only)
        dc, dw = centers[1] - centers[0], log_widths[1] - log_widths[0]
        centers = np.linspace(best[2] - 2 * dc, best[2] + 2 * dc, 21)
        log_widths = np.linspace(np.log(best[3]) - 2 * dw, np.log(best[3]) + 2 * dw, 21)
    return Sigmoid(*map(float, best))


def _best_on_grid(x, y, centers, widths, bounds, rising_only):
    s = _logistic((x[None, None, :] - centers[:, None, None]) / widths[None, :, None])  # [C, W, P]
    s_mean, y_mean = s.mean(-1, keepdims=True), y.mean()
    var = ((s - s_mean) ** 2).sum(-1)
    cov = ((s - s_mean) * (y - y_mean)).sum(-1)
    span = np.where(var > 1e-12, cov / np.maximum(var, 1e-12), 0.0)
    if rising_only:
        span = span.clip(min=0.0)
    floor = y_mean - span * s_mean[..., 0]
    ceiling = floor + span
    if bounds is not None:
        floor, ceiling = floor.clip(*bounds), ceiling.clip(*bounds)
        if rising_only:
            ceiling = np.maximum(ceiling, floor)
    pred = floor[..., None] + (ceiling - floor)[..., None] * s
    sse = ((pred - y) ** 2).sum(-1)
    i, j = np.unravel_index(np.argmin(sse), sse.shape)
    return floor[i, j], ceiling[i, j], centers[i], widths[j]


# ---------------------------------------------------------------------------------------------
# Allocation rule
# ---------------------------------------------------------------------------------------------

# log2 n*(log2 C) before a sweep of one's own: n from 4 rising to the paper's hard-set saturation
# of 128 (Qwen2.5-7B), halfway at C = 2^15 rollouts. Placeholders: refit with fit_frontier.
DEFAULT_N_CURVE = Sigmoid(floor=2.0, ceiling=7.0, center=15.0, width=2.0)


@dataclasses.dataclass(frozen=True)
class Allocation:
    n: int      # rollouts per problem
    batch: int  # problems per batch (B_p)
    steps: int  # update steps (M)

    @property
    def rollouts(self) -> int:
        return rollouts(self.batch, self.n, self.steps)


def allocate(budget_rollouts: int, *, n_curve: Sigmoid = DEFAULT_N_CURVE, batch: int = 64,
             n_min: int = 2, n_max: int = 1024) -> Allocation:
    """Split a budget of rollouts into (n, B, M) with n * B * M <= budget.

    n = 2^round(n_curve(log2 budget)) clipped to [n_min, n_max] (powers of two) and to the budget;
    B = `batch` (the paper: anything in 32..1024 works; use a higher one on hard sets), cut to
    what the budget allows; M = the rest, at least 1.
    """
    budget = int(budget_rollouts)
    if budget < 1:
        raise ValueError(f'allocate: budget_rollouts must be >= 1, got {budget_rollouts!r}')
    if batch < 1 or not 1 <= n_min <= n_max:
        raise ValueError(f'allocate: need batch >= 1 and 1 <= n_min <= n_max, got batch={batch}, '
                         f'n_min={n_min}, n_max={n_max}')
    lo, hi = math.ceil(math.log2(n_min)), math.floor(math.log2(n_max))
    if budget < 2 ** lo or lo > hi:
        raise ValueError(f'allocate: budget {budget} rollouts cannot fit n_min={n_min} '
                         f'(n is a power of two in [n_min, n_max={n_max}])')
    log2_n = min(max(round(float(n_curve(math.log2(budget)))), lo), hi)
    n = min(2 ** log2_n, 2 ** math.floor(math.log2(budget)))  # a tiny budget caps n too
    b = max(1, min(int(batch), budget // n))
    return Allocation(n=n, batch=b, steps=max(1, budget // (n * b)))


def allocation_rule(fit: 'FrontierFit', runs: Sequence['Run']) -> dict:
    """What a config needs to allocate by a fitted frontier: log2 n*(log2 C) as a sigmoid (flat at
    the envelope's last n* when n* never changed over the sweep) and the B that reached the best
    final reward among the runs at that n."""
    if fit.n_star_fit is not None:
        curve = fit.n_star_fit
    else:
        log_n = math.log2(fit.n_star[-1])
        curve = Sigmoid(floor=log_n, ceiling=log_n, center=fit.log_c[-1], width=1.0)
    n_top = 2 ** round(float(curve(fit.log_c[-1])))
    at_n = [r for r in runs if r.n == n_top] or list(runs)
    best = max(at_n, key=lambda r: r.reward[-1])
    return {'n_curve': curve.to_dict(), 'batch': int(best.batch)}


LR_RULES = ('constant', 'sqrt', 'linear')


def scaled_lr(batch_rollouts: int, *, base_lr: float = 1e-6, base_batch: int = 1024,
              rule: str = 'sqrt') -> float:
    """The learning rate for `batch_rollouts` rollouts per step (n * B_p): base_lr at base_batch,
    scaled by (batch / base_batch)^(0, 1/2, 1) for rule constant / sqrt (the IsoCompute paper's:
    1e-6 at 1024, by sqrt(B)) / linear."""
    if rule not in LR_RULES:
        raise ValueError(f'learning-rate rule must be one of {LR_RULES}, got {rule!r}')
    power = {'constant': 0.0, 'sqrt': 0.5, 'linear': 1.0}[rule]
    return base_lr * (batch_rollouts / base_batch) ** power


# ---------------------------------------------------------------------------------------------
# Sweep
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    budget: int
    n: int
    batch: int
    steps: int


def sweep_grid(budgets: Iterable[int], ns: Iterable[int], batches: Iterable[int], *,
               longest_only: bool = False) -> list[SweepPoint]:
    """Every (n, B) at every budget with M = budget // (n B) >= 1.

    A run's eval curve already covers every smaller budget on its way, so `longest_only` keeps
    only the largest budget of each (n, B): the cheapest sweep that still traces the frontier.
    """
    points = [SweepPoint(int(c), int(n), int(b), int(c) // (int(n) * int(b)))
              for c in sorted(budgets) for n in sorted(ns) for b in sorted(batches)
              if int(c) // (int(n) * int(b)) >= 1]
    if longest_only:
        last = {(p.n, p.batch): p for p in points}
        points = [p for p in points if last[(p.n, p.batch)] is p]
    return points


def run_command(config_arg: str, overrides: Mapping[str, object], workdir: str) -> str:
    """The shell command of one run: `--config=config_arg`, then `--config.<field>=<value>` for
    each override (dotted field names; tuples as (a,b), which the config flags parse back)."""
    def value(v):
        if isinstance(v, (tuple, list)):
            return '(' + ','.join(map(str, v)) + (',)' if len(v) == 1 else ')')
        return str(v)
    args = [f'--config={config_arg}'] + [f'--config.{k}={value(v)}' for k, v in overrides.items()]
    return ' '.join(['python', '-m', 'jaxprefix.main', *map(shlex.quote, args),
                     shlex.quote(f'--workdir={workdir}')])


# ---------------------------------------------------------------------------------------------
# Frontier fit
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Run:
    """One sweep run's eval curve: reward (e.g. avg@4) after `compute` rollouts."""

    n: int
    batch: int
    compute: tuple[float, ...]
    reward: tuple[float, ...]

    @classmethod
    def from_dict(cls, d: Mapping) -> 'Run':
        missing = {'n', 'batch', 'compute', 'reward'} - set(d)
        if missing:
            raise ValueError(f'Run: missing fields {sorted(missing)} in {sorted(d)}')
        if len(d['compute']) != len(d['reward']):
            raise ValueError(f'Run n={d["n"]} batch={d["batch"]}: compute and reward differ in length')
        return cls(int(d['n']), int(d['batch']), tuple(map(float, d['compute'])),
                   tuple(map(float, d['reward'])))


def record_breaking(curve: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (compute, reward) points whose reward beats every point at lower compute."""
    kept, best = [], -math.inf
    for c, r in sorted(curve, key=lambda p: p[0]):
        if r > best:
            kept.append((float(c), float(r)))
            best = r
    return kept


def upper_envelope(fits: Mapping[int, Sigmoid], log_c: Sequence[float]):
    """(best reward, argmax n) over the per-n fits at each log2 C."""
    ns = sorted(fits)
    values = np.stack([fits[n](log_c) for n in ns])  # [len(ns), len(log_c)]
    best = values.argmax(0)
    return values.max(0), np.asarray(ns)[best]


def fit_n_star(log_c: Sequence[float], n_star: Sequence[int]) -> Sigmoid:
    """log2 n* as a monotone sigmoid in log2 C, rising or falling: the paper's n* rises with
    the budget, then saturates, but nothing makes a sweep's do the same (this repo's fell)."""
    return fit_sigmoid(log_c, np.log2(np.asarray(n_star, dtype=np.float64)), rising_only=False)


def n_star_span(fit: 'FrontierFit') -> float:
    """How far the fitted log2 n* moves over the fit's budgets (last minus first): > 0 n* rises
    with the budget, < 0 it falls, 0 it never changes (no fit)."""
    if fit.n_star_fit is None:
        return 0.0
    return float(fit.n_star_fit(fit.log_c[-1]) - fit.n_star_fit(fit.log_c[0]))


@dataclasses.dataclass(frozen=True)
class FrontierFit:
    points: dict[int, list[tuple[float, float]]]  # n -> record-breaking (log2 C, reward)
    per_n: dict[int, Sigmoid]                     # n -> reward(log2 C)
    log_c: list[float]                            # grid of the envelope
    envelope: list[float]
    n_star: list[int]
    n_star_fit: Sigmoid | None                    # log2 n*(log2 C); None if n* never changes

    def to_dict(self) -> dict:
        return {'points': {str(n): [list(p) for p in v] for n, v in self.points.items()},
                'per_n': {str(n): s.to_dict() for n, s in self.per_n.items()},
                'log_c': list(self.log_c), 'envelope': list(self.envelope),
                'n_star': list(self.n_star),
                'n_star_fit': self.n_star_fit.to_dict() if self.n_star_fit else None}

    @classmethod
    def from_dict(cls, d: Mapping) -> 'FrontierFit':
        return cls(points={int(n): [tuple(p) for p in v] for n, v in d['points'].items()},
                   per_n={int(n): Sigmoid.from_dict(s) for n, s in d['per_n'].items()},
                   log_c=list(d['log_c']), envelope=list(d['envelope']), n_star=list(d['n_star']),
                   n_star_fit=Sigmoid.from_dict(d['n_star_fit']) if d['n_star_fit'] else None)


def fit_frontier(runs: Iterable[Run | Mapping], *, grid_size: int = 64,
                 reward_bounds: tuple[float, float] = (0.0, 1.0)) -> FrontierFit:
    """Sweep runs -> per-n reward sigmoids, their upper envelope, and the fitted n*(C).

    Per run keep the record-breaking points; per n pool them over B and keep the record-breaking
    ones of the pool (the best B at each compute); fit reward(log2 C) per n; the envelope over n
    on a grid spanning the data gives n*(C), fitted as a sigmoid in log2 space.
    """
    pooled: dict[int, list] = {}
    for run in runs:
        run = run if isinstance(run, Run) else Run.from_dict(run)
        if min(run.compute, default=1) <= 0:
            raise ValueError(f'fit_frontier: run n={run.n} batch={run.batch} has compute <= 0')
        pooled.setdefault(run.n, []).extend(record_breaking(zip(run.compute, run.reward)))
    points = {n: [(math.log2(c), r) for c, r in record_breaking(p)] for n, p in pooled.items()}
    points = {n: p for n, p in sorted(points.items()) if len(p) >= 2}
    if not points:
        raise ValueError('fit_frontier: need a run with >= 2 record-breaking points')
    per_n = {n: fit_sigmoid(*zip(*p), bounds=reward_bounds) for n, p in points.items()}
    all_x = [x for p in points.values() for x, _ in p]
    log_c = np.linspace(min(all_x), max(all_x), grid_size)
    envelope, n_star = upper_envelope(per_n, log_c)
    n_star_fit = fit_n_star(log_c, n_star) if len(set(n_star.tolist())) > 1 else None
    return FrontierFit(points, per_n, log_c.tolist(), envelope.tolist(),
                       [int(n) for n in n_star], n_star_fit)


def plot_frontier(fit: FrontierFit, path: str):
    """PNG: record-breaking points and fitted reward(C) per n, and their upper envelope."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    for n, pts in fit.points.items():
        x, y = np.asarray(pts).T
        line, = ax.plot(2.0 ** np.asarray(fit.log_c), fit.per_n[n](fit.log_c), label=f'n={n}')
        ax.scatter(2.0 ** x, y, s=14, color=line.get_color())
    ax.plot(2.0 ** np.asarray(fit.log_c), fit.envelope, 'k--', lw=2, label='envelope')
    ax.set_xscale('log', base=2)
    ax.set(xlabel='compute C (rollouts)', ylabel='reward', title='IsoCompute frontier')
    ax.legend(fontsize=8)
    storage.write_figure(path, fig, dpi=120, bbox_inches='tight')


def plot_n_star(fit: FrontierFit, path: str):
    """PNG: the envelope's n* at each compute and its sigmoid fit."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    c = 2.0 ** np.asarray(fit.log_c)
    ax.step(c, fit.n_star, where='mid', label='n* (envelope)')
    if fit.n_star_fit is not None:
        ax.plot(c, 2.0 ** fit.n_star_fit(fit.log_c), label='sigmoid fit')
    ax.set_xscale('log', base=2)
    ax.set_yscale('log', base=2)
    ax.set(xlabel='compute C (rollouts)', ylabel='n*', title='compute-optimal n')
    ax.legend(fontsize=8)
    storage.write_figure(path, fig, dpi=120, bbox_inches='tight')
