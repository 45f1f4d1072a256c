"""configs/*.py: every variant builds and passes the loop's checks; bad input is named.

The command-line cases run `python -m jaxprefix.main` as a subprocess: a misspelt field and a
value the loop rejects must both stop the run before anything is loaded or written.
"""
import glob
import importlib
import os
import re
import subprocess
import sys

import ml_collections
import pytest

from jaxprefix import main as entry
from jaxprefix import run_config
from jaxprefix.run_setup import preflight
from jaxprefix.run_setup import run_settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
# file -> (variant -> (job, method)); '' is the file's default variant.
VARIANTS = {
    "grpo.py": {v: ("rl", "grpo") for v in ("", "demo", "smoke", "moe_smoke", "smollm2", "paper",
                                            "colab")},
    "prefixrl.py": {v: ("rl", "prefixrl") for v in ("", "demo", "smoke", "smollm2", "paper")},
    "pope.py": {"": ("demo", "pope"), "demo": ("demo", "pope"), "demo_smoke": ("demo", "pope"),
                "rl": ("rl", "pope"), "smoke": ("rl", "pope"), "smollm2": ("rl", "pope"),
                "paper": ("rl", "pope"), "paper_moe": ("rl", "pope"), "colab": ("rl", "pope")},
    "eval.py": {v: ("eval", "pope") for v in ("", "demo", "smoke", "smollm2", "paper")},
    "isocompute.py": {"": ("sweep", "grpo"), "smoke": ("sweep", "grpo"),
                      "smollm2": ("sweep", "grpo"), "paper": ("sweep", "grpo"),
                      "fit": ("fit", "grpo")},
    "sft.py": {v: ("sft", None) for v in ("", "demo", "smoke", "tools", "tools_smoke")},
    "results.py": {v: ("results", "pope") for v in ("", "demo", "smoke", "overlap",
                                                   "smollm2_hard")},
    "tools.py": {"": ("tools", "grpo"), "study": ("tools", "grpo"), "smoke": ("tools", "grpo"),
                 "rl": ("rl", "grpo")},
    "serve.py": {v: ("serve", "grpo") for v in ("", "smollm2", "hf", "tpu")},
}


def build(name: str, variant: str = "") -> ml_collections.ConfigDict:
    return run_config.from_file(os.path.join(CONFIGS, name), variant)


def test_every_config_file_is_covered():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(CONFIGS, "*.py"))) == \
        sorted(VARIANTS)


@pytest.mark.parametrize("name,variant", [(n, v) for n, vs in VARIANTS.items() for v in vs])
def test_variant_builds_and_passes_the_loop_checks(name, variant):
    config = build(name, variant)
    job, method = VARIANTS[name][variant]
    assert config.job == job and config.get("method") == method
    assert config.job in entry.JOBS
    if job != "sft":
        run_settings.resolve(config)  # raises, naming the field, on any value a run cannot use
    if job in preflight.FIELDS_CHECKED:  # a variant sets no field its job leaves unread
        assert preflight.unread(config) == []
    if "smoke" in variant and job != "sft":
        assert config.data.train_size <= 16
        assert config.sft.max_steps == build("sft.py", "smoke").max_steps
        if job != "eval":  # the eval job's training fields are at their defaults, unread
            assert config.train.total_steps <= 3


def test_every_job_resolves_to_a_function():
    for job, (module, function) in entry.JOBS.items():
        assert callable(getattr(importlib.import_module(f"jaxprefix.jobs.{module}"), function)), job


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "sft.py"])
def test_unknown_variant_is_named(name):
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: unknown variant 'smok'"):
        build(name, "smok")


def test_unknown_sft_variant_is_named():
    with pytest.raises(ValueError, match="configs/sft.py: unknown variant 'paper'"):
        build("sft.py", "paper")


def test_parse_arg():
    args = run_config.parse_arg("smollm2,seed=3")
    assert args.variant == "smollm2" and args.seed == 3 and isinstance(args.seed, int)
    args = run_config.parse_arg("lr=1e-4,flag=true,name=x", variant="demo")
    assert (args.variant, args.lr, args.flag, args.name) == ("demo", 1e-4, True, "x")
    assert run_config.parse_arg("", variant="demo").variant == "demo"
    with pytest.raises(ValueError, match="only the first item may be a bare variant name"):
        run_config.parse_arg("smoke,smollm2")


