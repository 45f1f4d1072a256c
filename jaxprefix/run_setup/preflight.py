"""Validate before work: a bad input fails in seconds, with one line, and nothing written.

`check(config, workdir)` reads and checks what the job will read, before any SFT, model load or
compile: the config fields the job uses, the model directory (config.json, tensor index, every
safetensors header and size) or GGUF file (header, tensor data length), the tokenizer, every
record of the problem files and every prompt's length against the model's context, and the
verifier (main has checked the storage backends of every gs:// path first). It writes nothing:
main calls it before it locks the workdir. Every failure is a UserError, one line from main.

Every field a run is given is read, or the run is refused (`unread`), whatever its block: the
job's settings and its stages' own readers (the policy's settings, the problem loader's fields,
mining) run over a recording view of the config (`fields_read`; config_reads), and a field
that differs from run_config.base_config() (set by a variant or on the command line) that none
of them read is refused in one line naming it and the job. Only main's own blocks, a study's
plan and the launch's compile context are read whole (DOOR, STUDY_BLOCKS, LAUNCH_FIELDS), and
tests/test_fields_read runs jobs over a recording view to show that a run reads no field its
preflight did not. A config file built on another job's variant leaves what its job does not
read at its default (`reset_unread`: configs/eval.py).
The results job resolves each of its runs and refuses a field a run changes that it does not
read. pope.template is refused besides on a policy whose prompts have no template (a built-in
task's TaskPrompts: its hint is a layout, not English) or with guidance that puts no
instruction in the prompt.
On keyed_multiplication with data.key_names_rule (the restating route) pope.template is read:
'default' guides by the restating hint, 'no_restate' by the value hint; and the run's notation
must be its SFT base's.
"""
from __future__ import annotations

import dataclasses
import sys

from jaxprefix import config_fields, storage
from jaxprefix.config_reads import read_whole, recording, unwrapped
from jaxprefix.errors import ConfigError, UserError

TRAINING_JOBS = ("rl", "demo", "results", "sweep", "prereg", "tools")
# The methods a job runs (demo: POPE and GRPO, results: its RUNS, each with its own method; the
# other jobs config.method alone).
JOB_METHODS = {"demo": ("pope", "grpo"), "results": ("grpo", "pope", "prefixrl")}
FIELDS_CHECKED = ("rl", "mine", "eval", "demo", "results", "sweep", "prereg", "tools")
# What a job reads beyond its settings and its stages' own readers (`fields_read`), read whole:
# main's fields, read for every job before its settings (the distributed runtime, storage's
# retry deadline, the workdir lock, the run's identity and its allowed changes);
DOOR = ("job", "allow_changes", "storage", "distributed", "workdir_lock")
# a study job's own plan and report (each of its runs reads the rest through its settings);
STUDY_BLOCKS = {"demo": ("eval",), "results": ("results", "pope", "prefixrl", "schedule", "eval"),
                "sweep": ("isocompute",), "prereg": ("isocompute",),
                "tools": ("tool_study", "eval")}
# and the context a training run's programs are planned for: launch/tpu.sh compiles a run's own
# config (the compile job) before it runs it.
LAUNCH_FIELDS = ("compile.context_length",)
# The jobs that sample multi-turn episodes with config.tools (rollout.max_turns > 1): mining and
# evaluation sample the run's episodes too (ProbeSettings).
TOOL_JOBS = ("rl", "tools", "mine", "eval")
# fit reads the sweep's finished runs only; compile reads config.json facts alone (no data, no
# weights) and checks its own settings before it compiles.
NOTHING_TO_CHECK = ("fit", "compile")


def refuse_placeholders(config, workdir: str) -> None:
    """A placeholder path (storage.PLACEHOLDER_BUCKETS) in a field the job reads, or as the
    workdir, is refused naming the field, before any storage client is asked about it."""
    if storage.is_placeholder(workdir):
        raise ConfigError(f"--workdir={workdir}: a placeholder; expected a local directory or "
                          f"a gs:// path of your own")
    found = [(n, v) for n, v in read_paths(config) if storage.is_placeholder(v)]
    if found:
        fields = ", ".join(f"config.{n}={v!r}" for n, v in found)
        given = " ".join(f"--config.{n}=..." for n, _ in found)
        raise ConfigError(f"{fields}: {'a placeholder' if len(found) == 1 else 'placeholders'}"
                          f" the {config.job} job reads; expected paths of your own ({given})")


