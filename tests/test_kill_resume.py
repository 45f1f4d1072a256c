"""SIGKILL at random moments of an overlapped run, the same command rerun in the same workdir:
bench/kill_resume.py (issue 70) ends as the uninterrupted run, row for row and bit for bit, with
no half-written file left. Run here at a small N; docs/OVERLAP.md gives its figures at N = 20."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kill_and_resume(workdir, base, kills, *flags):
    done = subprocess.run([sys.executable, "bench/kill_resume.py", f"--workdir={workdir}",
                           f"--base={base}", f"--kills={kills}", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_equal_to_the_straight_run(report, steps):
    assert report["rows"]["steps"] == list(range(1, steps + 1))  # each once, none skipped
    assert report["rows"]["rows_equal"], report["rows"]["rows_differing"]
    assert report["params"]["bit_equal"], report["params"]
    assert report["others"] == {"compute_equal": True, "eval_counts_equal": True,
                                "tensorboard_steps_once": True, "tensorboard_steps_repeated": []}
    assert report["leftovers"] == []


def test_an_overlapped_run_killed_twice_resumes_to_the_uninterrupted_run(tmp_path, base):
    report = kill_and_resume(tmp_path, base, 2, "--steps=4", "--window=4", "--seed=3")
    assert report["loop"] == "overlapped" and "--config.train.max_staleness=1" in report["flags"]
    assert len(report["kills"]) == 2, report  # both fell before the run's end
    check_equal_to_the_straight_run(report, 4)


@pytest.mark.slow  # ~1.5 min on 2 cores (with the smoke base)
def test_the_synchronous_loop_killed_five_times_resumes_bit_for_bit(tmp_path, base):
    report = kill_and_resume(tmp_path, base, 5, "--steps=8", "--window=6", "--seed=4", "--sync")
    assert report["loop"] == "synchronous" and len(report["kills"]) == 5, report
    check_equal_to_the_straight_run(report, 8)
