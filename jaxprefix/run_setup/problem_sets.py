"""The problems a job trains and evaluates on, and the verifier that scores them.

`config.data.source` names them:
- 'carry_multiplication', 'keyed_multiplication': the built-in tasks (data/tasks/); training
  candidates and a held-out evaluation set (`digits`, `multipliers`; carry_multiplication's hard
  problems: 20 digits times 6..9, keyed_multiplication's: 8 digits under the key rule '>'), plus
  easy ones for the "+ easy" ablation;
- 'file': JSONL / parquet files (`path`, `eval_path`) with configurable field names;
- 'reasoning_gym': a reasoning-gym generator (`task`), training and evaluation sets by seed;
- 'hf': a local Hugging Face dataset (`path`: a save_to_disk directory, a hub snapshot of
  parquet / JSON lines shards, or one file; data/hf_source.py), split `split`;
- 'tfds': a prepared TFDS dataset directory (`path`, local or gs://), split `split`.
For 'hf' and 'tfds' the evaluation set is split `eval_split` (default 'test') of `eval_path`
(default `path`), read when either is set; field names as for files.

With a `PromptLimit`, a problem whose prompt (as the policy reads it) does not fit the model's
context with room for the completion, or `data.max_prompt_tokens`, is refused with its file and
line, or skipped and counted with `data.skip_invalid` (which also skips bad records of files).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

from absl import logging

from jaxprefix import storage
from jaxprefix.data.problem import DataError, Problem
from jaxprefix.errors import ConfigError

BUILT_IN = ("carry_multiplication", "keyed_multiplication")  # jaxprefix.data.tasks.TASKS
SOURCES = BUILT_IN + ("file", "reasoning_gym", "hf", "tfds")


# reasoning-gym seeds entry i of a set with (seed + i), so sets of nearby seeds share entries
# (seeds 1 and 2 share all but one): the held-out set's seeds start this far from any training
# set's.
HELD_OUT_SEEDS = 1 << 30


@dataclasses.dataclass(frozen=True)
class ProblemSets:
    train: list[Problem]
    eval: list[Problem]
    easy: list[Problem]
    verifier: str  # config.data.verifier: the one name mining, training and evaluation all use
    skipped: int = 0  # problems left out for their prompt length (data.skip_invalid)


@dataclasses.dataclass(frozen=True)
class PromptLimit:
    """At most `max_tokens` prompt tokens, as `prompts.question` renders a problem; `why` says
    where the number comes from."""
    prompts: object
    max_tokens: int
    why: str


def prompt_limit(config, prompts, context_length: int) -> PromptLimit:
    """The model's context less room for the completion, or data.max_prompt_tokens if smaller."""
    new_tokens = config.rollout.max_new_tokens
    room = context_length - new_tokens
    if room < 1:
        raise ConfigError(f"config.rollout.max_new_tokens={new_tokens}: expected fewer than the "
                          f"model's context of {context_length} tokens, with room for a prompt")
    cap = config.data.get("max_prompt_tokens", 0)
    if cap and cap < room:
        return PromptLimit(prompts, cap, f"config.data.max_prompt_tokens={cap}")
    return PromptLimit(prompts, room, f"the model's context of {context_length} tokens less "
                                      f"config.rollout.max_new_tokens={new_tokens}")


