"""Kill and resume (issue 70): SIGKILL a run N times at random moments, rerun the same command,
and check the run it ends as equals one never interrupted.

One smoke GRPO run (configs/grpo.py:smoke on the smoke SFT base, trained once into
<workdir>/base) is run straight through in <workdir>/straight. The same command then runs in
<workdir>/killed: each of --kills attempts waits until the loop starts (its "will train" log
line; --start=step: until the first step it trains is done), sleeps a seeded random time in
[0, --window) and sends SIGKILL (no handler runs, nothing is flushed), then the next attempt
reruns the command in the same workdir; after the last kill it runs to the end. Compared then:

  rows     metrics rows: the same steps, each once, none skipped, equal apart from times;
  params   the last checkpoint's arrays (params, optimizer state, step): bit for bit, or the
           count that differ and the largest difference;
  others   compute.json and eval_counts.jsonl equal, TensorBoard's steps once each;
  files    nothing half-written left: no temporary checkpoint directory or file, every
           checkpoint committed, every metrics line whole JSON.

Where each kill fell is read from the workdir at the moment of the kill: the steps whose rows
were written, the checkpoints committed, a checkpoint being written (an orbax temporary
directory), or a restart still restoring (no row yet since it started). The report is one JSON
object on stdout (and <workdir>/report.json).

  python bench/kill_resume.py --workdir=/tmp/kills --kills=20                 # overlapped
  python bench/kill_resume.py --workdir=/tmp/kills_sync --kills=20 --sync     # synchronous

Overlapped means train.max_staleness=1, rollout.devices=1 (two host devices) and
rollout.partial_tokens=8; --flags adds any other override (e.g. --flags=--config.rollout.
inflight_kv=keep). train.entropy_coef=0.01 gives every step a gradient: the untrained smoke
policy scores 0 on every rollout, and a run whose weights never move would compare equal
trivially.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = ("time/", "throughput/", "compile/")
OVERLAP = ("--config.train.max_staleness=1", "--config.rollout.devices=1",
           "--config.rollout.partial_tokens=8")
# When a kill's delay starts: rl.py's line just before the loop ('loop'), or the loop's line
# after the first step a process trains ('step': its restore and compiles are behind it, so the
# kills fall among steps, checkpoints and weight publishes).
STARTS = {"loop": "will train", "step": "XLA programs"}


def environment() -> dict:
    """Two host devices (rollout.devices=1: one the sampler's, one the learner's), whatever
    XLA_FLAGS held (the test suite's eight)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=2".strip()
    return env


def main_command(workdir: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "jaxprefix.main", f"--workdir={workdir}", *flags]


def run_flags(args, base: str) -> list[str]:
    return ["--config=configs/grpo.py:smoke", f"--config.model.path={base}",
            f"--config.train.total_steps={args.steps}", "--config.checkpoint.every=1",
            "--config.train.entropy_coef=0.01", *(() if args.sync else OVERLAP), *args.flags]


def run_to_end(command: list[str], log: str) -> None:
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=ROOT, env=environment(), stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}; see {log}")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def _checkpoints(workdir: str) -> tuple[list[int], list[str]]:
    """(committed checkpoint steps, temporary entries: saves cut short or in progress)."""
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    committed = sorted(int(n) for n in names if n.isdigit() and
                       os.path.exists(os.path.join(directory, n, "commit_success.txt")))
    return committed, sorted(n for n in names if not n.isdigit() or int(n) not in committed)


def _row_steps(workdir: str) -> tuple[list[int], bool]:
    """(steps of the whole rows in metrics.jsonl, whether a partial last line was there)."""
    steps, torn = [], False
    for line in _read(os.path.join(workdir, "metrics.jsonl")).splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            torn = True
    return steps, torn


def _bar(log: str) -> tuple[int, int] | None:
    """(the first, the last) steps-done count of the loop's progress bar in a log, or None."""
    counts = [int(c) for c in re.findall(r"\| *(\d+)/\d+ \[", log.replace("\r", "\n"))]
    return (counts[0], counts[-1]) if counts else None


