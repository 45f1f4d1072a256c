"""A long run, interrupted again and again: SIGTERM and SIGKILL at random points (seeded) every
few dozen steps, relaunched each time by a loop like `launch/tpu.sh watch`, ends with the metrics
rows of one uninterrupted run, and nothing leaks: open files, threads and verifier processes stay
flat over each process's life, no verifier outlives its run, the checkpoints kept stay bounded.
"""
import os
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest

from jaxprefix.rl.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 200
KEEP = 3
SEED = 25
# The untrained smoke policy earns this unevenly, so the groups have variance and every step
# moves the weights: a resume that lost anything would show in the rows.
SHARE_OF_ONES = "def reward(completion, problem):\n    return completion.count('1') / max(len(completion), 1)\n"
NOT_COMPARED = ("time/", "throughput/")


def _command(workdir, base, reward_file):
    return [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
            f"--workdir={workdir}", f"--config.model.path={base}",
            f"--config.rewards.path={reward_file}:reward", "--config.rewards.workers=1",
            f"--config.train.total_steps={STEPS}", "--config.checkpoint.every=5",
            f"--config.checkpoint.keep={KEEP}", "--config.eval.every=100",
            "--config.metrics.segment_rows=40"]  # segments sealed across the restarts too


def _rows(workdir) -> int:
    path = os.path.join(workdir, "metrics.jsonl")
    try:
        return len(read_metrics(str(workdir)))
    except (FileNotFoundError, ValueError):  # not yet, or read while being replaced
        return 0 if not os.path.exists(path) else -1


def _resources(pid: int, tag: str) -> dict:
    """Open files and threads of `pid`, and its verifier workers (children carrying `tag`)."""
    with open(f"/proc/{pid}/status") as f:
        threads = next(int(l.split()[1]) for l in f if l.startswith("Threads:"))
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": threads,
            "children": len(_tagged(tag, parent=pid))}


def _tagged(tag: str, parent: int | None = None) -> list[int]:
    """Processes whose environment holds SOAK_TAG=tag (optionally: children of `parent`)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if f"SOAK_TAG={tag}".encode() not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if parent is None or ppid == parent:
            found.append(int(name))
    return found


@pytest.mark.slow
def test_a_run_killed_again_and_again_ends_as_an_uninterrupted_one(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    sft = subprocess.run([sys.executable, "-m", "jaxprefix.main", "--config=configs/sft.py:smoke",
                          f"--workdir={tmp_path / 'sft'}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert sft.returncode == 0, sft.stderr[-3000:]
    base, reward_file = tmp_path / "sft" / "base", tmp_path / "rewards.py"
    reward_file.write_text(SHARE_OF_ONES)
    tag = uuid.uuid4().hex
    env["SOAK_TAG"] = tag
    reference_dir, soak_dir = tmp_path / "uninterrupted", tmp_path / "interrupted"
    reference = subprocess.Popen(_command(reference_dir, base, reward_file), cwd=ROOT, env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    rng = random.Random(SEED)
    next_stop = rng.randint(20, 45)
    launches, interruptions, lives = 0, [], []
    deadline = time.monotonic() + 1500
    while True:  # the supervisor: relaunch the same command until it ends with status 0
        launches += 1
        run = subprocess.Popen(_command(soak_dir, base, reward_file), cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        life = []  # (rows logged, resources) while it runs
        while run.poll() is None:
            assert time.monotonic() < deadline, "the soak ran out of time"
            rows = _rows(soak_dir)
            if rows > 0:
                try:
                    life.append((rows, _resources(run.pid, tag)))
                except OSError:  # it has just ended
                    pass
            if rows >= next_stop and next_stop < STEPS:
                time.sleep(rng.uniform(0.0, 0.5))  # anywhere in a step
                lives.append(life)
                kind = rng.choice((signal.SIGTERM, signal.SIGKILL))
                run.send_signal(kind)
                interruptions.append((kind.name, rows))
                next_stop = rows + rng.randint(20, 45)
                break
            time.sleep(0.05)
        _, stderr = run.communicate(timeout=300)
        if run.returncode == 0:
            break
        assert run.returncode in (143, -signal.SIGKILL), stderr[-3000:]
        assert not _tagged(tag, parent=run.pid)
    reference.wait(timeout=1500)
    assert reference.returncode == 0
    print(f"soak: {launches} launches, interruptions (signal, rows logged): {interruptions}")

    assert len(interruptions) >= 4 and {k for k, _ in interruptions} == {"SIGTERM", "SIGKILL"}
    rows, expected = read_metrics(str(soak_dir)), read_metrics(str(reference_dir))
    assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rs]
    assert strip(rows) == strip(expected)
    assert all(r["grad_norm"] > 0 for r in expected)  # the weights moved at every step
    # Each process's open files, threads and verifier workers, sampled all along its life: the
    # fewest over its last 10 steps against the fewest over 10 steps early on. A checkpoint save's
    # threads and files come and go, so a window's most depends on whether a sample fell inside a
    # save; its fewest does not, and a leak of one a step raises it by ten or more.
    flat = []
    for life in lives:
        first, last = life[0][0], life[-1][0]
        if last - first < 30:
            continue
        early = [r for n, r in life if first + 5 <= n < first + 15]
        late = [r for n, r in life if n > last - 10]
        floor = lambda window, key: min(r[key] for r in window)
        flat.append({key: (floor(early, key), floor(late, key)) for key in early[0]})
        assert all(r["children"] == 1 for n, r in life if n > first), life
    print(f"soak: resources (fewest early, fewest late) of each long-lived process: {flat}")
    assert flat
    for floors in flat:
        assert floors["fds"][1] <= floors["fds"][0] + 3, flat
        assert floors["threads"][1] <= floors["threads"][0] + 4, flat
    assert not _tagged(tag)  # no verifier outlived its run
    steps = sorted(n for n in os.listdir(soak_dir / "checkpoints"))
    assert len(steps) <= KEEP and all(n.isdigit() for n in steps), steps  # no partial saves left