def load_problem_sets(data, limit: PromptLimit | None = None, *,
                      rewards_path: str = "") -> ProblemSets:
    """Problem sets from `config.data`, scored by `data.verifier` or, when `rewards_path`
    (config.rewards.path) names one, a function in a file; fails early when neither is a
    verifier, and, with `limit`, on a prompt too long for the policy (skipped with
    data.skip_invalid)."""
    from jaxprefix import rewards

    verifier = rewards.verifier_name(rewards_path, data.verifier)
    where: dict[str, str] = {}  # problem id -> 'file:line N' for problems read from files
    sets = _load(data, where)  # a built-in task registers its verifier here
    if verifier not in rewards.names():
        raise ConfigError(f"config.data.verifier={data.verifier!r}: expected one of "
                          f"{sorted(rewards.names())}")
    sets = dataclasses.replace(sets, verifier=verifier)
    if limit is None:
        return sets
    skip = bool(data.get("skip_invalid", False))
    kept, skipped = {}, []
    for name in ("train", "eval", "easy"):
        kept[name] = []
        for problem in getattr(sets, name):
            problem_where = where.get(problem.id, f"{data.source} problem {problem.id}")
            problem_error = _prompt_error(limit, problem, problem_where)
            if problem_error is None:
                kept[name].append(problem)
            elif skip:
                skipped.append(problem_error)
            else:
                raise DataError(problem_error + "; or data.skip_invalid=True to skip such "
                                                "problems (counted)")
    if skipped:
        logging.warning("skipped %d problems whose prompts the policy cannot take; first: %s",
                        len(skipped), skipped[0])
    if not kept["train"] and sets.train:
        raise DataError(f"every training problem was skipped; first: {skipped[0]}")
    return dataclasses.replace(sets, **kept, skipped=len(skipped))


def _prompt_error(limit: PromptLimit, problem: Problem, where: str) -> str | None:
    """Why the policy cannot take this problem's prompt, or None."""
    try:
        length = len(limit.prompts.question(problem))
    except ValueError as e:  # a character the tokenizer has no token for (built-in tasks)
        return (f"{where}: the question cannot be tokenized ({e}); expected text the policy's "
                f"tokenizer reads")
    if length > limit.max_tokens:
        return (f"{where}: a prompt of {length} tokens, longer than {limit.max_tokens} "
                f"({limit.why}); expected shorter questions")
    return None


def source_fields(data) -> dict:
    """What the loader reads of config.data for its source, read here alone and without loading
    a problem (preflight records these reads; a field another source reads is left unread)."""
    return dict(verifier=data.verifier, skip_invalid=bool(data.get("skip_invalid", False)),
                **_source_fields(data))


def _source_fields(data) -> dict:
    source = data.source
    if source in BUILT_IN:
        from jaxprefix.data import tasks

        return dict(source=source, **tasks.get(source).data_settings(data))
    if source not in SOURCES:
        raise ConfigError(f"config.data.source={source!r}: expected one of {SOURCES}")
    sizes = dict(train_size=data.train_size, eval_size=data.eval_size)
    if source == "reasoning_gym":
        return dict(source=source, task=data.task, task_config=task_config(data),
                    seed=data.seed, eval_seed=data.eval_seed, **sizes)
    fields = dict(question_field=data.question_field, solution_field=data.solution_field,
                  answer_field=data.answer_field)
    if source == "file":
        return dict(source=source, path=data.path, eval_path=data.eval_path, fields=fields,
                    **sizes)
    return dict(source=source, path=data.path, split=data.split, eval_path=data.eval_path,
                eval_split=data.eval_split, fields=fields, **sizes)


# Problem sets by their fields, loaded once a process though preflight, the job and each of a
# study's runs load them (issue 42): generated sources (built-in tasks, reasoning-gym) and
# problem files, a file's entry keyed by its contents too (a local file's digest, a gs:// one's
# size and modification time), so a file that changed is read again. hf/tfds directories are
# read each time (their libraries cache).
_LOADED: dict[str, tuple[ProblemSets, dict]] = {}


def _file_stamp(path: str):
    if storage.is_remote(path):
        return storage.size(path), storage.modified_ns(path)
    return hashlib.sha256(storage.read_bytes(path)).hexdigest()  # far cheaper than parsing


def _file_stamps(f: dict) -> list | None:
    """What says a file source's files are unchanged ([] for a generated source); None for a
    source not cached."""
    if f["source"] in BUILT_IN or f["source"] == "reasoning_gym":
        return []
    paths = [p for p in (f["path"], f["eval_path"]) if p] if f["source"] == "file" else []
    if not paths or not all(map(storage.isfile, paths)):  # none, or the reader's error to say
        return None
    return [_file_stamp(p) for p in paths]