def where_it_fell(workdir: str, log: str, left_before: list[str]) -> dict:
    """The workdir and the log at the moment of a kill, and the phase they say. A temporary
    checkpoint the kill before left (the restart removes it once it opens the checkpoints) is
    not one being written. The rows alone cannot say it: a restart rewrites the rows after its
    checkpoint with the same values."""
    rows, torn = _row_steps(workdir)
    committed, temporary = _checkpoints(workdir)
    last = rows[-1] if rows else 0
    writing = [t for t in temporary if t not in left_before]
    text, bar = _read(log), _bar(_read(log))
    if writing:
        kind, phase = "checkpoint", f"writing a checkpoint ({', '.join(writing)})"
    elif STARTS["step"] not in text or bar is None:
        kind, phase = "resume", "resuming: restore, compiles, the first step's update"
    elif bar[1] == bar[0]:  # the first step's update is done, its bar not moved yet
        kind, phase = "after_update", (f"step {bar[0] + 1}'s evaluation, row, checkpoint or "
                                       f"publish (the first step of this process)")
    else:
        kind, phase = "step", f"step {bar[1] + 1} (sampling, update, evaluation, checkpoint " \
                              f"or publish; {bar[1]} done)"
    return {"rows": len(rows), "last_row": last, "checkpoints": committed,
            "temporary": temporary, "torn_row": torn, "kind": kind, "phase": phase,
            # steps whose rows were written but whose checkpoint was not committed: the restart
            # trains them again from the checkpoint before (their rows rewritten, never doubled)
            "steps_to_redo": max(0, last - max(committed, default=0))}


def killed_attempt(command: list[str], log: str, delay: float, start: str) -> dict | None:
    """One attempt killed `delay` s after `start` (STARTS); None when it finished first."""
    workdir = command[3].split("=", 1)[1]
    left_before = _checkpoints(workdir)[1]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, env=environment(), stdout=out,
                                   stderr=subprocess.STDOUT)
    try:
        while STARTS[start] not in _read(log):
            if process.poll() is not None:
                break
            time.sleep(0.05)
        started = time.monotonic()
        while process.poll() is None and time.monotonic() - started < delay:
            time.sleep(0.01)
        if process.poll() is not None:
            if process.returncode != 0:
                raise SystemExit(f"{' '.join(command)} exited {process.returncode}; see {log}")
            return None
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    fell = where_it_fell(workdir, log, left_before)
    tail = [line for line in _read(log).replace("\r", "\n").splitlines() if line.strip()]
    return {"delay_s": round(delay, 3), **fell, "log_tail": tail[-1][:200] if tail else ""}


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def compare_rows(straight: str, killed: str) -> dict:
    from jaxprefix.rl.metrics import read_metrics
    a, b = read_metrics(straight), read_metrics(killed)
    steps = [r["step"] for r in b]
    differing = [r["step"] for r, s in zip(_comparable(a), _comparable(b)) if r != s]
    return {"steps": steps, "steps_equal": steps == [r["step"] for r in a],
            "each_once": len(steps) == len(set(steps)),
            "none_skipped": steps == list(range(steps[0], steps[-1] + 1)) if steps else False,
            "rows_differing": differing, "rows_equal": not differing and len(a) == len(b)}


