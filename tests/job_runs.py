"""What the job smoke tests share: running `python -m jaxprefix.main` in a workdir (expecting
success, or an anticipated one-line failure), the smoke configs' counts, and checks of what an
rl run writes. The smoke SFT bases are session fixtures in conftest.py."""
import json
import os
import re
import subprocess
import sys

import numpy as np

from jaxprefix.rl.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# The smoke configs (variants.smoke): 8 training candidates, k=2 mining samples, 4 problems
# a step, n=4 rollouts each, 2 steps, prefix search over 1..2 steps with 2 samples each.
CANDIDATES, K, PROBLEMS_PER_STEP, N, STEPS, PREFIX_SAMPLES = 8, 2, 4, 4, 2, 2
PREFIX_SEARCH = "prefixes_instruction_default_f0.25"  # guidance in the prompt, the demo's cap
CAP1_SEARCH = "prefixes_instruction_default_f1"


def run_main(config: str, workdir, *flags, timeout: int = 900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "jaxprefix.main", f"--config={config}",
                             f"--workdir={workdir}", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{config} failed:\n{result.stderr[-4000:]}"
    return result


def run_main_failing(config: str, workdir, *flags, timeout: int = 900):
    """A run expected to stop on an anticipated failure: (exit status, its stderr lines other
    than absl's log lines and progress bars)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-m", "jaxprefix.main", f"--config={config}",
                             f"--workdir={workdir}", *flags], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode != 0, "expected a failure"
    lines = [line for line in result.stderr.replace("\r", "\n").splitlines()
             if line.strip() and not re.match(r"[IWEF]\d{4} ", line) and "%|" not in line]
    return result.returncode, lines


def rl_run(config: str, workdir, base: str, *flags):
    run_main(config, workdir, f"--config.model.path={base}", *flags)
    return str(workdir)


def check_rl_outputs(workdir: str, steps: int, tags=()):
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for record in records:
        for key in ("reward/mean", "loss", *(f"reward/{t}" for t in tags)):
            assert np.isfinite(record[key]), key
    assert "eval/pass@1" in records[-1]  # eval.every = 2 in the smoke configs
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(workdir, "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == list(range(1, steps + 1))
    for tag in tags:
        assert len(events.Scalars(f"reward/{tag}")) == steps
    checkpoints = sorted(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints"))
                         if s.isdigit())
    assert checkpoints[-1] == steps  # checkpoint.every = 1, keep = 3
    with open(os.path.join(workdir, "compute.json")) as f:
        return records, json.load(f)


def mining_rollouts(workdir: str) -> int:
    """Rollouts mining must have drawn, counted from what it wrote: k per candidate, then m per
    still-unsolved hard problem at each prefix length tried."""
    with open(os.path.join(workdir, "mining", "hard_set.json")) as f:
        hard = json.load(f)
    assert hard["k"] == K and len(hard["solve_counts"]) == CANDIDATES
    total = K * CANDIDATES
    prefixes_file = os.path.join(workdir, "mining", f"{PREFIX_SEARCH}.json")
    if os.path.exists(prefixes_file):
        with open(prefixes_file) as f:
            found = json.load(f)["shortest_units"]
        assert sorted(found) == sorted(hard["hard_ids"])
        for units in (1, 2):  # max_prefix_units = 2 = a quarter of the 9 steps
            total += PREFIX_SAMPLES * sum(u is None or u >= units for u in found.values())
    return total


def check_png(path: str):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
