"""Fields you can see: `--config.job=describe` lists every leaf field with its value and its
one-line doc (declared beside its default in run_config.py), and a misspelt field's error names
the nearest fields, in one line."""
import os
import re
import subprocess
import sys

import pytest

from jaxprefix import config_fields, run_config
from test_configs import VARIANTS, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(*flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxprefix.main", *flags], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_build_and_docs_of_a_spec():
    spec = {"n": config_fields.Field(8, "samples"),
            "lora": {"targets": config_fields.Field(("q", "k"), "projections")}}
    config = config_fields.build(spec)
    assert config.n == 8 and config.lora.targets == ("q", "k")
    assert config_fields.docs(spec) == {"n": "samples", "lora.targets": "projections"}
    assert config_fields.describe(config, config_fields.docs(spec)) == [
        "lora.targets = ('q', 'k')  # projections", "n = 8  # samples"]


@pytest.mark.parametrize("name,variant", [(n, v) for n, vs in VARIANTS.items() for v in vs])
def test_every_leaf_field_has_a_doc(name, variant):
    config = build(name, variant)
    docs = run_config.field_docs(config)
    missing = [n for n, _ in config_fields.leaves(config) if not docs.get(n, "").strip()]
    assert not missing, f"{name}:{variant}: fields without a doc: {missing}"


def test_describe_prints_one_line_per_leaf_field_and_exits_0():
    result = main("--config=configs/pope.py:paper", "--config.job=describe")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    config = build("pope.py", "paper")
    names = [n for n, _ in config_fields.leaves(config)]
    assert [line.split(" = ", 1)[0] for line in lines] == names
    for line in lines:
        assert re.fullmatch(r"[\w.]+ = .+  # \S.*", line), line
    assert "rollout.max_new_tokens = 16384  # longest completion in tokens" in lines
    assert "job = 'describe'" in lines[names.index("job")]


def test_misspelt_field_names_the_nearest_in_one_line(tmp_path):
    result = main("--config=configs/pope.py:paper", "--config.trian.total_steps=1",
                  f"--workdir={tmp_path / 'w'}")
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith("error: --config.trian.total_steps=1: no such config field "
                               "'trian.total_steps'")
    assert "(nearest: 'train.total_steps'" in lines[0]
    assert not (tmp_path / "w").exists()


def test_nearest_finds_a_misspelt_leaf_under_its_block():
    names = [n for n, _ in config_fields.leaves(run_config.base_config())]
    assert config_fields.nearest("train.learnin_rate", names)[0] == "train.learning_rate"
    assert config_fields.nearest("rollout.max_new_token", names)[0] == "rollout.max_new_tokens"
    assert config_fields.nearest("pope.max_prefix_frac", names)[0] == "pope.max_prefix_fraction"
