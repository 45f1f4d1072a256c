"""A run that cannot be corrupted: run identity, workdir locks, one-line errors, prompt limits,
array contracts between modules, and the SFT base's completeness marker.

The checkpoint fallback is tested in test_loop.py (it needs the loop's tiny run), and the
end-to-end probes through `python -m jaxprefix.main` in test_jobs.py.
"""
import errno
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jaxprefix import errors, run_config, run_identity, variants
from jaxprefix.storage import workdir_lock
from jaxprefix.data import DataError
from jaxprefix.rl import boundaries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- run identity ----------------------------------------------------------------------------

def test_resume_with_another_learning_rate_is_refused_naming_the_field(tmp_path):
    workdir = str(tmp_path)
    run_identity.claim(run_config.base_config(), workdir)
    changed = run_config.base_config()
    changed.train.learning_rate = 3e-4
    changed.rollout.n = 16
    with pytest.raises(errors.ConfigError) as e:
        run_identity.claim(changed, workdir)
    message = str(e.value)
    assert "train.learning_rate: 0.0001 -> 0.0003" in message and "rollout.n: 8 -> 16" in message
    assert "--config.allow_changes=rollout.n,train.learning_rate" in message
    assert "\n" not in message

    changed.allow_changes = "train.learning_rate, rollout"  # a block name covers its fields
    run_identity.claim(changed, workdir)
    record = json.load(open(tmp_path / run_identity.RECORD))
    assert record["config"]["train"]["learning_rate"] == 3e-4
    assert record["history"][-1]["changed"]["rollout.n"] == [8, 16]
    assert record["code"]["jaxprefix"]


def test_fields_that_steer_length_cadence_and_hardware_may_change(tmp_path):
    run_identity.claim(run_config.base_config(), str(tmp_path))
    later = run_config.base_config()
    later.train.total_steps = 1000
    later.eval.every, later.checkpoint.keep, later.mesh.fsdp = 5, 10, 2
    later.rewards.workers = 4
    # The sweep's grid, edited in a shared config (a plain run's n, B, M are its own fields).
    later.isocompute.budgets, later.isocompute.eval_every_rollouts = (2**11, 2**12), 2**11
    run_identity.claim(later, str(tmp_path))  # no error
    later.seed = 1
    with pytest.raises(errors.ConfigError, match=r"seed: 0 -> 1"):
        run_identity.claim(later, str(tmp_path))


# --- workdir lock ----------------------------------------------------------------------------

HOLDER = """
import sys, time
from jaxprefix.storage import workdir_lock
with workdir_lock.hold(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_local_lock_refuses_a_second_run_and_is_taken_over_after_the_owner_dies(tmp_path, caplog):
    workdir = str(tmp_path / "w")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, workdir], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(workdir_lock.WorkdirLocked) as e:
            with workdir_lock.hold(workdir):
                pass
        assert f"pid {holder.pid}" in str(e.value) and "in use by another run" in str(e.value)
    finally:
        holder.send_signal(signal.SIGKILL)  # no release: the lock file keeps its record
        holder.wait()
    with caplog.at_level(logging.WARNING), workdir_lock.hold(workdir):
        with workdir_lock.hold(workdir):  # re-entrant within a process
            pass
    assert f"pid {holder.pid}" in caplog.text and "taking over" in caplog.text


def test_taking_over_a_killed_runs_lock_removes_the_files_it_was_writing(tmp_path, caplog):
    """A SIGKILL between an atomic write's temporary file and its rename leaves the temporary
    (bench/kill_resume.py found metrics.jsonl.tmp-<pid>-<hex> after 20 kills): the run taking
    over the workdir removes the dead owner's, and only those."""
    from jaxprefix import storage

    workdir = tmp_path / "w"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(workdir)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert holder.stdout.readline().strip() == "held"
    (workdir / "metrics").mkdir()
    orphans = [workdir / f"metrics.jsonl.tmp-{holder.pid}-0123abcd",
               workdir / "metrics" / f"000000001.jsonl.tmp-{holder.pid}-89abcdef"]
    others = [workdir / "metrics.jsonl.tmp-1-0123abcd", workdir / "metrics.jsonl"]
    for path in orphans + others:
        path.write_text("{\"step\": 1, \"lo")
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with caplog.at_level(logging.WARNING), workdir_lock.hold(str(workdir)):
        assert [p.exists() for p in orphans + others] == [False, False, True, True]
    assert f"removed {orphans[0]}" in caplog.text
    assert storage.remove_orphaned_temporaries(str(workdir), holder.pid) == []


def _write_lock_object(gcs, name: str, owner: dict):
    from google.cloud import storage as gcs_client

    blob = gcs_client.Client().bucket("bucket").blob(name)
    blob.upload_from_string(json.dumps(owner))


