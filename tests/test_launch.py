"""launch/tpu.sh against a fake `gcloud` on PATH that records its arguments."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "launch" / "tpu.sh"
WHERE = ["--zone=us-east5-b", "--project=my-proj"]

# Records argv as one JSON line; `describe` answers $FAKE_STATE (MISSING: not found), the
# pgrep probe answers $FAKE_RUN_ALIVE, the run's exit status file $FAKE_RUN_STATUS (unset: none),
# and scp keeps a copy of the file it was asked to send.
FAKE_GCLOUD = textwrap.dedent(f"""\
    #!{sys.executable}
    import json, os, shutil, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_LOG"], "a") as f:
      f.write(json.dumps(args) + "\\n")
    if "describe" in args:
      state = os.environ.get("FAKE_STATE", "READY")
      if state == "MISSING":
        sys.exit("ERROR: (gcloud) NOT_FOUND")
      print(state)
    elif "scp" in args:
      shutil.copy(args[args.index("scp") + 1], os.environ["FAKE_LOG"] + ".tar.gz")
    elif any("pgrep" in a for a in args):
      sys.exit(0 if os.environ.get("FAKE_RUN_ALIVE") == "1" else 1)
    elif any("jaxprefix.status 2>" in a for a in args):
      print(os.environ.get("FAKE_RUN_STATUS", "none"))
