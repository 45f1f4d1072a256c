"""End-to-end smoke runs of every job, each as `python -m jaxprefix.main` in a fresh workdir.

One smoke SFT base (configs/sft.py:smoke) is trained once per session and passed to every run
with --config.model.path, so each run tests its own job and not the SFT again. Nothing here is
expected to learn (the smoke policy is untrained); the checks are on what each job writes, and
on counts that follow from the smoke configs by hand. The demo pipeline and the IsoCompute sweep
are marked slow (`pytest -m slow tests/test_jobs.py`). The study jobs' smoke runs are in
test_job_studies.py; what both share in job_runs.py.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxprefix.checkpoints.train_state import TrainCheckpointer
from jaxprefix.rl.metrics import read_metrics
from tests.job_runs import (N, PROBLEMS_PER_STEP, ROOT, STEPS, check_rl_outputs,
                            mining_rollouts, rl_run, run_main, run_main_failing)


@pytest.fixture(scope="module")
def pope_run(base, tmp_path_factory):
    return rl_run("configs/pope.py:smoke", tmp_path_factory.mktemp("pope"), base,
                  "--config.eval.key_step_probe=True")


def test_grpo_smoke_then_resume(base, tmp_path):
    result = run_main("configs/grpo.py:smoke", tmp_path / "grpo", f"--config.model.path={base}")
    workdir = str(tmp_path / "grpo")
    # What the run will sample and train, before it does (one line, from the config).
    assert f"grpo: will train {STEPS} steps x {PROBLEMS_PER_STEP} contexts x {N} samples x " \
        f"up to " in result.stderr
    _, ledger = check_rl_outputs(workdir, STEPS, tags=("unguided",))
    assert ledger["rollouts"] == STEPS * PROBLEMS_PER_STEP * N
    assert ledger["extra_rollouts"] == mining_rollouts(workdir)  # train_on = 'hard'

    rl_run("configs/grpo.py:smoke", workdir, base, "--config.train.total_steps=3")
    records, ledger = check_rl_outputs(workdir, 3, tags=("unguided",))
    assert ledger["rollouts"] == 3 * PROBLEMS_PER_STEP * N  # continued, not restarted
    assert records[2]["tokens/sampled_total"] == sum(r["tokens/sampled"] for r in records)

    # Resuming under another learning rate used to continue silently, a different experiment.
    status, lines = run_main_failing("configs/grpo.py:smoke", workdir, f"--config.model.path={base}",
                                     "--config.train.total_steps=4",
                                     "--config.train.learning_rate=3e-4")
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {workdir} was made by another config") and \
        "train.learning_rate: 0.0001 -> 0.0003" in lines[0]
    assert read_metrics(workdir)[-1]["step"] == 3  # nothing ran


@pytest.mark.slow  # a MoE base's SFT and three runs: minutes on 2 cores
def test_moe_grpo_smoke_replays_its_routes_and_resumes_exactly(tmp_path):
    """configs/grpo.py:moe_smoke: a Qwen3-MoE base samples with its routes recorded and trains
    replaying them (old log-probs recomputed: in f32 they are the sampler's), with the router's
    load-balancing loss; stopped after step 1 and resumed, it retraces the straight run."""
    flags = ("--config.train.old_logprobs=learner", "--config.train.router_aux_coef=0.01",
             "--config.eval.every=0", "--config.mining.train_on=all")
    straight = str(tmp_path / "straight")
    run_main("configs/grpo.py:moe_smoke", straight, *flags)  # trains its base at straight/base
    base = os.path.join(straight, "base")
    with open(os.path.join(base, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_moe"
    resumed = rl_run("configs/grpo.py:moe_smoke", tmp_path / "resumed", base, *flags,
                     "--config.train.total_steps=1")
    rl_run("configs/grpo.py:moe_smoke", resumed, base, *flags)
    records, params = same_trajectory(straight, resumed)
    for r in records:
        assert r["rollout/logprob_mismatch_max"] < 1e-5 and r["router/aux_loss"] > 0
    assert any("router" in str(p) for p in params)


def same_trajectory(straight: str, resumed: str) -> tuple[list, dict]:
    """A straight run and one stopped and resumed wrote the same metrics (timings aside) and the
    same last checkpoint; returns the records and that checkpoint's parameters by path."""
    timing = ("time/", "throughput/")
    records = [{k: v for k, v in r.items() if not k.startswith(timing)}
               for r in read_metrics(straight)]
    assert records == [{k: v for k, v in r.items() if not k.startswith(timing)}
                       for r in read_metrics(resumed)]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    arrays = [TrainCheckpointer(os.path.join(w, "checkpoints")).restore(None, STEPS)[0]
              for w in (straight, resumed)]
    flat = [dict(jax.tree_util.tree_flatten_with_path(a["params"])[0]) for a in arrays]
    assert flat[0].keys() == flat[1].keys()
    for path, value in flat[0].items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(flat[1][path]), str(path))
    return records, flat[0]