def read_paths(config) -> list[tuple[str, str]]:
    """(dotted field, value) of every non-empty string field that `config.job` reads as a path.
    The compile job reads only its own block (the model's shapes come from a shipped
    config.json when model.path cannot be read); the model and data paths count only for the
    sources that read them."""
    fields = [(n, v) for n, v in config_fields.leaves(config) if isinstance(v, str) and v]
    if config.job == "compile":
        return [(n, v) for n, v in fields if n.startswith("compile.")]
    model, data = config.get("model", {}), config.get("data", {})
    unread = set()
    if model.get("source") not in ("hf", "gguf"):
        unread.add("model.path")
    if data.get("source") not in ("file", "hf", "tfds"):
        unread |= {"data.path", "data.eval_path"}
    return [(n, v) for n, v in fields if n not in unread]


def check(config, workdir: str):
    """Raises a UserError on the first input of `config.job` that cannot work; writes nothing.
    Returns the rl job's run settings, resolved (run_settings.resolve), which main hands to the
    job; None for the other jobs."""
    if config.job in NOTHING_TO_CHECK:
        return None
    if config.job == "sft":
        _check_sft_settings(config)
        return None
    if config.job == "serve":  # the server's settings and its model; no problems, no method
        from jaxprefix.run_setup.policy import check_policy_inputs
        from jaxprefix.sampling import RolloutSpec
        from jaxprefix.serving.settings import ServeSettings

        _as_config_error(ServeSettings.from_config, config)
        _as_config_error(RolloutSpec.from_config, config.rollout)
        check_policy_inputs(config, workdir)
        return None
    _read_problem_files(config.data)  # first: a bad record is found before the heavy imports
    from jaxprefix.run_setup.policy import check_policy_inputs
    from jaxprefix.run_setup.problem_sets import load_problem_sets, prompt_limit

    settings, view, reads = _settings_recorded(config, workdir)
    inputs = check_policy_inputs(view, workdir)
    if config.job in TRAINING_JOBS:
        from jaxprefix.run_setup.learner_settings import routing_replay

        _as_config_error(routing_replay, config, inputs.mixture_of_experts)
        _check_environment(config, inputs)
    if config.job in FIELDS_CHECKED:
        _check_notation(config)
        _check_template_read(config, inputs.prompts)
        _check_probe_read(config)
        _check_tools_read(config, inputs.tokenizer)
    limit = prompt_limit(view, inputs.prompts, inputs.context_length)
    sets = load_problem_sets(view.data, limit, rewards_path=view.rewards.path)
    if _guides_in_prompt(config):
        from jaxprefix.methods.prompting import check_hint_layouts

        _as_config_error(check_hint_layouts, inputs.prompts, sets.train)
    if config.job in FIELDS_CHECKED:
        _mining_reads(view)
        _check_fields_read(config, reads)  # after the checks that say more of why
    return settings


def _changed(config) -> dict:
    """Every leaf field whose value differs from run_config.base_config()'s, or that it lacks (a
    config file's own block: results.*, tool_study.*, isocompute.prereg.*)."""
    from jaxprefix.run_config import base_config

    defaults = dict(config_fields.leaves(base_config()))
    return {k: v for k, v in config_fields.leaves(config)
            if k not in defaults or defaults[k] != v}


def _method_blocks() -> dict[str, tuple[str, ...]]:
    """Each method block, and the registered methods that read it."""
    from jaxprefix.methods.registry import method_names, method_spec

    readers = {}
    for name in method_names():
        for block in method_spec(name).blocks:
            readers[block] = readers.get(block, ()) + (name,)
    return readers


def _methods_run(config) -> tuple[str, ...]:
    return JOB_METHODS.get(config.job, (config.method,))


def fields_read(config, workdir: str = "") -> tuple[object, set[str]]:
    """(the job's settings, every field it reads): its settings and its stages' own readers
    (`_stage_reads`) run over a recording view (config_reads), plus the blocks above read whole
    (DOOR, STUDY_BLOCKS, LAUNCH_FIELDS)."""
    settings, view, reads = _settings_recorded(config, workdir)
    if config.job in FIELDS_CHECKED:
        _stage_reads(view, workdir)
    return settings, reads


def _stage_reads(view, workdir: str) -> None:
    """Reads what a sampling job's stages read besides its settings, by their own readers: the
    policy's settings (load_policy), the prompt budget, the problem loader (load_problem_sets:
    the fields of its source, read without loading a problem) and Mining. Preflight's `check`
    runs the same readers, on the model's files and problems too."""
    from jaxprefix.run_setup.policy import PolicySettings
    from jaxprefix.run_setup.problem_sets import prompt_limit, source_fields

    _as_config_error(PolicySettings.from_config, view, workdir)
    prompt_limit(view, None, sys.maxsize)  # its fields; the model's context is not read here
    _as_config_error(source_fields, view.data)
    view.rewards.get("path")  # the loader's verifier: a function in a file, or data.verifier
    _mining_reads(view)


