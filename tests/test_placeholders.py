"""Placeholders (gs://YOUR_BUCKET/...) are refused in one line naming the field, by a job that
must read them, before any storage client is asked; a job that does not read one ignores it."""
import os
import subprocess
import sys

import pytest

from jaxprefix import run_config, storage
from jaxprefix.errors import ConfigError
from jaxprefix.run_setup import preflight

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def paper(**fields):
    config = run_config.from_file(os.path.join(ROOT, "configs", "pope.py"), "paper")
    for name, value in fields.items():
        block, _, leaf = name.rpartition("__")
        (config[block] if block else config)[leaf] = value
    return config


def test_placeholder_buckets():
    assert storage.is_placeholder("gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507")
    assert storage.is_placeholder("gs://MY_BUCKET/x.jsonl")
    assert not storage.is_placeholder("gs://my-bucket/YOUR_BUCKET")
    assert not storage.is_placeholder("/data/YOUR_BUCKET/x.jsonl")


def test_every_placeholder_the_rl_job_reads_is_named_in_one_error():
    with pytest.raises(ConfigError) as e:
        preflight.refuse_placeholders(paper(), "/tmp/w")
    assert str(e.value) == (
        "config.data.path='gs://YOUR_BUCKET/hard_problems.jsonl', "
        "config.model.path='gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507': placeholders the rl job "
        "reads; expected paths of your own (--config.data.path=... --config.model.path=...)")


def test_unread_placeholders_pass():
    # the compile job reads its own block only; reasoning_gym reads no data path
    preflight.refuse_placeholders(paper(job="compile"), "/tmp/w")
    preflight.refuse_placeholders(
        paper(data__source="reasoning_gym", data__task="gsm_symbolic", model__path="/m"), "/tmp/w")
    with pytest.raises(ConfigError, match="compile.model_config"):
        preflight.refuse_placeholders(
            paper(job="compile", compile__model_config="gs://YOUR_BUCKET/config.json"), "/tmp/w")
    with pytest.raises(ConfigError, match="--workdir=gs://MY_BUCKET/run"):
        preflight.refuse_placeholders(paper(job="compile"), "gs://MY_BUCKET/run")


def test_an_eval_set_not_given_is_not_read():
    config = paper()
    assert config.data.eval_path == ""  # the paper's AIME 25 set only when given
    assert "data.eval_path" not in dict(preflight.read_paths(config))


def test_main_refuses_a_placeholder_in_one_line_writing_nothing(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:paper",
         f"--workdir={tmp_path / 'w'}", f"--config.data.path={tmp_path / 'p.jsonl'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and lines == [
        "error: config.model.path='gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507': a placeholder the "
        "rl job reads; expected paths of your own (--config.model.path=...)"], result.stderr
    assert not (tmp_path / "w").exists()


def test_compile_takes_the_shipped_config_of_a_placeholder_model_path():
    from jaxprefix.jobs import compile as compile_job
    from jaxprefix.models import published

    config = paper(job="compile", compile__topology="v6e-8")
    assert compile_job.hf_config(config) == published.hf_config("Qwen3-4B-Instruct-2507")
    assert compile_job.run_model_config(config).model_type == "qwen3"