def compare_others(straight: str, killed: str) -> dict:
    """The run's other records: compute.json (tokens, FLOPs) and eval_counts.jsonl equal, and
    TensorBoard's steps once each (a step logged before a kill and trained again is dropped
    from the older event file: metrics.MetricsWriter's SessionLog START)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def parsed(workdir, name):
        text = _read(os.path.join(workdir, name))
        return [json.loads(line) for line in text.splitlines()] if name.endswith("l") else \
            json.loads(text or "null")
    events = EventAccumulator(os.path.join(killed, "tensorboard"))
    events.Reload()
    steps = [e.step for e in events.Scalars("reward/mean")]
    return {"compute_equal": parsed(straight, "compute.json") == parsed(killed, "compute.json"),
            "eval_counts_equal": (parsed(straight, "eval_counts.jsonl")
                                  == parsed(killed, "eval_counts.jsonl")),
            "tensorboard_steps_once": steps == sorted(set(steps)),
            "tensorboard_steps_repeated": sorted({s for s in steps if steps.count(s) > 1})}


def compare_params(straight: str, killed: str, step: int) -> dict:
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    def arrays(workdir):
        # read as host numpy arrays: a checkpoint saved from one device records no sharding
        path = os.path.join(workdir, "checkpoints", str(step), "arrays")
        checkpointer = ocp.PyTreeCheckpointer()
        meta = checkpointer.metadata(path)
        meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=host))
        return {jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree_util.tree_leaves_with_path(tree)}
    a, b = arrays(straight), arrays(killed)
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    largest = max((float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64))))
                   for k in differ), default=0.0)
    return {"arrays": len(a), "bit_equal": not differ and a.keys() == b.keys(),
            "arrays_differing": len(differ), "largest_difference": largest}


def leftovers(workdir: str) -> list[str]:
    """Half-written files a finished run left: temporary checkpoints, temp files, torn rows."""
    left = _checkpoints(workdir)[1]
    for folder, _, files in os.walk(workdir):
        left += [os.path.join(folder, f) for f in files if ".tmp" in f or f.endswith("~")]
    if _row_steps(workdir)[1]:
        left.append("metrics.jsonl: a line that is not whole JSON")
    return left


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--kills", type=int, default=20)
    # A restart takes ~6 s to its first row on 2 cores and a step ~0.5 s: 80 steps and 11 s
    # spread 20 kills over the run (too wide a window and it ends before the last kill).
    parser.add_argument("--steps", type=int, default=80, help="train.total_steps of the run")
    parser.add_argument("--window", type=float, default=11.0,
                        help="a kill falls uniformly in [0, window) s after the loop starts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", choices=sorted(STARTS), default="loop",
                        help="loop: delays count from the loop's start (restores and compiles "
                        "included); step: from the end of the first step each process trains")
    parser.add_argument("--sync", action="store_true", help="the synchronous loop")
    parser.add_argument("--flags", action="append", default=[], help="more config overrides")
    parser.add_argument("--base", default="", help="a smoke SFT base (configs/sft.py:smoke's "
                        "<workdir>/base); '': trained once into <workdir>/base")
    args = parser.parse_args(argv)
    workdir = os.path.abspath(args.workdir)
    os.makedirs(workdir, exist_ok=True)
    base = os.path.abspath(args.base) if args.base else os.path.join(workdir, "base")
    if not os.path.exists(os.path.join(base, "model.safetensors")):
        run_to_end(main_command(workdir, "--config=configs/sft.py:smoke"),
                   os.path.join(workdir, "sft.log"))
    flags = run_flags(args, base)
    straight, killed = os.path.join(workdir, "straight"), os.path.join(workdir, "killed")
    if not os.path.exists(os.path.join(straight, "checkpoints", str(args.steps))):
        run_to_end(main_command(straight, *flags), os.path.join(workdir, "straight.log"))
    rng = random.Random(args.seed)
    kills, finished_early = [], False
    for attempt in range(args.kills):
        kill = killed_attempt(main_command(killed, *flags),
                              os.path.join(workdir, f"killed.{attempt}.log"),
                              rng.uniform(0, args.window), args.start)
        if kill is None:
            finished_early = True
            break
        kills.append(kill)
        print(f"kill {attempt + 1}: {kill['delay_s']} s in, {kill['phase']}", file=sys.stderr)
    run_to_end(main_command(killed, *flags), os.path.join(workdir, "killed.final.log"))
    report = {"loop": "synchronous" if args.sync else "overlapped", "flags": flags,
              "start": args.start, "window_s": args.window, "seed": args.seed,
              "kills": kills, "finished_before_a_kill": finished_early,
              "kills_by_kind": {kind: sum(k["kind"] == kind for k in kills)
                                for kind in ("resume", "after_update", "step", "checkpoint")},
              "rows": compare_rows(straight, killed),
              "params": compare_params(straight, killed, args.steps),
              "others": compare_others(straight, killed),
              "leftovers": leftovers(killed)}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