def _lock_owner(name: str) -> dict:
    from google.cloud import storage as gcs_client

    return json.loads(gcs_client.Client().bucket("bucket").blob(name).download_as_text())


def test_gcs_lock_refuses_a_live_owner_and_takes_over_a_stale_one(gcs, caplog):
    workdir = "gs://bucket/locked_run"
    with workdir_lock.hold(workdir):
        assert _lock_owner("locked_run/lock.json")["pid"] == os.getpid()
        with pytest.raises(workdir_lock.WorkdirLocked, match=f"pid {os.getpid()}"):
            workdir_lock._GcsLock(workdir, 60).acquire(stale_minutes=10)
    assert "locked_run/lock.json" not in gcs.objects("bucket", "locked_run")  # released

    stale = {"host": "another-host", "pid": 1, "started": "2026-01-01T00:00:00",
             "command": "python -m jaxprefix.main", "heartbeat": time.time() - 11 * 60}
    _write_lock_object(gcs, "stale_run/lock.json", stale)
    with pytest.raises(workdir_lock.WorkdirLocked, match="another-host"):
        with workdir_lock.hold("gs://bucket/stale_run",
                               workdir_lock.LockSettings(stale_minutes=20)):
            pass
    with caplog.at_level(logging.WARNING), workdir_lock.hold("gs://bucket/stale_run"):
        assert _lock_owner("stale_run/lock.json")["pid"] == os.getpid()
    assert "took over a stale lock" in caplog.text and "another-host" in caplog.text


def test_gcs_lock_of_two_simultaneous_runs_goes_to_one(gcs):
    # The generation precondition (ifGenerationMatch=0) decides; the other run is refused.
    start, outcomes, held = threading.Barrier(2), [], []

    def contend():
        lock = workdir_lock._GcsLock("gs://bucket/contended", 60)
        start.wait()
        try:
            lock.acquire(stale_minutes=10)
            outcomes.append("held")
            held.append(lock)
        except workdir_lock.WorkdirLocked:
            outcomes.append("refused")

    threads = [threading.Thread(target=contend) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for lock in held:  # its heartbeat thread would outlive the emulator, beating at nothing
        lock.release()
    assert sorted(outcomes) == ["held", "refused"]


# --- one-line errors -------------------------------------------------------------------------

def test_anticipated_failures_are_one_line_and_bugs_are_not():
    from jaxprefix.data import reasoning_gym_problems

    saved = sys.modules.get("reasoning_gym")
    sys.modules["reasoning_gym"] = None  # as if it were not installed
    try:
        with pytest.raises(ModuleNotFoundError) as e:
            reasoning_gym_problems("gsm_symbolic", 1, 0)
        missing = e.value
    finally:
        if saved is None:
            del sys.modules["reasoning_gym"]
        else:
            sys.modules["reasoning_gym"] = saved
    assert re.fullmatch(r"error: missing package: reasoning_gym is not installed, and "
                        r"jaxprefix/data/reasoning_gym_source.py:\d+ needs it for the configured "
                        r"run; expected it installed: pip install reasoning-gym",
                        errors.one_line(missing))
    full = OSError(errno.ENOSPC, "No space left on device", "/w/metrics.jsonl")
    assert errors.one_line(full).startswith("error: disk full: writing /w/metrics.jsonl failed")
    assert errors.one_line(errors.DiskFull("/w/checkpoints", 3 << 20, 1 << 20)) == (
        "error: disk full: /w/checkpoints needs 3.0 MiB, 1.0 MiB free there; free space or use "
        "another --workdir")
    assert errors.one_line(DataError("f.jsonl:line 2: malformed JSON")) == \
        "error: f.jsonl:line 2: malformed JSON"
    assert errors.one_line(ValueError("a bug")) is None
    assert errors.one_line(ModuleNotFoundError("x", name="jaxprefix.nope")) is None


# --- prompts longer than the model's context ---------------------------------------------------

def test_over_long_prompts_are_refused_with_file_and_line_or_skipped_and_counted(tmp_path):
    from jaxprefix.run_setup.problem_sets import PromptLimit, load_problem_sets
    from jaxprefix.methods.prompting import TaskPrompts
    from jaxprefix.data.tasks import carry_multiplication as task

    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"question": q, "answer": "1"})
                              for q in ("12", "9" * 5_000_000, "34")) + "\n")
    data = run_config.base_config().data
    data.update(source="file", path=str(path), verifier="exact")
    limit = PromptLimit(TaskPrompts(task.tokenizer()), 100, "a cap of this test")
    with pytest.raises(DataError, match=rf"p.jsonl:line 2: a prompt of 5000000 tokens, longer "
                                        rf"than 100 \(a cap of this test\)"):
        load_problem_sets(data, limit)
    data.skip_invalid = True
    sets = load_problem_sets(data, limit)
    assert [p.question for p in sets.train] == ["12", "34"] and sets.skipped == 1