def test_seed_argument_reaches_the_config():
    assert build("grpo.py", "smoke,seed=3").seed == 3
    assert build("pope.py", "rl").seed == 0


def test_default_workdir():
    assert entry.default_workdir("configs/pope.py:smoke,seed=1") == \
        os.path.join("runs", "pope-smoke")
    assert entry.default_workdir("configs/grpo.py") == os.path.join("runs", "grpo-demo")


def docstring_commands():
    """(file, variant, overrides) of every `python -m jaxprefix.main` line in a config's docs."""
    for path in sorted(glob.glob(os.path.join(CONFIGS, "*.py"))):
        with open(path) as f:
            text = f.read()
        for match in re.finditer(r"--config=configs/(\w+\.py)(?::([\w,=]+))?", text):
            yield os.path.basename(path), match.group(1), match.group(2) or ""
        for match in re.finditer(r"--config\.([\w.]+)=", text):
            yield os.path.basename(path), None, match.group(1)


@pytest.mark.parametrize("source,name,arg", list(docstring_commands()))
def test_documented_commands_name_real_variants_and_fields(source, name, arg):
    if name is not None:
        build(name, arg)
        return
    config = build(source, "smoke" if "smoke" in VARIANTS[source] else "")
    node = config
    for key in arg.split("."):
        assert key in node, f"{source} documents --config.{arg}, which is no field"
        node = node[key]


def run_main(*flags, workdir):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxprefix.main", f"--workdir={workdir}", *flags],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_locked_config_refuses_a_misspelt_field(tmp_path):
    workdir = tmp_path / "run"
    result = run_main("--config=configs/grpo.py:smoke", "--config.train.nope=1", workdir=workdir)
    assert result.returncode != 0
    assert "nope" in result.stderr
    assert not workdir.exists()


def test_a_field_the_job_does_not_read_is_refused_before_any_work(tmp_path):
    workdir = tmp_path / "run"
    result = run_main("--config=configs/grpo.py:smoke", "--config.pope.unsolved=longest",
                      workdir=workdir)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: config.pope.unsolved is set but no stage of job rl with method grpo reads it "
        "(only pope read pope.*); expected it left at its default")
    assert not workdir.exists()


@pytest.mark.parametrize("config,flags,line", [
    ("results.py:smoke", ("--config.rollout.max_turns=2", "--config.tools.names=('read_key',)",
                          "--config.tools.environment=keyed_multiplication"),
     "error: config.rollout.max_turns=2 is set but no stage of job results samples episodes "
     "(jobs that do: rl, tools, mine, eval); expected rollout.max_turns=1"),
    ("grpo.py:smoke", ("--config.tools.names=('calculator',)",),
     "error: config.tools.names=('calculator',): expected left at its default: "
     "rollout.max_turns=1 runs no tool (a tool's observation needs a next turn)"),
    ("tools.py:smoke", ("--config.tools.environment=chat",),
     "error: config.tools.environment='chat': CharTokenizer('0123456789_x=+^<>*') has no chat "
     "template to render a tool turn with; expected a chat model, or a built-in task's "
     "environment"),
    ("tools.py:smoke", ("--config.tools.names=('read_key','python')",
                        "--config.tools.python.enabled=True",
                        "--config.tools.python.bwrap=/nonexistent/bwrap"),
     "error: config.tools.python.isolation='sandbox': expected a sandbox for the python tool's "
     "model-written code, and none starts here ('/nonexistent/bwrap' not found (Debian/Ubuntu: "
     "apt-get install bubblewrap)); install bubblewrap, or set "
     "tools.python.isolation='capped_subprocess' to run it under the caps alone, with the "
     "network and every file this user can read (docs/TOOLS.md)"),
])
def test_tool_settings_a_job_does_not_read_or_cannot_use_are_one_line(config, flags, line,
                                                                      tmp_path):
    """config.tools and rollout.max_turns, refused by preflight before any work."""
    workdir = tmp_path / "run"
    result = run_main(f"--config=configs/{config}", *flags, workdir=workdir)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == line
    assert not workdir.exists()


