"""The Python door (jaxprefix/api.py): a run from Python on main's path, a callable as reward."""
import pytest

from jaxprefix import api, run_config
from jaxprefix.errors import ConfigError
from tests.job_runs import N, PROBLEMS_PER_STEP, ROOT, STEPS


def test_a_run_from_python_trains_with_a_callable_reward(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config path is the repository's; nothing lands in it
    calls = []

    def quarter(completion: str, problem) -> float:  # a closure: scored in this process
        calls.append(problem)
        return 0.25

    config = run_config.from_file(f"{ROOT}/configs/grpo.py", "smoke")
    rows = api.run(config, str(tmp_path / "run"), reward=quarter,
                   overrides={"model.path": base, "train.total_steps": str(STEPS)})
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["reward/mean"] == pytest.approx(0.25) for r in rows)  # this reward, no other
    assert len(calls) >= STEPS * PROBLEMS_PER_STEP * N
    assert not config.data.verifier.startswith("python:")  # the caller's config untouched
    from jaxprefix import rewards

    assert not [n for n in rewards.names() if n.startswith("python:")]  # nor the verifiers
    # Again: it resumes from the last checkpoint and trains nothing twice.
    again = api.run(config, str(tmp_path / "run"), reward=quarter,
                    overrides={"model.path": base, "train.total_steps": STEPS})
    assert [r["step"] for r in again] == [r["step"] for r in rows]


def test_overrides_take_command_line_text_and_refuse_what_the_config_lacks():
    config = run_config.base_config()
    api.set_field(config, "train.total_steps", "7")
    api.set_field(config, "train.skip_zero_advantage", "false")
    assert config.train.total_steps == 7 and config.train.skip_zero_advantage is False
    with pytest.raises(ConfigError, match="no such config field"):
        api.set_field(config, "train.total_stepz", 1)
    with pytest.raises(ConfigError, match="expected a value of type int"):
        api.set_field(config, "train.total_steps", "many")


def test_a_config_built_in_python_needs_a_workdir():
    with pytest.raises(TypeError, match="needs a workdir"):
        api.run(run_config.base_config())
