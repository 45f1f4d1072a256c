"""End-to-end smoke runs of every job, each as `python -m jaxprefix.main` in a fresh workdir.

One smoke SFT base (configs/sft.py:smoke) is trained once per session and passed to every run
with --config.model.path, so each run tests its own job and not the SFT again. Nothing here is
expected to learn (the smoke policy is untrained); the checks are on what each job writes, and
on counts that follow from the smoke configs by hand. The demo pipeline and the IsoCompute sweep
are marked slow (`pytest -m slow tests/test_jobs.py`).
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxprefix.checkpoints.train_state import TrainCheckpointer
from jaxprefix.studies.results_report import NOTES_MARKER, prefix_search_lines
from jaxprefix.rl.compute_ledger import ComputeLedger
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


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """The smoke SFT policy: an HF directory every other run starts from."""
    workdir = tmp_path_factory.mktemp("sft")
    run_main("configs/sft.py:smoke", workdir)
    path = workdir / "base"
    assert {"config.json", "model.safetensors", "task_tokenizer.json",
            "sft_report.json"} <= set(os.listdir(path))
    return str(path)


@pytest.fixture(scope="session")
def carry_base(tmp_path_factory):
    """The smoke SFT policy of carry_multiplication (the IsoCompute sweep's task)."""
    workdir = tmp_path_factory.mktemp("sft_carry")
    run_main("configs/sft.py:carry_smoke", workdir)
    return str(workdir / "base")


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


@pytest.fixture(scope="module")
def pope_run(base, tmp_path_factory):
    return rl_run("configs/pope.py:smoke", tmp_path_factory.mktemp("pope"), base,
                  "--config.eval.key_step_probe=True")


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


def check_png(path: str):
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE, path
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_demo_pipeline_smoke(base, tmp_path):
    workdir = tmp_path / "demo"
    run_main("configs/pope.py:demo_smoke", workdir, f"--config.model.path={base}")
    with open(workdir / "demo_report.json") as f:
        report = json.load(f)
    assert sorted(report["runs"]) == ["grpo", "pope"]
    assert report["hard_set"]["candidates"] == CANDIDATES and report["hard_set"]["k"] == K
    for run in report["runs"].values():
        assert run["steps"] == STEPS and "pass@4" in run["after"]
    # The same rollouts a step (GRPO takes twice the problems of POPE's 1 guided : 1 unguided
    # batches), and GRPO runs on until one more step would pass POPE's FLOPs.
    pope, grpo = report["runs"]["pope"], report["runs"]["grpo"]
    assert pope["ledger"]["rollouts"] == STEPS * PROBLEMS_PER_STEP * 2 * N
    assert grpo["ledger"]["rollouts"] == grpo["steps"] * PROBLEMS_PER_STEP * 2 * N
    total = lambda run: run["ledger"]["sampling_flops"] + run["ledger"]["update_flops"] + \
        run["ledger"]["extra_flops"]
    grpo_records = read_metrics(str(workdir / "grpo"))
    step = max(r["flops/sampling"] + r["flops/update"] for r in grpo_records)
    assert total(grpo) <= total(pope) < total(grpo) + step and grpo["steps"] >= STEPS
    table = (workdir / "demo_report.md").read_text()
    assert table.startswith("Held-out hard problems") and "a solvable oracle prefix for " in table
    assert "| policy | pass@1 | pass@4 |" in table
    for row in ("| base (SFT) | 0.", "| POPE (2 steps) |", f"| GRPO ({grpo['steps']} steps) |"):
        assert row in table, row
    check_png(str(workdir / "demo_curves.png"))
    assert [r["step"] for r in read_metrics(str(workdir / "pope"))] == [1, 2]


def test_results_pipeline_smoke(base, tmp_path):
    """Runs of the results job at smoke sizes, PrefixRL's regime and its SFT warm start included:
    its files exist and are well formed, each run is charged for the mining it uses, and the warm
    start's SFT is charged in its run's FLOPs."""
    workdir = tmp_path / "results"
    workdir.mkdir()
    notes = f"{NOTES_MARKER}\n## Notes\nwritten by hand\n"
    (workdir / "REPORT.md").write_text("# an older report\n\n" + notes)
    names = ["grpo", "pope_cap1", "pope_cap0.25", "grpo_easy", "sft_oracle", "prefixrl_regime",
             "sft_traces_regime"]
    run_main("configs/results.py:smoke", workdir, f"--config.model.path={base}",
             f"--config.results.runs=({','.join(repr(n) for n in names)})")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    assert sorted(report["runs"]) == sorted(f"{name}_seed0" for name in names)
    for run in report["runs"].values():
        assert "pass@4" in run["after"] and "pass@4" in run["after_hard_set"], run["name"]
        assert run["curve"] and "flops" in run["curve"][-1], run["name"]
        assert read_metrics(str(workdir / f"{run['name']}_seed0"))[-1]["step"] == STEPS
    # Each method pays for the mining it uses: GRPO the hard set, POPE also its own cap's prefix
    # search, hard + easy (POPE with no guided copies) no prefixes.
    with open(workdir / "mining" / "ledger.json") as f:
        costs = {name: ledger["extra_rollouts"] for name, ledger in json.load(f).items()}
    assert set(costs) == {"hard_set", PREFIX_SEARCH, CAP1_SEARCH}
    assert costs[PREFIX_SEARCH] == mining_rollouts(workdir) - K * CANDIDATES
    charged = {run["name"]: run["ledger"]["extra_rollouts"] for run in report["runs"].values()}
    assert charged["grpo"] == charged["sft_oracle"] == charged["grpo_easy"] == costs["hard_set"]
    assert charged["pope_cap1"] == costs["hard_set"] + costs[CAP1_SEARCH]
    assert charged["pope_cap0.25"] == costs["hard_set"] + costs[PREFIX_SEARCH]
    with open(workdir / "sft_oracle_seed0" / "warm_start" / "warm_start.json") as f:
        warm = json.load(f)
    assert warm["flops"] > 0 and len(warm["losses"]) == warm["steps"] > 0
    assert warm["warmup_steps"] == max(1, round(0.3 * warm["steps"]))  # configs/results.py
    sft_run, grpo_run = report["runs"]["sft_oracle_seed0"], report["runs"]["grpo_seed0"]
    assert "pass@4" in sft_run["warm_start"]
    assert sft_run["ledger"]["extra_flops"] == pytest.approx(
        grpo_run["ledger"]["extra_flops"] + warm["flops"])
    # PrefixRL's regime: its own hard set, evaluated in-run on that training hard set.
    regime = report["studies"]["prefixrl"]
    assert regime["digits"] == [report["regime_probe"]["chosen"]] * 2
    assert "hard_set/pass@1" in report["runs"]["prefixrl_regime_seed0"]["curve"][-1]
    assert "pass@4" in report["runs"]["sft_traces_regime_seed0"]["warm_start_hard_set"]
    # SFT on traces pays for its data as PrefixRL does (here oracle traces, free), plus its SFT.
    with open(workdir / "sft_traces_regime_seed0" / "warm_start" / "warm_start.json") as f:
        sft_flops = json.load(f)["flops"]
    assert report["runs"]["sft_traces_regime_seed0"]["ledger"]["extra_flops"] == pytest.approx(
        report["runs"]["prefixrl_regime_seed0"]["ledger"]["extra_flops"] + sft_flops)
    text = (workdir / "REPORT.md").read_text()
    assert text.endswith("\n" + notes) and "an older report" not in text  # notes kept
    assert "{" not in text, "a template left unformatted"  # 'Hard set: {study[...]}' was
    for name in names:
        assert f"| {name} | 1 |" in text, name
    assert "| sft_oracle: after SFT, before RL | 1 |" in text
    for name in names:  # every cell: mean [95% interval]
        assert re.search(rf"\| {name} \| 1 \| \d\.\d{{3}} \[\d\.\d{{3}}, \d\.\d{{3}}\]", text), name
    assert "Paired differences" in text and "by multiplier" in text
    check_png(str(workdir / "curves.png"))
    check_png(str(workdir / "regime_curves.png"))


def test_prefixrl_controls_smoke(base, tmp_path):
    """PrefixRL's controls: the second base has another shape and is charged its SFT and its
    sampling; the more-SFT control's problems are ones the base solves, charged their sampling;
    every arm runs to one FLOPs total (results.regime.flops_budget)."""
    workdir = tmp_path / "controls"
    names = ["grpo_regime", "sft_more_regime", "prefixrl_other_regime", "sft_other_traces_regime"]
    budget = 4e9
    run_main("configs/results.py:smoke", workdir, f"--config.model.path={base}",
             f"--config.results.runs=({','.join(repr(n) for n in names)})",
             f"--config.results.regime.flops_budget={budget}")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    regime = report["studies"]["prefixrl"]
    other = regime["other_trace_pool"]
    assert other["shape"] == {"layers": 4, "width": 48, "mlp_width": 192}  # configs/results.py
    assert other["sft_flops"] > 0 and other["flops"] == pytest.approx(
        other["sft_flops"] + other["sampling_flops"])
    with open(workdir / "other_base" / "base" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 4
    ran = [r for r in report["runs"].values() if "ledger" in r]
    assert "grpo_regime" in {r["name"] for r in ran}
    for run in ran:  # each to the budget: within one step of it, never past it
        total = ComputeLedger.from_dict(run["ledger"]).total_flops
        step = max(r["flops/sampling"] + r["flops/update"]
                   for r in read_metrics(str(workdir / f"{run['name']}_seed0")))
        assert budget - step < total <= budget, run["name"]
    # The smoke bases solve nothing at this length: both pools come out empty, their arms say
    # so, and the searches were made (and cost what the stats say).
    solved = regime["solved_pool"]
    assert solved["tried"] > 0 and solved["flops"] > 0 and other["samples"] > 0
    runs = report["runs"]
    assert (solved["problems"] == 0) == ("skipped" in runs["sft_more_regime_seed0"])
    assert (other["problems"] == 0) == ("skipped" in runs["prefixrl_other_regime_seed0"])
    text = (workdir / "REPORT.md").read_text()
    assert "to 4e+09 FLOPs in all" in text and "4 layers of width 48" in text


def test_eps_sweep_smoke(base, tmp_path):
    """The overlap axis' runs: both hints on the restating notation, GRPO to the larger's FLOPs,
    the key-step probe in every curve and of the base."""
    workdir = tmp_path / "eps"
    run_main("configs/results.py:eps_smoke", workdir, f"--config.model.path={base}")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    runs = {r["name"]: r for r in report["runs"].values()}
    assert sorted(runs) == ["grpo_matched_hints", "pope_restating_hint", "pope_value_hint"]
    total = {n: ComputeLedger.from_dict(r["ledger"]).total_flops for n, r in runs.items()}
    spent = max(total["pope_restating_hint"], total["pope_value_hint"])
    matched = runs["grpo_matched_hints"]
    assert matched["flops_budget"] == pytest.approx(spent - report["studies"]["hard"]["mining"]
                                                    ["hard_set"]["extra_flops"])
    assert total["grpo_matched_hints"] <= spent
    for run in runs.values():
        assert 0 <= run["curve"][-1]["probe/success"] <= run["curve"][-1]["probe/key_step"] <= 1
    assert report["studies"]["hard"]["base_probe"]["probe/key_name"] > 0
    # Each POPE arm's guided contexts, counted in training (issue 43).
    for name in ("pope_restating_hint", "pope_value_hint"):
        if "after" in runs[name]:
            assert 0 <= runs[name]["guided_contexts"] <= runs[name]["contexts"] / 2
    # The phase table and figure, from the level's committed counts alone.
    from jaxprefix.jobs import eps_phase

    assert eps_phase.main(["eps_phase", str(tmp_path)]) == 0
    phase = (tmp_path / "PHASE.md").read_text()
    for hint in ("value hint", "restating hint"):
        assert re.search(rf"\| {hint} \| (-|\d\.\d\d[^|]*) \| 1 \| [+-]\d\.\d{{3}} \[", phase), hint
    check_png(str(tmp_path / "phase.png"))


def test_sft_baselines_pay_for_the_mining_their_examples_came_from(base, tmp_path):
    """SFT on traces is charged PrefixRL's rejection sampling, SFT on own guided answers POPE's
    prefix search, SFT on oracle solutions nothing (they used to be charged none of it: in the
    study, SFT-on-traces-then-RL ran 1.1e12 FLOPs cheaper than PrefixRL on the same traces)."""
    from jaxprefix import variants
    from jaxprefix.jobs.results import warm_start_mining
    from jaxprefix.studies.study import Study

    config = variants.method_config(os.path.join(ROOT, "configs", "results.py"), "pope",
                                      "smoke")[0]
    config.model.path = base
    config.prefixrl.update(variants.SMOKE_PREFIXRL)  # what configs/results.py:smoke sets
    config.prefixrl.oracle_traces = False  # rejection sampling, as the study mines its pool
    study = Study.prepare(config, str(tmp_path), trace_pool=True)
    with open(tmp_path / "mining" / "ledger.json") as f:
        mined = {name: ledger["extra_flops"] for name, ledger in json.load(f).items()}
    assert mined["trace_pool"] > 0 and mined[PREFIX_SEARCH] > 0
    assert warm_start_mining(study, "traces").extra_flops == mined["trace_pool"]
    assert warm_start_mining(study, "own_guided").extra_flops == mined[PREFIX_SEARCH]
    assert warm_start_mining(study, "oracle").extra_flops == 0


@pytest.mark.slow  # ~100 s: four GRPO runs, then the fit
def test_isocompute_sweep_and_fit_smoke(carry_base, tmp_path):
    workdir = tmp_path / "iso"
    run_main("configs/isocompute.py:smoke", workdir, f"--config.model.path={carry_base}")
    with open(workdir / "frontier.json") as f:
        frontier = json.load(f)
    # budgets (32, 64), ns (2, 4), batches (4, 8): each (n, B) runs once at the largest budget.
    points = [(2, 4), (2, 8), (4, 4), (4, 8)]
    assert sorted((r["n"], r["batch"]) for r in frontier["runs"]) == points
    assert sorted(os.listdir(workdir / "runs")) == ["n2_b4_s0", "n2_b8_s0", "n4_b4_s0", "n4_b8_s0"]
    # The smoke base solves nothing, so every eval curve is flat at 0 and there is no frontier to
    # fit: frontier.json says why (the fit itself is tested on known sigmoids in
    # test_isocompute.py).
    assert all(max(r["reward"]) == 0.0 for r in frontier["runs"])
    assert frontier["fit"] is None and "record-breaking" in frontier["reason"]


def test_printed_sweep_commands_run(carry_base, tmp_path):
    """print_only prints one command per point; running one (as printed) trains exactly that
    point: its n, B, M, scaled learning rate and evaluation schedule."""
    workdir = tmp_path / "iso"
    printed = run_main("configs/isocompute.py:smoke", workdir, f"--config.model.path={carry_base}",
                       "--config.isocompute.print_only=True").stdout.strip().splitlines()
    assert len(printed) == 4  # (n, B) in {2, 4} x {4, 8}, one seed
    command = next(line for line in printed if "n4_b8_s0" in line)
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "jaxprefix.main"]
    result = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workdir / "runs" / "n4_b8_s0"
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2]  # M = 64 // (4 x 8)
    assert records[-1]["lr"] == pytest.approx(1e-4 * (32 / 512) ** 0.5)  # the sqrt rule
    assert "eval/avg@4" in records[0]  # every 16 rollouts: every step
    with open(run_dir / "compute.json") as f:
        assert json.load(f)["rollouts"] == 64