# A reward the untrained smoke policy earns some of, unevenly: the groups have variance, so the
# adapters get gradients (the task's own verifier scores the smoke policy 0 everywhere).
SHARE_OF_ONES = "def reward(completion, problem):\n    return completion.count('1') / max(len(completion), 1)\n"


@pytest.mark.slow  # ~1.5 min on 2 cores: the default suite keeps the plain smoke resume
def test_grpo_lora_smoke_with_a_reward_file_resumes_exactly(base, tmp_path):
    reward_file = tmp_path / "elsewhere" / "my_rewards.py"
    reward_file.parent.mkdir()
    reward_file.write_text(SHARE_OF_ONES)
    flags = ("--config.train.lora_rank=8", f"--config.rewards.path={reward_file}:reward",
             "--config.eval.every=0", "--config.metrics.wandb=True",
             "--config.metrics.wandb_mode=offline")
    straight = rl_run("configs/grpo.py:smoke", tmp_path / "straight", base, *flags)
    resumed = rl_run("configs/grpo.py:smoke", tmp_path / "resumed", base, *flags,
                     "--config.train.total_steps=1")
    rl_run("configs/grpo.py:smoke", resumed, base, *flags)
    records, params = same_trajectory(straight, resumed)
    assert all(r["reward/mean"] > 0 and r["grad_norm"] > 0 for r in records)  # the file's reward
    # Checkpoints hold the adapters only: A and B of 7 projections.
    assert {p[0].key for p in params} == {"adapters"} and len(params) == 14
    assert any(np.abs(np.asarray(v)).max() > 0 for p, v in params.items() if "_b" in str(p))
    from test_wandb_writer import logged

    history, config = logged(resumed)  # W&B, offline: one run over both invocations
    assert sorted(history) == [1, 2] and config["train"]["lora_rank"] == 8
    assert history[2]["reward/mean"] == records[1]["reward/mean"]

    # What the eval and export jobs load: the trained adapters, or them folded into the base.
    from jaxprefix.run_setup.policy import load_policy
    from jaxprefix.models import lora
    from jaxprefix.errors import CheckpointError
    from jaxprefix.rl.loop import restore_trained, restore_trained_params
    from jaxprefix.run_config import from_file
    from jaxprefix.run_setup.learner_settings import lora_config, train_config

    config = from_file(os.path.join(ROOT, "configs", "grpo.py"), "smoke")
    config.model.path, config.train.lora_rank = base, 8
    policy = load_policy(config, resumed)
    learner, adapters = train_config(config), lora_config(config)
    step, trained = restore_trained(policy.model, resumed, learner, adapters)
    assert step == STEPS and lora.has_adapters(trained) and not lora.has_adapters(policy.model)
    tokens = np.arange(1, 13, dtype=np.int32).reshape(2, 6)
    adapted_logits = np.asarray(trained(tokens))
    assert np.abs(adapted_logits - np.asarray(policy.model(tokens))).max() > 0
    # A chosen step (the export job's export.step) must be one the workdir holds.
    assert restore_trained(policy.model, resumed, learner, adapters, step=STEPS)[0] == STEPS
    with pytest.raises(CheckpointError, match=rf"checkpoints has no step {STEPS + 1}: it holds"):
        restore_trained(policy.model, resumed, learner, adapters, step=STEPS + 1)
    assert restore_trained_params(policy.model, resumed, learner, adapters) == STEPS
    np.testing.assert_allclose(np.asarray(policy.model(tokens)), adapted_logits, atol=1e-4)


def test_sigterm_saves_and_exits_143_instead_of_finishing(base, tmp_path):
    """A preempted job (TPU maintenance, `timeout`) saves its step and exits 143, so a pipeline
    of runs (demo, results) stops there rather than starting its next run."""
    workdir = tmp_path / "grpo"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
         f"--workdir={workdir}", f"--config.model.path={base}",
         "--config.train.total_steps=100000", "--config.checkpoint.every=100000"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.time() < deadline, "no step was logged"
        time.sleep(0.5)
    # A second run on the workdir used to interleave its steps with the first one's.
    status, lines = run_main_failing("configs/grpo.py:smoke", workdir, f"--config.model.path={base}",
                                     "--config.train.total_steps=100000",
                                     "--config.checkpoint.every=100000")
    assert status == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"error: {os.path.abspath(workdir)} is in use by another run") \
        and f"pid {process.pid}," in lines[0]
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 143, stderr[-2000:]
    assert "rerun the same command to resume" in stderr
    last = read_metrics(str(workdir))[-1]["step"]
    assert TrainCheckpointer(str(workdir / "checkpoints")).latest_step() == last
    assert not (workdir / "compute.json").exists()  # written only by a finished run