""")


@pytest.fixture
def launch(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "gcloud"
    fake.write_text(FAKE_GCLOUD)
    fake.chmod(0o755)
    log = tmp_path / "gcloud.jsonl"

    def run(*args, env=None, check=True):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPREFIX_")}
        full_env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_LOG=str(log), USER="ada",
                        TMPDIR=str(tmp_path), **(env or {}))
        result = subprocess.run(["bash", str(SCRIPT), *args], env=full_env, capture_output=True,
                                text=True, timeout=60)
        if check:
            assert result.returncode == 0, result.stderr
        calls = [json.loads(l) for l in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return result, calls

    return run


def test_up_creates_copies_installs_and_runs_on_all_workers(launch, tmp_path):
    _, calls = launch("up", *WHERE, "--type=v5litepod-16", "--workdir=gs://bkt/run1",
                      "--config=configs/grpo.py", "--", "--config.train.total_steps=100")
    create, scp, setup, run = calls
    assert create == ["compute", "tpus", "tpu-vm", "create", "jaxprefix-ada", *WHERE,
                      "--accelerator-type=v5litepod-16", "--version=v2-alpha-tpuv5-lite"]
    assert scp[:5] == ["compute", "tpus", "tpu-vm", "scp", scp[4]]
    assert scp[5:] == ["jaxprefix-ada:~/jaxprefix.tar.gz", *WHERE, "--worker=all"]
    assert setup[:8] == ["compute", "tpus", "tpu-vm", "ssh", "jaxprefix-ada", *WHERE,
                         "--worker=all"]
    # A Python 3.11 environment made by uv, whatever python3 the image has, and the install in it.
    assert "python3 -m pip install -q --user uv" in setup[8]
    assert "~/.local/bin/uv venv -q --python 3.11 ~/jaxprefix-venv && " in setup[8]
    assert '~/.local/bin/uv pip install -q --python ~/jaxprefix-venv/bin/python -e ".[tpu]"' in setup[8]
    assert run[:8] == setup[:8]
    assert run[8] == ("--command=cd ~/jaxprefix && rm -f ~/jaxprefix.status && setsid nohup "
                      "bash -c '~/jaxprefix-venv/bin/python3 -m jaxprefix.main "
                      "--config=configs/grpo.py --workdir=gs://bkt/run1 "
                      "--config.train.total_steps=100; echo $? > ~/jaxprefix.status' "
                      "> ~/jaxprefix.log 2>&1 < /dev/null &")
    # The copied code is this working tree (tracked and untracked, not ignored files).
    with tarfile.open(str(tmp_path / "gcloud.jsonl") + ".tar.gz") as tar:
        names = set(tar.getnames())
    assert {"launch/tpu.sh", "jaxprefix/distributed.py", "setup.cfg"} <= names
    assert not any("__pycache__" in n for n in names)
    assert not list(tmp_path.glob("jaxprefix-*.tar.gz"))  # local tarball cleaned up


def test_spot_queued_resource_waits_for_active_and_deletes_with_force(launch):
    _, calls = launch("create", *WHERE, "--queued", "--spot", "--type=v6e-32",
                      "--name=big", env=dict(FAKE_STATE="ACTIVE"))
    assert calls[0] == ["compute", "tpus", "queued-resources", "create", "big", "--node-id=big",
                        *WHERE, "--accelerator-type=v6e-32",
                        "--runtime-version=v2-alpha-tpuv6e", "--spot"]
    assert calls[1][:4] == ["compute", "tpus", "queued-resources", "describe"]
    _, calls = launch("delete", *WHERE, "--queued", "--name=big")
    assert calls == [["compute", "tpus", "queued-resources", "delete", "big", *WHERE, "--force",
                      "--quiet"]]


def test_env_variables_stand_in_for_flags(launch):
    env = dict(JAXPREFIX_PROJECT="my-proj", JAXPREFIX_ZONE="us-east5-b",
               JAXPREFIX_TPU_NAME="envname")
    _, calls = launch("delete", env=env)
    assert calls == [["compute", "tpus", "tpu-vm", "delete", "envname", *WHERE, "--quiet"]]


def test_logs_follow_worker_zero_and_stop_signals_all_workers(launch):
    _, (logs,) = launch("logs", *WHERE)
    assert logs[4:] == ["jaxprefix-ada", *WHERE, "--worker=0",
                        "--command=tail -n 200 -F ~/jaxprefix.log"]
    _, (stop,) = launch("stop", *WHERE)
    assert stop[7:] == ["--worker=all",
                        "--command=pkill -TERM -f '[p]ython3 -m jaxprefix.main' || true"]


@pytest.mark.parametrize("args, message", [
    (["create", "--zone=us-east5-b"], "missing GCP project"),
    (["up", "--project=my-proj", "--workdir=gs://b/r"], "missing zone"),
    (["run", *WHERE, "--workdir=/tmp/run"], "--workdir must be a gs:// path"),
    (["create", *WHERE, "--type=tpu9-8"], "no default runtime"),
    (["launch", *WHERE], "unknown command"),
])
def test_bad_parameters_fail_before_any_gcloud_call(launch, args, message):
    result, calls = launch(*args, check=False)
    assert result.returncode != 0
    assert message in result.stderr
    assert calls == []


def test_dry_run_prints_commands_and_runs_none(launch):
    result, calls = launch("up", *WHERE, "--workdir=gs://b/r", "--dry-run")
    assert calls == []
    printed = [l for l in result.stdout.splitlines() if l.startswith("+ gcloud")]
    assert len(printed) == 4
    assert printed[0] == ("+ gcloud compute tpus tpu-vm create jaxprefix-ada --zone=us-east5-b "
                          "--project=my-proj --accelerator-type=v6e-8 --version=v2-alpha-tpuv6e")


def test_resume_rebuilds_a_preempted_slice_and_reruns(launch):
    _, calls = launch("resume", *WHERE, "--spot", "--workdir=gs://b/r",
                      env=dict(FAKE_STATE="PREEMPTED"))
    verbs = [c[3] for c in calls]
    assert verbs == ["describe", "delete", "create", "scp", "ssh", "ssh"]
    assert "--spot" in calls[2]
    assert "jaxprefix.main --config=configs/pope.py --workdir=gs://b/r;" in calls[-1][8]


def test_resume_leaves_a_live_run_alone(launch):
    _, calls = launch("resume", *WHERE, "--workdir=gs://b/r",
                      env=dict(FAKE_STATE="READY", FAKE_RUN_ALIVE="1"))
    assert [c[3] for c in calls] == ["describe", "ssh"]
    assert calls[1][7] == "--worker=0"


def test_watch_stops_when_the_run_has_ended(launch):
    for status in ("0", "1", "143"):  # finished, an error to fix, stopped on purpose
        result, calls = launch("watch", *WHERE, "--workdir=gs://b/r", "--interval=0",
                               env=dict(FAKE_STATE="READY", FAKE_RUN_ALIVE="0",
                                        FAKE_RUN_STATUS=status))
        assert [c[3] for c in calls] == ["describe", "ssh", "ssh"]
        assert "the run has ended" in result.stdout


@pytest.mark.parametrize("status", ["75", "137", "none"])
def test_resume_relaunches_a_run_that_died_on_a_live_slice(launch, status):
    # 75: a host of the slice was lost (the others stopped in one line) or GCS stayed down;
    # 137: SIGKILLed; none: killed with its VM. The slice is up: relaunch on all workers.
    result, calls = launch("resume", *WHERE, "--workdir=gs://b/r",
                           env=dict(FAKE_STATE="READY", FAKE_RUN_ALIVE="0",
                                    FAKE_RUN_STATUS=status))
    assert [c[3] for c in calls] == ["describe", "ssh", "ssh", "ssh", "ssh"]
    kill, run = calls[3], calls[4]
    assert kill[7:] == ["--worker=all",
                        "--command=pkill -KILL -f '[p]ython3 -m jaxprefix.main' || true"]
    assert run[7] == "--worker=all"
    assert "jaxprefix.main --config=configs/pope.py --workdir=gs://b/r; echo $? > " \
           "~/jaxprefix.status" in run[8]
    assert f"died (status {status}): relaunching" in result.stderr


def test_python_requires_matches_the_pinned_packages():
    """setup.cfg's python_requires is the highest floor among the pins that declare one."""
    import configparser
    import importlib.metadata

    from packaging.specifiers import SpecifierSet

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    ours = cfg["options"]["python_requires"].strip()
    floors = []
    for line in cfg["options"]["install_requires"].split():
        if "==" in line:
            name = line.split("==")[0]
            requires = importlib.metadata.metadata(name).get("Requires-Python")
            if requires:
                floors += [s.version for s in SpecifierSet(requires) if s.operator == ">="]
    highest = max(floors, key=lambda v: tuple(int(p) for p in v.split(".")))
    assert ours == f">={highest}", (ours, highest)  # jax 0.10.2, flax, orbax: >=3.11