@pytest.mark.slow  # ~1.3 min on 2 cores; test_isocompute checks the allocation itself
def test_allocated_run_spends_its_budget(base, tmp_path):
    """isocompute.budget sets n, B and M from the fitted rule in frontier_path; the run spends
    that budget (rollouts: exactly n B M <= budget < n B (M + 1); FLOPs: within one step)."""
    rule = {"n_curve": {"floor": 2.0, "ceiling": 2.0, "center": 10.0, "width": 1.0},
            "batch": 2, "flops_per_rollout": 5e7}  # n = 4, B = 2
    frontier = tmp_path / "frontier.json"
    frontier.write_text(json.dumps({"allocation": rule}))
    flags = (f"--config.isocompute.frontier_path={frontier}", "--config.eval.every=0")
    workdir = rl_run("configs/grpo.py:smoke", tmp_path / "rollouts", base,
                     "--config.isocompute.budget=30", *flags)
    with open(os.path.join(workdir, "compute.json")) as f:
        assert json.load(f)["rollouts"] == 4 * 2 * 3  # M = 30 // 8
    assert len(read_metrics(workdir)) == 3
    budget = 2e9  # about 3 steps of 8 rollouts of the smoke policy
    workdir = rl_run("configs/grpo.py:smoke", tmp_path / "flops", base,
                     f"--config.isocompute.budget={budget}", "--config.isocompute.budget_unit=flops",
                     *flags)
    with open(os.path.join(workdir, "compute.json")) as f:
        ledger = json.load(f)
    records = read_metrics(workdir)
    step = max(r["flops/sampling"] + r["flops/update"] for r in records)
    spent = ledger["sampling_flops"] + ledger["update_flops"]
    assert abs(budget - spent) <= step and len(records) >= 2
    assert records[-1]["flops/total"] == pytest.approx(spent)


