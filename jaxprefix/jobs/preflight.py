"""Validate before work: a bad input fails in seconds, with one line, and nothing written.

`check(config, workdir)` reads and checks what the job will read, before any SFT, model load or
compile: the config fields the job uses, the model directory (config.json, tensor index, every
safetensors header and size) or GGUF file (header, tensor data length), the tokenizer, every
record of the problem files and every prompt's length against the model's context, and the
verifier (main has checked the storage backends of every gs:// path first). It writes nothing:
main calls it before it locks the workdir. Every failure is a UserError, one line from main.
"""
from __future__ import annotations

from jaxprefix import storage
from jaxprefix.errors import ConfigError, UserError

TRAINING_JOBS = ("rl", "demo", "results", "sweep", "prereg")
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
    from jaxprefix import config_fields

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


def check(config, workdir: str) -> None:
    """Raises a UserError on the first input of `config.job` that cannot work; writes nothing."""
    if config.job in NOTHING_TO_CHECK:
        return
    if config.job == "sft":
        _check_sft_settings(config)
        return
    _read_problem_files(config.data)  # first: a bad record is found before the heavy imports
    from jaxprefix.jobs.policy import check_policy_inputs
    from jaxprefix.jobs.problem_sets import load_problem_sets, prompt_limit

    _as_config_error(_check_settings, config, workdir)
    inputs = check_policy_inputs(config, workdir)
    limit = prompt_limit(config, inputs.prompts, inputs.context_length)
    sets = load_problem_sets(config.data, limit, rewards_path=config.rewards.path)
    if _guides_in_prompt(config):
        from jaxprefix.methods.prompting import check_hint_layouts

        _as_config_error(check_hint_layouts, inputs.prompts, sets.train)


def _guides_in_prompt(config) -> bool:
    """Whether the job puts POPE's guidance in prompts (demo and results run POPE whatever
    config.method says)."""
    return config.pope.guidance == "instruction" and (
        config.method == "pope" or config.job in ("demo", "results"))


def _read_problem_files(data) -> None:
    """Every record of the configured problem files (DataError naming file, line and field)."""
    if data.source != "file" or data.get("skip_invalid", False):  # nothing to fail on early
        return
    from jaxprefix.data import read_problem_file

    for path in (data.path, data.eval_path):
        if path:
            read_problem_file(path, question_field=data.question_field,
                              answer_field=data.answer_field, solution_field=data.solution_field)


def _as_config_error(check_fn, *args) -> None:
    """Runs a validator whose ValueErrors name a config field; they become ConfigErrors."""
    try:
        check_fn(*args)
    except UserError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_settings(config, workdir: str) -> None:
    from jaxprefix.jobs.method_settings import check_method_settings, contexts_per_step
    from jaxprefix.rl import loop

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
    check_method_settings(config)
    from jaxprefix.jobs import allocation, isocompute

    if config.job in ("sweep", "prereg"):  # each point is its own run, with its n and batch
        for point in isocompute.sweep_points(config):
            loop.validate(isocompute.point_config(config, point, config.isocompute.seeds[0],
                                                  workdir))
    elif config.job in TRAINING_JOBS:
        config = allocation.allocated(config)  # isocompute.budget: the n, B, M the run will use
        loop.validate(config, contexts_per_step=contexts_per_step(config))


def _check_sft_settings(config) -> None:
    """The sft job's own config (configs/sft.py): the model it would build."""
    from jaxprefix.jobs import sft

    try:
        sft.model_config(config, sft.task_of(config).tokenizer())
    except (ValueError, AttributeError, KeyError) as e:
        raise ConfigError(f"config.model: {e}") from None
