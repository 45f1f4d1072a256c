"""<workdir>/curves.png: a run's held-out scores and training reward against its steps.

Redrawn from metrics.jsonl after every evaluation, so a run shows its curve while it runs (step 0
is the evaluation before the first step, with eval.before_train). Left: each eval request's
greedy accuracy and sampled pass@1 (and the share of full rewards where a verifier also values
a format: the strict reading); right: the training reward per step.
"""
from __future__ import annotations

from jaxprefix import storage
from jaxprefix.rl.metrics import read_metrics

CURVES = "curves.png"


def _series(records, key):
    return [(r["step"], r[key]) for r in records if key in r]


def plot_run(workdir: str, title: str = "") -> str:
    """Draws <workdir>/curves.png from the run's metrics; returns its path."""
    from matplotlib.figure import Figure

    records = read_metrics(workdir)
    names = sorted({k.split("/")[0] for r in records for k in r
                    if k.endswith("/pass@1") or k.endswith("/accuracy")})
    fig = Figure(figsize=(11, 4))
    left, right = fig.subplots(1, 2)
    for name in names:
        greedy = name.endswith("_greedy")
        how = "greedy" if greedy else "sampled"
        request = name.removesuffix("_greedy")
        for key, label, style in ((f"{name}/accuracy", "right", "o-"),
                                  (f"{name}/pass@1", "pass@1", "s-"),
                                  (f"{name}/full_reward", "full reward", "^:" if greedy else "v:")):
            points = _series(records, key)
            if points:
                left.plot(*zip(*points), style, label=f"{request}, {how}: {label}")
    reward = _series(records, "reward/mean")
    if reward:
        right.plot(*zip(*reward), alpha=0.5, label="reward/mean")
        window = 5  # a trailing mean: one step's 64 rows are noisy
        steps, values = zip(*reward)
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / (i + 1 - max(0, i - window + 1))
                  for i in range(len(values))]
        right.plot(steps, smooth, label=f"trailing mean of {window}")
    left.set(title=title or "held-out problems", xlabel="RL step", ylabel="share right")
    right.set(title="training reward", xlabel="RL step", ylabel="mean reward")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = storage.join(workdir, CURVES)
    storage.write_figure(path, fig, dpi=110)
    return path