# ---- docs/LAUNCH.md: every command is run here or checked ----------------------------------------

def launch_md_commands() -> list[str]:
    """The commands of docs/LAUNCH.md's bash blocks (continuations joined, comments dropped)."""
    text = (REPO / "docs" / "LAUNCH.md").read_text()
    commands = []
    for block in text.split("```bash\n")[1:]:
        body = block.split("```")[0].replace("\\\n", " ")
        for line in body.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    return commands


def check_config_overrides(config: str, overrides) -> None:
    """Parses --config=C plus the overrides exactly as jaxprefix.main does (a locked config:
    an unknown field such as --config.total_steps raises)."""
    from absl import flags
    from ml_collections import config_flags

    path, _, variant = config.partition(":")
    argv = ["main", f"--config={REPO / path}" + (f":{variant}" if variant else ""), *overrides]
    values = flags.FlagValues()
    # sys_argv: config_flags defines the override flags it finds there, as main's does.
    config_flags.DEFINE_config_file("config", None, flag_values=values, lock_config=True,
                                    sys_argv=argv)
    values(argv)
    assert values.config is not None


# Commands of other programs that LAUNCH.md shows the user (their own documentation is the check).
EXTERNAL = ("gcloud ", "export ", "tensorboard ")


def test_every_launch_md_command_runs_against_the_fake_gcloud(launch):
    import shlex

    commands = launch_md_commands()
    env = {}
    for command in commands:
        if command.startswith("export "):
            env.update(part.split("=", 1) for part in shlex.split(command)[1:])
    env = {k: v.replace("$USER", "ada") for k, v in env.items()}
    checked = 0
    for command in commands:
        words = shlex.split(command.replace("$JAXPREFIX_WORKDIR", env["JAXPREFIX_WORKDIR"]))
        if words[0] == "launch/tpu.sh":
            before, _, after = command.partition(" -- ")
            # `check` compiles the run here, for minutes (tests/test_compile.py's slow test runs
            # the paper's); this one checks the command line it would run, and that no gcloud.
            dry = ["--dry-run"] if words[1] == "check" else []
            result, calls = launch(*shlex.split(before)[1:], *dry,
                                   *(["--", *shlex.split(after)] if after else []),
                                   env=dict(env, FAKE_STATE="READY", FAKE_RUN_ALIVE="0",
                                            FAKE_RUN_STATUS="0"))
            assert (calls == []) if dry else calls, command
            if words[1] in ("up", "run"):
                flags = shlex.split(after) if after else []
                config = next((w.split("=", 1)[1] for w in words if w.startswith("--config=")),
                              "configs/pope.py")
                check_config_overrides(config, flags)
                assert f"--workdir={env['JAXPREFIX_WORKDIR']}" in calls[-1][-1]
        elif words[:2] == ["python", "launch/capacity_plan.py"]:
            result = subprocess.run([sys.executable, *words[1:]], cwd=REPO, capture_output=True,
                                    text=True, timeout=300)
            assert result.returncode == 0, (command, result.stderr[-2000:])
        elif words[:3] == ["python", "-m", "jaxprefix.main"]:
            config = next(w.split("=", 1)[1] for w in words if w.startswith("--config="))
            check_config_overrides(config, [w for w in words[3:] if w.startswith("--config.")])
        else:
            assert command.startswith(EXTERNAL), f"unchecked command in LAUNCH.md: {command}"
            continue
        checked += 1
    assert checked >= 12