def _mining_reads(view) -> None:
    """set_up's Mining: its settings (the run's tools, which it samples with, included), its
    caches and prober reading the mining block whole, its samples seeded."""
    from jaxprefix.run_setup.mining import MiningSettings

    _as_config_error(MiningSettings.from_config, view)
    view.mining.to_dict()


def _settings_recorded(config, workdir: str):
    """(the job's settings, the recording view they were built over, the fields read so far,
    the blocks above included)."""
    view, reads = recording(config)
    settings = _as_config_error(_check_settings, view, workdir)
    if settings is not None:  # the run goes on with the config itself, not the view
        settings = dataclasses.replace(settings, config=unwrapped(settings.config))
    launched = LAUNCH_FIELDS if config.job in TRAINING_JOBS else ()
    for block in (*DOOR, *STUDY_BLOCKS.get(config.job, ()), *launched):
        reads |= read_whole(config, block)
    if config.job == "rl" and config.get("isocompute", {}).get("config_arg"):
        # one point of a sweep, run as the sweep printed it (configs/isocompute.py): it carries
        # the sweep's own settings, which its run does not read
        reads |= read_whole(config, "isocompute")
    return settings, view, reads


def unread(config, reads: set[str] | None = None) -> list[tuple[str, str]]:
    """The config's set fields (differing from run_config's defaults) that no settings builder
    of its job read, each with why: [(field, reason)]."""
    reads = fields_read(config)[1] if reads is None else reads
    return [(field, _why(config, field, _methods_run(config), reads))
            for field in _changed(config) if field not in reads]


def reset_unread(config, only=None) -> list[str]:
    """Puts each field `config.job` does not read (`unread`) back to run_config's default: for a
    config file that builds on another job's variant (configs/eval.py on an rl run's). `only`:
    a predicate on the field's name choosing which. Returns the fields reset."""
    from jaxprefix.run_config import base_config

    defaults = dict(config_fields.leaves(base_config()))
    reset = [field for field, _ in unread(config) if only is None or only(field)]
    for field in reset:
        *blocks, name = field.split(".")
        node = config
        for block in blocks:
            node = node[block]
        node[name] = defaults[field]
    return reset


def reset_mooted(config, overrides) -> list[str]:
    """The config file's fields that the command line's `overrides` (dotted field names) left
    unread, back at their defaults: a variant's reasoning-gym task on a run whose
    --config.data.source=file reads a file instead (README's own-data commands). Only fields of
    a block an override touches, and none the command line set itself: those, like a config
    file's own unread fields, are refused by `check`. Returns the fields reset."""
    if config.job not in FIELDS_CHECKED or not overrides:
        return []
    touched = {o.split(".")[0] for o in overrides}
    return reset_unread(config, only=lambda field: field.split(".")[0] in touched
                        and field not in overrides)


def _why(config, field: str, methods, reads: set[str]) -> str:
    """Why a job running `methods`, whose settings read `reads`, reads no `field`."""
    block, _, rest = field.partition(".")
    readers = _method_blocks().get(block, ())
    if readers and not set(readers) & set(methods):
        return f"only {' and '.join(readers)} read {block}.*"
    if block == "schedule" and "." in rest:
        return f"schedule.kind={config.schedule.kind!r} reads only schedule.{config.schedule.kind}.*"
    if not any(name.startswith(f"{block}.") for name in reads):
        return f"its settings read no {block}.* field"
    return f"its settings read other {block}.* fields"


def _check_fields_read(config, reads: set[str]) -> None:
    """The config's set fields all read by the job's settings (see `unread`)."""
    _refuse_unread(unread(config, reads), f"job {config.job} with method {config.method}")


def _refuse_unread(unread: list[tuple[str, str]], where: str) -> None:
    if unread:
        field, why = unread[0]
        raise ConfigError(f"config.{field} is set but no stage of {where} reads it ({why}); "
                          f"expected it left at its default")