def test_misspelt_config_field_is_one_line(tmp_path):
    status, lines = run_main_failing("configs/grpo.py:smoke", tmp_path / "w",
                                     "--config.train.learnin_rate=1e-3")
    assert status == 2 and lines == [
        "error: --config.train.learnin_rate=1e-3: no such config field 'train.learnin_rate'; "
        "expected a field of the config file (python -m jaxprefix.main "
        "--config=configs/grpo.py:smoke --config.job=describe lists them) (nearest: "
        "'train.learning_rate', 'train.min_lr_ratio', 'train.lora_rank')"]


def test_malformed_data_file_fails_in_seconds_before_sft_writing_nothing(tmp_path):
    # No --config.model.path: a run that got past the data would train its SFT base first.
    bad = tmp_path / "problems.jsonl"
    bad.write_text('{"question": "2+2?", "answer": "4"}\n{"question": "3+3?", "answer": \n')
    workdir = tmp_path / "w"
    started = time.monotonic()
    status, lines = run_main_failing("configs/grpo.py:smoke", workdir, "--config.data.source=file",
                                     f"--config.data.path={bad}", "--config.data.verifier=math")
    seconds = time.monotonic() - started
    assert status == 1 and lines == [
        f"error: {bad}:line 2: malformed JSON: Expecting value at column 1"], lines
    assert seconds < 10, f"{seconds:.1f} s"  # the bound, interpreter start included
    assert not workdir.exists()


def test_disk_full_names_the_path_and_the_bytes(base, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs is not allowed here")
    try:
        status, lines = run_main_failing("configs/grpo.py:smoke", disk / "run",
                                         f"--config.model.path={base}")
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert status == 1 and len(lines) == 1, lines
    assert re.fullmatch(rf"error: disk full: {disk}/run/checkpoints needs [0-9.]+ MiB, [0-9.]+ "
                        rf"KiB free there; free space or use another --workdir", lines[0]), lines


def test_pope_smoke(pope_run):
    records, ledger = check_rl_outputs(pope_run, STEPS, tags=("guided", "unguided"))
    # 1 guided + 1 unguided context per problem.
    assert ledger["rollouts"] == STEPS * PROBLEMS_PER_STEP * 2 * N
    assert ledger["extra_rollouts"] == mining_rollouts(pope_run)
    assert ledger["extra_flops"] > 0
    # eval.key_step_probe: the teacher-forced figures at each evaluation, and only there.
    evaluated = [r for r in records if "eval/pass@1" in r]
    assert [r["step"] for r in records if "probe/key_step" in r] == [r["step"] for r in evaluated]
    for r in evaluated:
        assert 0 <= r["probe/success"] <= r["probe/key_step"] <= 1
        assert 0 <= r["probe/key_name"] * r["probe/key_digits"] <= r["probe/key_step"]


def test_prefixrl_smoke(base, tmp_path):
    workdir = rl_run("configs/prefixrl.py:smoke", tmp_path / "prefixrl", base)
    _, ledger = check_rl_outputs(workdir, STEPS, tags=("guided", "unguided"))
    # 3 prefixed + 1 plain context per problem; oracle traces cost no sampling.
    assert ledger["rollouts"] == STEPS * PROBLEMS_PER_STEP * 4 * N
    assert ledger["extra_rollouts"] == mining_rollouts(workdir)


def test_eval_job_on_a_trained_workdir(pope_run, base):
    run_main("configs/eval.py:smoke", pope_run, f"--config.model.path={base}")
    with open(os.path.join(pope_run, "eval_report.json")) as f:
        report = json.load(f)
    assert report["step"] == STEPS and report["problems"] == 4  # the latest RL checkpoint
    unguided = report["unguided"]
    assert unguided["num_problems"] == 4 and unguided["num_samples"] == 4
    for key in ("pass@1", "pass@4", "avg@4", "best@4", "worst@4"):
        assert 0.0 <= unguided[key] <= 1.0, key
    assert "guided_train" in report  # the workdir holds mined prefixes