def test_prompt_guidance_a_task_policy_cannot_read_fails_in_preflight(tmp_path):
    from jaxprefix.errors import ConfigError
    from jaxprefix.run_setup import preflight

    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "12", "answer": "1"}) + "\n")
    config = variants.method_config(os.path.join(ROOT, "configs", "pope.py"), "pope", "smoke")[0]
    assert config.pope.guidance == "instruction" and config.model.source == "sft"
    # A file's problems: the built-in task's data fields back at their defaults (else unread).
    config.data = run_config.base_config().data
    config.data.update(source="file", path=str(path), verifier="exact")
    # Used to pass here and fail at the prefix search, after the base's SFT and the mining.
    with pytest.raises(ConfigError, match=r"pope.guidance='instruction': problems from \['p'\] "
                                          r"have no hint layout"):
        preflight.check(config, str(tmp_path / "w"))
    config.pope.guidance = "solution_prefix"
    preflight.check(config, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()  # preflight writes nothing


def test_fields_no_stage_of_the_job_reads_are_refused_in_preflight(tmp_path):
    from jaxprefix.errors import ConfigError
    from jaxprefix.run_setup import preflight

    def config(name, **fields):
        c = run_config.from_file(os.path.join(ROOT, "configs", name), "smoke")
        for field, value in fields.items():
            block, key = field.split("__", 1)
            c[block][key] = value
        return c

    workdir = str(tmp_path / "w")
    with pytest.raises(ConfigError, match=r"^config.prefixrl.cut_lo is set but no stage of job "
                                          r"rl with method pope reads it \(only prefixrl read"):
        preflight.check(config("pope.py", prefixrl__cut_lo=0.5), workdir)
    with pytest.raises(ConfigError, match=r"config.schedule.annealed.steps is set .*"
                                          r"\(schedule.kind='fixed' reads only"):
        preflight.check(config("pope.py", schedule__annealed=dict(steps=7, start_fraction=1.0,
                                                                 end_fraction=0.0,
                                                                 shape="linear")), workdir)
    # The ablation's template on the demo task: its hint is a layout, with no English to change.
    with pytest.raises(ConfigError, match=r"config.pope.template='no_restate' is set but no stage"
                                          r" of job rl reads it: a built-in task's prompts"):
        preflight.check(config("pope.py", pope__template="no_restate"), workdir)
    results = config("results.py")
    results.results.runs = ("pope_cap0.25", "pope_no_restate")
    with pytest.raises(ConfigError, match=r"'no_restate' is set but no stage of run "
                                          r"pope_no_restate of job results"):
        preflight.check(results, workdir)
    # The key-step probe reads a built-in task's oracle solutions, at evaluations.
    with pytest.raises(ConfigError, match=r"^config.eval.key_step_probe=True is set but no "
                                          r"stage reads it: eval.every=0 never evaluates"):
        preflight.check(config("pope.py", eval__key_step_probe=True, eval__every=0), workdir)
    # What the method reads passes: POPE's own fields on POPE, PrefixRL's on PrefixRL.
    preflight.check(config("pope.py", pope__unsolved="drop", schedule__kind="annealed",
                           eval__key_step_probe=True), workdir)
    preflight.check(config("prefixrl.py", prefixrl__cut_lo=0.5), workdir)
    assert not (tmp_path / "w").exists()  # preflight writes nothing


def test_template_is_read_on_the_restating_notation_and_the_notation_is_the_bases(tmp_path):
    from jaxprefix.errors import ConfigError
    from jaxprefix.run_setup import preflight

    workdir = str(tmp_path / "w")
    c = run_config.from_file(os.path.join(ROOT, "configs", "pope.py"), "smoke")
    assert c.data.key_names_rule is False and c.sft.data.key_names_rule is False
    c.sft.data.key_names_rule = c.data.key_names_rule = True  # the restating route
    for template in ("default", "no_restate"):  # restating hint, value hint: both read
        c.pope.template = template
        preflight.check(c, workdir)
    c.data.key_names_rule = False
    with pytest.raises(ConfigError, match=r"^config.data.key_names_rule=False but the SFT base "
                                          r"writes config.sft.data.key_names_rule=True"):
        preflight.check(c, workdir)
    assert not (tmp_path / "w").exists()


def test_moe_fields_on_a_dense_model_are_refused_in_preflight(tmp_path):
    """train.routing_replay and router_aux_coef act on a mixture of experts only: set on the
    dense smoke policy, one line each; 'auto' replays on the MoE smoke (episodes of several
    turns too), 'off' does not."""
    from jaxprefix.errors import ConfigError
    from jaxprefix.run_setup import preflight
    from jaxprefix.run_setup.learner_settings import routing_replay

    workdir = str(tmp_path / "w")
    dense = run_config.from_file(os.path.join(ROOT, "configs", "grpo.py"), "smoke")
    for field, value, expected in (
            ("routing_replay", "on", r"'on': expected 'auto' on a dense model \(it has no experts"),
            ("router_aux_coef", 0.01, r"0.01: expected 0 on a dense model \(it has no router")):
        c = run_config.from_file(os.path.join(ROOT, "configs", "grpo.py"), "smoke")
        c.train[field] = value
        with pytest.raises(ConfigError, match=rf"^config.train.{field}={expected}"):
            preflight.check(c, workdir)
    moe = run_config.from_file(os.path.join(ROOT, "configs", "grpo.py"), "moe_smoke")
    moe.train.router_aux_coef = 0.01
    preflight.check(moe, workdir)
    assert routing_replay(moe, True) and not routing_replay(dense, False)
    moe.train.routing_replay = "off"
    assert not routing_replay(moe, True)
    moe.train.routing_replay = "yes"
    with pytest.raises(ConfigError, match=r"^config.train.routing_replay='yes': expected 'auto', "
                                          r"'on' or 'off'$"):
        preflight.check(moe, workdir)
    moe.train.routing_replay, moe.rollout.max_turns = "auto", 3  # episodes record routes too
    assert routing_replay(moe, True)
    moe.rollout.max_turns, moe.rollout.partial_tokens = 1, 4  # continued rows record none
    with pytest.raises(ConfigError, match=r"^config.rollout.partial_tokens=4: expected 0 with "
                                          r"routing replay on a mixture of experts"):
        preflight.check(moe, workdir)
    moe.train.routing_replay = "off"
    assert not routing_replay(moe, True)
    assert not (tmp_path / "w").exists()


# --- array contracts between modules ---------------------------------------------------------

def test_boundary_checks_name_the_array_that_is_off():
    batch = {"tokens": np.zeros((4, 8), np.int32), "positions": np.zeros((4, 8), np.int32),
             "token_mask": np.ones((4, 8), bool), "completion_mask": np.ones((4, 8), np.float32),
             "old_logprobs": np.zeros((4, 8), np.float32), "advantages": np.zeros(4, np.float32)}
    boundaries.check_batch(batch)
    with pytest.raises(AssertionError, match=r"learner batch: advantages: .*\(4, 1\)"):
        boundaries.check_batch(batch | {"advantages": np.zeros((4, 1), np.float32)})
    with pytest.raises(AssertionError, match=r"token_mask: .*float32"):
        boundaries.check_batch(batch | {"token_mask": np.ones((4, 8), np.float32)})
    with pytest.raises(AssertionError, match=r"context 1 holds token id 17, outside .*\[0, 17\)"):
        boundaries.check_contexts([[1, 2], [3, 17]], vocab_size=17)
    with pytest.raises(AssertionError, match="context 0 is empty"):
        boundaries.check_contexts([[]], vocab_size=17)


# --- the SFT base: a save cut short is redone, not loaded -------------------------------------

def test_sft_base_whose_save_was_cut_short_is_trained_again_not_loaded(tmp_path):
    from jaxprefix.run_setup import policy as policy_job, sft_base

    config = variants.method_config(os.path.join(ROOT, "configs", "grpo.py"), "grpo", "smoke")[0]
    config.sft.update(max_steps=2, eval_start=2, eval_every=2)  # an SFT of seconds
    workdir = tmp_path / "w"
    base = workdir / "base"
    # The weights cannot be written (a directory stands in their way): the save stops there, as
    # a kill or a full disk would stop it.
    (base / "model.safetensors").mkdir(parents=True)
    with pytest.raises(OSError):
        policy_job.load_policy(config, str(workdir))
    assert not sft_base.is_complete(str(base))  # config.json comes last; it used to come first

    (base / "model.safetensors").rmdir()
    loaded = policy_job.load_policy(config, str(workdir))  # used to load the half-written base
    assert sft_base.is_complete(str(base)) and (base / sft_base.REPORT).exists()
    weights = (base / "model.safetensors").read_bytes()
    assert len(weights) > 4 * loaded.model.config.num_params()
    # A base cut short by an older jaxprefix (config.json first, weights cut) is not whole either.
    (base / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    assert not sft_base.is_complete(str(base))