def _check_probe_read(config) -> None:
    """eval.key_step_probe runs at evaluations, on a built-in task's oracle solutions."""
    if not config.eval.get("key_step_probe"):
        return
    from jaxprefix.data.tasks import TASKS

    if config.data.source not in TASKS:
        raise ConfigError(f"config.eval.key_step_probe=True is set but no stage of job "
                          f"{config.job} reads it: data.source={config.data.source!r} has no "
                          f"oracle solutions to probe; expected a built-in task "
                          f"({', '.join(sorted(TASKS))}) or key_step_probe=False")
    if not config.eval.every:
        raise ConfigError("config.eval.key_step_probe=True is set but no stage reads it: "
                          "eval.every=0 never evaluates; expected eval.every > 0")


def _check_environment(config, inputs) -> None:
    """An external environment (config.environment.source) built over the policy's tokenizer,
    on a model whose routes need no replay (the live server records none)."""
    from jaxprefix.rl.loop_settings import replays_routes
    from jaxprefix.serving.env_settings import EnvironmentSettings

    settings = _as_config_error(EnvironmentSettings.from_config, config)
    if not settings.active:
        return
    _as_config_error(settings.environment, inputs.tokenizer)
    if replays_routes(config.train.routing_replay, inputs.mixture_of_experts):
        raise ConfigError(f"config.environment.source={settings.source!r} is set on a mixture "
                          f"of experts with train.routing_replay={config.train.routing_replay!r}"
                          f": the live server records no experts to replay; expected "
                          f"train.routing_replay='off'")


def _check_tools_read(config, tokenizer) -> None:
    """Episodes (rollout.max_turns > 1, config.tools) on the jobs that sample them, with an
    environment that can be built over the policy's tokenizer; elsewhere refused."""
    from jaxprefix.tools.settings import ToolSettings

    try:
        settings = ToolSettings.from_config(config)  # a tools field on a one-turn run: refused
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not settings.episodes:
        return
    if config.job not in TOOL_JOBS:
        raise ConfigError(f"config.rollout.max_turns={settings.max_turns} is set but no stage of "
                          f"job {config.job} samples episodes (jobs that do: "
                          f"{', '.join(TOOL_JOBS)}); expected rollout.max_turns=1")
    _as_config_error(settings.environment_for, tokenizer)


def _check_template_read(config, prompts) -> None:
    """pope.template shapes an English instruction in a chat model's prompt, or chooses a
    built-in task's restating hint over its value hint (`_task_restates`), and nothing else."""
    from jaxprefix.methods.prompting import TaskPrompts

    reads_pope = any(m in _method_blocks().get("pope", ()) for m in _methods_run(config))
    templates = {"": config.pope.template} if reads_pope else {}
    if config.job == "results":
        from jaxprefix.run_setup.study_arms import RUNS

        templates |= {name: RUNS[name].settings["pope.template"] for name in config.results.runs
                      if name in RUNS and "pope.template" in RUNS[name].settings}
    for run, template in templates.items():
        if template == "default":
            continue
        where = f"run {run} of job results" if run else f"job {config.job}"
        if isinstance(prompts, TaskPrompts) and not _task_restates(config.data):
            raise ConfigError(f"config.pope.template={template!r} is set but no stage of {where} "
                              f"reads it: a built-in task's prompts ({config.data.source}) put "
                              f"the hint in the task's layout, with no template (only a notation "
                              f"that names the key step's rule, keyed_multiplication's "
                              f"data.key_names_rule, has a restating hint to forbid); expected "
                              f"pope.template='default'")
        if config.pope.guidance != "instruction":
            raise ConfigError(f"config.pope.template={template!r} is set but no stage of {where} "
                              f"reads it: pope.guidance={config.pope.guidance!r} puts no "
                              f"instruction in the prompt; expected pope.template='default'")


def _task_restates(data) -> bool:
    """Whether the built-in task of `data` writes a notation with a restating hint, so that
    pope.template chooses between it ('default') and the value hint ('no_restate')."""
    from jaxprefix.data import tasks

    task = tasks.TASKS.get(data.source)
    return bool(task is not None and hasattr(task, "restating_notation")
                and task.restating_notation(data))


def _check_notation(config) -> None:
    """The run's problems are written in its SFT base's notation (data.key_names_rule)."""
    if config.model.source != "sft" or "key_names_rule" not in config.data:
        return
    base = config.sft.data.get("key_names_rule", False)
    if config.data.key_names_rule != base:
        raise ConfigError(f"config.data.key_names_rule={config.data.key_names_rule!r} but the SFT "
                          f"base writes config.sft.data.key_names_rule={base!r}: expected the "
                          f"same notation for the base and the run's problems")