def test_check_config_overrides_rejects_an_unknown_field():
    with pytest.raises(Exception, match="total_steps"):
        check_config_overrides("configs/pope.py", ["--config.total_steps=500"])


# ---- launch/capacity_plan.py ------------------------------------------------------------------

def _capacity_plan():
    """launch/capacity_plan.py is a script, not a package module: load it by path."""
    if "capacity_plan" not in sys.modules:
        spec = importlib.util.spec_from_file_location("capacity_plan",
                                                      REPO / "launch" / "capacity_plan.py")
        sys.modules["capacity_plan"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["capacity_plan"])
    return sys.modules["capacity_plan"]


def test_capacity_plan_memory_matches_hand_counts():
    cp = _capacity_plan()
    from jaxprefix.models.config import ModelConfig
    config = ModelConfig.from_hf(cp.QWEN3_4B)
    # Qwen3-4B, tied: embed 151936*2560, 36 x (attn 2560*(4096+2*1024) + 4096*2560 + mlp 3*2560*9728
    # + norms 2*2560 + qk-norms 2*128) + final norm 2560.
    layer = 2560 * 6144 + 4096 * 2560 + 3 * 2560 * 9728 + 2 * 2560 + 2 * 128
    n = 151936 * 2560 + 36 * layer + 2560
    assert config.num_params() == n  # 4.02B, the published size
    run = cp.RunShape(n=4, problems=2, prompt_len=100, response_len=50, micro_batch=1,
                      full_attention_scores=False)
    mem = cp.memory(config, run)
    # f32 master weights, gradients and AdamW moments; a bf16 copy of the weights for sampling.
    assert mem["params"] == 4 * n and mem["gradients"] == 4 * n
    assert mem["optimizer (AdamW mu, nu)"] == 8 * n
    assert mem["sampler copy (compute dtype)"] == 2 * n
    assert sum(cp.bytes_per_param(run).values()) == 18
    assert sum(cp.bytes_per_param(cp.RunShape(compute_dtype="float32")).values()) == 16
    all_bf16 = cp.RunShape(param_dtype="bfloat16", compute_dtype="bfloat16")
    assert sum(cp.bytes_per_param(all_bf16).values()) == 8
    kv_token = 2 * 36 * 8 * 128 * 2  # K and V, layers, KV heads, head_dim, bf16
    assert mem["KV cache (sampling)"] == kv_token * (2 * 100 + 8 * 50)  # prompts shared per context
    assert mem["activations per chip (training)"] == 36 * 150 * 2560 * 2 + 150 * (
        4 * 2560 + 3 * 9728 + 2 * 4096) * 4


