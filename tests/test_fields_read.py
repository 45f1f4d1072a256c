"""Every field read or refused: a set field that no settings builder of the job read stops the run
in one line before any work, whatever its block (run_setup/preflight.fields_read, recorded by
config_reads)."""
import os
import subprocess
import sys

import ml_collections
import pytest

from jaxprefix import run_config
from jaxprefix.config_reads import read_whole, recording, unwrapped
from jaxprefix.errors import ConfigError
from jaxprefix.run_setup import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def smoke(name: str):
    return run_config.from_file(os.path.join(ROOT, "configs", name), "smoke")


def test_a_recording_view_records_leaves_blocks_read_whole_and_copies():
    config = ml_collections.ConfigDict({"a": 1, "b": {"c": 2, "d": {"e": 3}}, "f": {"g": 4}})
    view, reads = recording(config)
    assert view.a == 1 and view.b.get("c") == 2 and view.get("missing", 7) == 7
    assert reads == {"a", "b.c"}
    dict(view.b.d)  # a block read whole: every leaf under it
    assert reads == {"a", "b.c", "b.d.e"}
    copy = view.copy_and_resolve_references()
    copy.f.g = 5  # a write is no read, and lands in the copy
    assert copy.f["g"] == 5 and config.f.g == 4 and "f.g" in reads
    part, part_reads = recording(view.copy_and_resolve_references())  # views nest
    assert part.b.d.e == 3 and part_reads == {"b.d.e"}
    assert unwrapped(part).to_dict() == config.to_dict()
    assert read_whole(config, "b") == {"b.c", "b.d.e"} and read_whole(config, "b.d.e") == {"b.d.e"}


@pytest.mark.parametrize("name,field,value,job", [
    ("grpo.py", "isocompute.ns", (2, 4), "rl with method grpo"),    # the sweep's, not a run's
    ("grpo.py", "compile.topology", "v5e-8", "rl with method grpo"),  # the compile job's
    ("eval.py", "train.learning_rate", 0.5, "eval with method pope"),  # an eval trains nothing
    ("eval.py", "rollout.inflight_kv", "keep", "eval with method pope"),  # no learner to publish
    ("grpo.py", "model.system_prompt", "Be brief.", "rl with method grpo"),  # a task's prompts
])
def test_a_field_of_a_block_the_job_reads_no_further_is_refused_in_one_line(
        name, field, value, job, tmp_path):
    config = smoke(name)
    block, key = field.split(".")
    config[block][key] = value
    workdir = tmp_path / "w"
    with pytest.raises(ConfigError) as raised:
        preflight.check(config, str(workdir))
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith(f"config.{field} is set but no stage of job {job} reads it (")
    assert line.endswith("expected it left at its default")
    assert not workdir.exists()


@pytest.mark.parametrize("changes,field", [
    ({"data.task_config": '{"a": 1}'}, "data.task_config"),  # reasoning-gym's generator only
    ({"data.question_field": "q"}, "data.question_field"),    # a problem file's only
    ({"model.source": "hf", "model.path": "/m", "sft.lr": 0.5}, "sft.lr"),  # a base given
])
def test_a_field_its_blocks_reader_skips_is_unread(changes, field):
    """Model and data: each block is read by its owner (the policy's settings, the problem
    loader) field by field, as the run will use them."""
    config = smoke("grpo.py")
    for name, value in changes.items():
        block, key = name.split(".")
        config[block][key] = value
    unread = {f for f, _ in preflight.unread(config)}
    assert field in unread and not (set(changes) - {field}) & unread


@pytest.mark.parametrize("name,job", [
    ("grpo.py", "rl"),
    pytest.param("pope.py", "rl", marks=pytest.mark.slow),
    pytest.param("prefixrl.py", "rl", marks=pytest.mark.slow),
    pytest.param("pope.py", "mine", marks=pytest.mark.slow),
])
def test_a_run_reads_no_field_its_preflight_did_not(name, job, base, tmp_path):
    """By construction: the job, run over a recording view, reads nothing that preflight's
    settings and stage readers did not (so no field a run uses can be refused as unread)."""
    import importlib

    from jaxprefix.main import JOBS

    config = smoke(name)
    config.job, config.model.path = job, base
    before = preflight.fields_read(config, str(tmp_path))[1]
    view, reads = recording(config)
    module, function = JOBS[job]
    getattr(importlib.import_module(f"jaxprefix.jobs.{module}"), function)(view, str(tmp_path))
    assert reads and reads <= before, sorted(reads - before)


def test_what_the_job_reads_passes_and_its_settings_come_back_on_the_config_itself(tmp_path):
    config = smoke("grpo.py")
    config.train.learning_rate = 3e-4  # read by the learner's settings
    config.isocompute.budget = 0       # read by the allocation (left at 0: no allocation)
    settings = preflight.check(config, str(tmp_path / "w"))
    assert settings.config is config and settings.train.learning_rate == 3e-4
    settings, reads = preflight.fields_read(config)
    assert {"train.learning_rate", "isocompute.budget", "rollout.temperature"} <= reads
    assert "isocompute.ns" not in reads and "compile.topology" not in reads


def test_eval_config_leaves_the_rl_runs_training_fields_at_their_defaults():
    """configs/eval.py builds on an rl run's variant: what only training reads goes back to its
    default (preflight.reset_unread), so the shipped config passes and an override is refused."""
    config = run_config.from_file(os.path.join(ROOT, "configs", "eval.py"), "smollm2")
    base = run_config.base_config()
    assert config.train.learning_rate == base.train.learning_rate
    assert config.checkpoint.every == base.checkpoint.every
    assert config.rollout.max_new_tokens != base.rollout.max_new_tokens  # the prober's: read
    assert preflight.unread(config) == []


def test_refused_on_the_command_line_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
         "--config.isocompute.ns=(2,4)", f"--workdir={workdir}"],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config.isocompute.ns is set but no stage of job rl with method grpo reads "
        "it (its settings read other isocompute.* fields); expected it left at its default")
    assert not workdir.exists()


def test_a_variants_fields_the_command_line_made_moot_are_reset_its_own_refused(tmp_path):
    """--config.data.source=file on a built-in task's variant: the task's fields the variant set
    go back to their defaults (logged), as the README's own-data commands need; a field the
    command line set that the run does not read is still refused."""
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"question": "1+1", "answer": "2"}\n')
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
         "--config.data.source=file", f"--config.data.path={problems}",
         "--config.data.verifier=exact", "--config.data.task=chain_sum", f"--workdir={workdir}"],
        cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 1
    assert "config.data.digits: set by the config file, not read once the command line's " \
           "changes apply; back at its default" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config.data.task is set but no stage of job rl with method grpo reads it (its "
        "settings read other data.* fields); expected it left at its default")
    assert not workdir.exists()