def test_prefix_search_table_counts_a_prefix_at_a_cap_under_that_cap():
    study = {"hard": 8, "prefix_searches": {"prefixes_instruction_default_f0.5": {
        "found": 5, "revealed_fractions": [0.25, 0.3, 0.5, 0.5, 0.95]}}}
    row = prefix_search_lines(study)[-2]
    assert row.endswith("| 1 | 3 | 0 | 1 |"), row  # (0, .25] (.25, .5] (.5, .75] (.75, 1]


# configs/tools.py:smoke (the tools study at smoke sizes): its own smoke SFT base with tool
# episodes, then GRPO with tools (3 steps) and GRPO without (on to the tools arm's FLOPs).
TOOL_ARMS = ("tools_seed0", "no_tools_seed0")
TOOL_METRICS = ("rollout/tool_calls", "rollout/turns_mean", "rollout/tool_failures",
                "rollout/reprefilled_tokens")


@pytest.fixture(scope="module")
def tool_study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tools")
    run_main("configs/tools.py:smoke", workdir)
    return workdir


def test_tool_study_smoke_from_a_fresh_workdir(tool_study):
    """Every row of both arms carries the tool metrics (the no-tools arm: one turn, no call); the
    ledger books the tools arm's prefilled observations and re-prefills; the no-tools arm stops
    before it would pass the tools arm's FLOPs; the report compares them."""
    for arm in TOOL_ARMS:
        records = read_metrics(str(tool_study / arm))
        assert all(key in r for r in records for key in TOOL_METRICS)
        ledger = json.loads((tool_study / arm / "compute.json").read_text())
        assert ledger["sampled_tokens"] == sum(r["tokens/sampled"] for r in records)
    tools = read_metrics(str(tool_study / "tools_seed0"))
    none = read_metrics(str(tool_study / "no_tools_seed0"))
    assert [r["step"] for r in tools] == [1, 2, 3]
    assert all(r["rollout/turns_mean"] == 1 and r["rollout/tool_calls"] == 0 for r in none)
    # an episode's tokens: every sampled one, and the prompt, observations and re-prefills
    assert all(r["tokens/sampled"] > r["tokens/generated"] + r["rollout/reprefilled_tokens"]
               for r in tools)
    spent = [json.loads((tool_study / arm / "compute.json").read_text()) for arm in TOOL_ARMS]
    total = [ComputeLedger.from_dict(s).total_flops for s in spent]
    last_step = none[-1]["flops/sampling"] + none[-1]["flops/update"]
    assert total[1] <= total[0] < total[1] + last_step
    report = json.loads((tool_study / "tool_study_report.json").read_text())
    assert set(report["base"]) == {"tools", "no_tools"}
    assert [r["steps"] for r in report["runs"]["tools"]] == [3]
    assert "GRPO with tools − GRPO without tools" in \
        (tool_study / "tool_study_report.md").read_text()


@pytest.mark.slow  # two smoke studies: a few minutes on 2 cores
def test_tool_study_smoke_resumes_after_sigterm_to_the_same_rows(tool_study, tmp_path):
    """SIGTERM in the tools arm's second step: it saves and exits 143; the same command then
    resumes both arms, and every metrics row equals the uninterrupted study's (times aside)."""
    workdir = tmp_path / "tools"
    base = f"--config.model.path={tool_study / 'base'}"  # the same base, not trained again
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/tools.py:smoke",
         f"--workdir={workdir}", base], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    metrics = workdir / "tools_seed0" / "metrics.jsonl"
    deadline = time.time() + 900
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.time() < deadline, "no step was logged"
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 143, stderr[-2000:]
    assert len(read_metrics(str(workdir / "tools_seed0"))) < 3
    run_main("configs/tools.py:smoke", workdir, base)

    def rows(root, arm):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_metrics(str(root / arm))]
    for arm in TOOL_ARMS:
        assert rows(workdir, arm) == rows(tool_study, arm), arm
    reports = [json.loads((w / "tool_study_report.json").read_text())
               for w in (workdir, tool_study)]
    assert reports[0]["runs"] == reports[1]["runs"] and reports[0]["base"] == reports[1]["base"]