def test_capacity_plan_picks_the_smallest_slice_that_fits():
    cp = _capacity_plan()
    gib = cp.GiB
    mem = {"params": 8 * gib, "reference params": 0, "gradients": 16 * gib,
           "optimizer (AdamW mu, nu)": 32 * gib, "KV cache (sampling)": 200 * gib,
           "activations per chip (training)": 3 * gib}
    v6e = cp.ACCELERATORS[1]
    # 32 GiB chips, 85% usable: 256 GiB over 8 chips is 32 per chip (too much); over 16 it is 16.
    assert cp.smallest_slice(mem, v6e) == 16
    # Without the KV cache: 56/4 + 3 = 17 GiB <= 27.2 fits on 4 chips, 56 + 3 on 1 does not.
    assert cp.smallest_slice(mem, v6e, with_kv=False) == 4
    assert cp.rollouts_per_wave(dict(mem), cp.RunShape(n=8, problems=25), v6e, 4) == int(
        (4 * 0.85 * 32 - 56) / (200 / 200))
    assert v6e.hosts(16) == 4 and v6e.hosts(8) == 1
    assert cp.ACCELERATORS[2].slice_name(16) == "v5p-32"


def test_capacity_plan_cli_reports_a_slice_and_rejects_bad_values(capsys):
    cp = _capacity_plan()
    cp.main(["--preset=pope", "--full_attention_scores=false"])
    assert "| v6e | v6e-64 | 16 |" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="n=0: expected >= 1"):
        cp.main(["--n=0"])


def _hf_model_config(path: str) -> str:
    """A config file whose policy is the HF model at `path`."""
    return (f"from jaxprefix import run_config\n\ndef get_config(arg=''):\n"
            f"    c = run_config.base_config()\n"
            f"    c.model.update(source='hf', path={path!r})\n    return c\n")


def test_capacity_plan_reads_the_run_shape_from_a_config(tmp_path):
    cp = _capacity_plan()
    from jaxprefix.models import published
    from jaxprefix import run_config
    spec = f"{REPO / 'configs' / 'grpo.py'}:smollm2"
    model, run = cp.from_run_config(spec, cp.RunShape(prompt_len=333))
    c = run_config.from_file(str(REPO / "configs" / "grpo.py"), "smollm2")
    assert model == "smollm2-135m"  # the bundled GGUF
    assert (run.n, run.problems, run.response_len, run.param_dtype, run.compute_dtype,
            run.prompt_len) == (c.rollout.n, c.train.problems_per_step, c.rollout.max_new_tokens,
                                c.model.param_dtype, c.model.dtype, 333)
    # The paper variant's placeholder bucket: its model's shipped config.json, read offline.
    model, _ = cp.from_run_config(f"{REPO / 'configs' / 'grpo.py'}:paper", cp.RunShape())
    assert cp.load_hf_config(model) == published.hf_config("Qwen3-4B-Instruct-2507")
    config = tmp_path / "elsewhere.py"
    config.write_text(_hf_model_config("/nowhere/model"))
    with pytest.raises(SystemExit, match="pass --model"):
        cp.main([f"--config={config}"])


def test_capacity_plan_reads_a_model_on_gcs(gcs, tmp_path, capsys):
    cp = _capacity_plan()
    from jaxprefix import storage
    model = f"gs://bucket/plan-{os.getpid()}/qwen3-4b"
    storage.write_json(storage.join(model, "config.json"), cp.QWEN3_4B)
    assert cp.load_hf_config(model) == cp.QWEN3_4B
    assert cp.load_hf_config(f"{model}/config.json") == cp.QWEN3_4B
    cp.main([f"--model={model}", "--n=4", "--problems=8"])
    assert "qwen3 4.02B params" in capsys.readouterr().out
    # A config naming an HF model on gs:// (the paper variant's user) needs no --model.
    config = tmp_path / "on_gcs.py"
    config.write_text(_hf_model_config(model))
    assert cp.from_run_config(str(config), cp.RunShape())[0] == model
    with pytest.raises(SystemExit, match="local or gs://"):
        cp.load_hf_config(f"gs://bucket/plan-{os.getpid()}/missing")


def test_check_compiles_here_without_cloud_flags(launch):
    """`check` needs no project or zone and calls no gcloud: it runs the compile job locally
    for the type (or the generation) asked."""
    result, calls = launch("check", "--type=v6e", "--config=configs/pope.py:paper", "--dry-run",
                           "--", "--config.compile.slices=2")
    assert calls == []
    command = result.stdout.strip().splitlines()[-1]
    assert command.startswith("+ python3 -m jaxprefix.main --config=configs/pope.py:paper "
                              "--config.job=compile --config.compile.topology=v6e ")
    assert command.endswith("--config.compile.slices=2")