def _load(data, where: dict) -> ProblemSets:
    f = source_fields(data)
    stamps = _file_stamps(f)
    if stamps is None:
        return _fresh_read(data, f, where)
    key = json.dumps([f, stamps], sort_keys=True, default=str)
    if key not in _LOADED:
        found: dict[str, str] = {}
        _LOADED[key] = (_fresh_read(data, f, found), found)
    sets, found = _LOADED[key]
    where.update(found)
    # fresh lists: a caller may reorder its own
    return dataclasses.replace(sets, train=list(sets.train), eval=list(sets.eval),
                               easy=list(sets.easy))


def _fresh_read(data, f: dict, where: dict) -> ProblemSets:
    sets = _read(data, f, where)
    # The built-in tasks draw held-out problems of their own kind (docs/DEMO_TASK.md).
    return sets if f["source"] in BUILT_IN else fresh(sets, f["source"])


def _read(data, f: dict, where: dict) -> ProblemSets:
    source, verifier = f["source"], f["verifier"]
    if source in BUILT_IN:
        from jaxprefix.data import tasks

        return ProblemSets(*tasks.get(source).problem_sets(data), verifier)
    if source == "file":
        from jaxprefix.data import read_problem_file

        if not f["path"]:
            raise ConfigError("config.data.path='': expected a .jsonl, .json or .parquet file "
                              "of training problems (data.source='file')")
        reports = [read_problem_file(p, **f["fields"], skip_invalid=f["skip_invalid"])
                   for p in (f["path"], f["eval_path"]) if p]
        for report in reports:
            where.update((p.id, f"{report.path}:{location}")
                         for p, location in zip(report.problems, report.locations))
        train = reports[0].problems[:f["train_size"] or None]
        held_out = reports[1].problems if f["eval_path"] else []
        return ProblemSets(train, held_out[:f["eval_size"] or None], [], verifier)
    if source in ("hf", "tfds"):
        if source == "hf":
            from jaxprefix.data.hf_source import hf_problems as read
        else:
            from jaxprefix.data.tfds_source import tfds_directory_problems as read
        train = read(f["path"], f["split"], **f["fields"])[:f["train_size"] or None]
        held_out = []
        if f["eval_path"] or f["eval_split"]:
            held_out = read(f["eval_path"] or f["path"], f["eval_split"] or "test", **f["fields"])
        return ProblemSets(train, held_out[:f["eval_size"] or None], [], verifier)
    from jaxprefix.data import reasoning_gym_problems

    settings = f["task_config"]
    train = reasoning_gym_problems(f["task"], f["train_size"], f["seed"], **settings)
    held_out = reasoning_gym_problems(f["task"], f["eval_size"], f["eval_seed"] + HELD_OUT_SEEDS,
                                      **settings)
    return ProblemSets(train, held_out, [], verifier)


def fresh(sets: ProblemSets, source: str) -> ProblemSets:
    """The sets with every held-out problem whose question text a training problem has left
    out: "held-out" means a question the run never trains on (a generator repeats questions at
    small settings, whatever its seed; a file's test split may share questions with its train
    split). The count is logged."""
    seen = {p.question for p in sets.train}
    kept = [p for p in sets.eval if p.question not in seen]
    if len(kept) < len(sets.eval):
        logging.warning("%s: %d of %d held-out problems left out: their questions are training "
                        "questions", source, len(sets.eval) - len(kept), len(sets.eval))
    return dataclasses.replace(sets, eval=kept)


def task_config(data) -> dict:
    """config.data.task_config: the reasoning-gym generator's keywords, a JSON object."""
    text = data.get("task_config", "")
    if not text:
        return {}
    try:
        settings = json.loads(text)
    except json.JSONDecodeError as e:
        settings = e
    if not isinstance(settings, dict):
        raise ConfigError(f"config.data.task_config={text!r}: expected a JSON object of "
                          f"reasoning_gym.create_dataset keywords, e.g. '{{\"min_terms\": 2}}'")
    return settings