def _guides_in_prompt(config) -> bool:
    """Whether a method the job runs puts guidance in prompts (demo and results run POPE
    whatever config.method says)."""
    from jaxprefix.methods.registry import method_spec

    specs = [method_spec(m) for m in _methods_run(config)]
    return any(spec.guides_in_prompt(spec.settings(config)) for spec in specs)


def _read_problem_files(data) -> None:
    """Every record of the configured problem files (DataError naming file, line and field)."""
    if data.source != "file" or data.get("skip_invalid", False):  # nothing to fail on early
        return
    from jaxprefix.data import read_problem_file

    for path in (data.path, data.eval_path):
        if path:
            read_problem_file(path, question_field=data.question_field,
                              answer_field=data.answer_field, solution_field=data.solution_field)


def _as_config_error(check_fn, *args):
    """Runs a validator whose ValueErrors name a config field; they become ConfigErrors."""
    try:
        return check_fn(*args)
    except UserError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_settings(config, workdir: str):
    """The rewards and data limits, the method's settings, and each training run's settings
    resolved; returns the rl job's (run_settings.RunSettings), else None."""
    from jaxprefix.run_setup.method_settings import MethodSettings
    from jaxprefix.run_setup.run_settings import resolve

    r = config.rewards
    if not r.timeout_s > 0:
        raise ConfigError(f"config.rewards.timeout_s={r.timeout_s!r}: expected > 0 seconds")
    if r.get("max_memory_mb", 0) < 0:
        raise ConfigError(f"config.rewards.max_memory_mb={r.max_memory_mb!r}: expected >= 0 "
                          f"(0: no cap)")
    if r.get("max_chars", 0) < 0:
        raise ConfigError(f"config.rewards.max_chars={r.max_chars!r}: expected >= 0 (0: no cap)")
    if config.data.get("max_prompt_tokens", 0) < 0:
        raise ConfigError(f"config.data.max_prompt_tokens={config.data.max_prompt_tokens!r}: "
                          f"expected >= 0 (0: the model's context alone)")
    if config.job not in TRAINING_JOBS:  # mine, eval: the method's settings and the prober's
        from jaxprefix.sampling import RolloutSpec

        MethodSettings.from_config(config)
        if config.job in ("mine", "eval"):
            RolloutSpec.from_config(config.rollout)
        if config.job == "eval":  # the trained run's adapters, and its prefix search's file
            from jaxprefix.run_setup.learner_settings import lora_config
            from jaxprefix.run_setup.mining import prefix_search

            lora_config(config)
            prefix_search(config)
            config.eval.n, config.eval.ks  # its samples a problem and pass@k (jobs/evaluate)
        return None
    if config.job == "demo":  # each method it runs, resolved as its run
        for method in JOB_METHODS["demo"]:
            c = config.copy_and_resolve_references()
            c.method = method
            resolve(c)
        return None
    if config.job == "results":
        _check_arms(config)
        return None
    if config.job in ("sweep", "prereg"):  # each point is its own run, with its n and batch
        from jaxprefix.run_setup import sweep_points

        MethodSettings.from_config(config)
        for point in sweep_points.sweep_points(config):
            resolve(sweep_points.point_config(config, point, config.isocompute.seeds[0],
                                              workdir))
        return None
    settings = resolve(config)  # with isocompute.budget, the n, B, M the run will use
    return settings if config.job == "rl" else None


def _check_arms(config) -> None:
    """Each results run resolved as it will run (its method and changed fields): a field it
    changes that its resolution does not read is refused naming the run."""
    from jaxprefix.run_setup.run_settings import resolve
    from jaxprefix.run_setup.study_arms import RUNS

    for name in config.results.runs:
        if name not in RUNS:
            continue
        spec = RUNS[name]
        arm, reads = recording(config.copy_and_resolve_references())  # the job's reads too
        arm.method = spec.method
        for field, value in spec.settings.items():
            block, key = field.split(".")
            arm[block][key] = value
        resolve(arm)
        _stage_reads(arm, "")  # each run is an rl run
        reads |= read_whole(config, "compile.context_length")
        _refuse_unread([(f, _why(config, f, (spec.method,), reads)) for f in spec.settings
                        if f not in reads], f"run {name} of job results (method {spec.method})")


def _check_sft_settings(config) -> None:
    """The sft job's own config (configs/sft.py): the model it would build."""
    from jaxprefix.run_setup import sft_base

    try:
        sft_base.model_config(config, sft_base.task_of(config).tokenizer())
    except (ValueError, AttributeError, KeyError) as e:
        raise ConfigError(f"config.model: {e}") from None