def test_value_the_loop_rejects_fails_at_start(tmp_path):
    workdir = tmp_path / "run"
    result = run_main("--config=configs/grpo.py:smoke", "--config.rollout.n=1", workdir=workdir)
    assert result.returncode != 0
    assert "config.rollout.n=1" in result.stderr
    assert not workdir.exists()  # nothing trained, mined or written


@pytest.mark.parametrize("field,value", [("train.aggregation", "bogus"), ("train.advantage", "ppo"),
                                         ("rollout.temperature", -1.0), ("eval.every", -1)])
def test_loop_names_the_rejected_field(field, value):
    config = build("grpo.py", "smoke")
    section, key = field.split(".")
    config[section][key] = value
    with pytest.raises(ValueError, match=re.escape(f"config.{field}={value!r}")):
        run_settings.resolve(config)


@pytest.mark.parametrize("name", ["grpo", "pope", "prefixrl", "isocompute", "results", "eval",
                                  "tools"])
@pytest.mark.parametrize("variant", ["", "smoke"])
def test_training_verifier_accepts_oracle_solutions(name, variant):
    """The verifier the loop trains with (config.data.verifier) scores the oracle solution 1.

    Regression: the demo once trained with the 'math' verifier on carry-multiplication text while
    mining used the task's own, so every training reward was 0 however good the rollouts were.
    """
    from jaxprefix import rewards
    from jaxprefix.run_setup.problem_sets import load_problem_sets

    config = run_config.from_file(os.path.join(CONFIGS, f"{name}.py"), variant)
    sets = load_problem_sets(config.data)
    assert sets.verifier == config.data.verifier
    problems = sets.eval[:4]
    scores, _ = rewards.score_batch(config.data.verifier, [p.solution + "<eos>" for p in problems],
                                    problems)
    assert scores.tolist() == [1.0] * len(problems)


@pytest.mark.parametrize("variant,field,value,expected", [
    ("carry", "flops_budget", -1.0, "expected >= 0 FLOPs"),
    ("", "flops_budget", 4e12, "no run of results.runs="),  # POPE's runs: no regime arm
])
def test_results_refuses_a_regime_budget_it_cannot_spend_in_one_line(tmp_path, variant, field,
                                                                      value, expected):
    from jaxprefix.errors import ConfigError
    from jaxprefix.jobs.results import run_results

    config = build("results.py", variant)
    config.results.regime[field] = value
    with pytest.raises(ConfigError, match=expected) as error:
        run_results(config, str(tmp_path))  # refused before any study is prepared
    assert "\n" not in str(error.value) and "config.results.regime.flops_budget" in str(error.value)
    assert os.listdir(tmp_path) == []


def test_results_refuses_a_flop_matched_run_listed_before_what_it_matches(tmp_path):
    """GRPO run on to the POPE arms' FLOPs needs one of them before it (the eps sweep's floor
    levels run the value hint alone); refused in one line before any study is prepared."""
    from jaxprefix.errors import ConfigError
    from jaxprefix.jobs.results import run_results

    config = build("results.py", "eps_smoke")
    config.results.runs = ("grpo_matched_hints", "pope_value_hint")
    with pytest.raises(ConfigError, match="grpo_matched_hints spends the larger FLOPs of "
                                          "pope_value_hint or pope_restating_hint"):
        run_results(config, str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_results_refuses_a_regime_rule_it_has_not_got(tmp_path):
    from jaxprefix.errors import ConfigError
    from jaxprefix.jobs.results import run_results

    config = build("results.py", "carry_smoke")
    config.results.regime.rule = "easy"
    with pytest.raises(ConfigError, match="config.results.regime.rule='easy': expected 'middle' "
                                          "or 'hard'"):
        run_results(config, str(tmp_path))  # before any study is prepared
    assert os.listdir(tmp_path) == []
