"""The problems a job trains and evaluates on, and the verifier that scores them.

`config.data.source` names them:
- 'carry_multiplication': the built-in demo task; training candidates and a held-out evaluation
  set (`digits`, `multipliers`; the demo's hard problems: 20 digits times 6..9), plus easy ones
  for the "+ easy" ablation;
- 'file': JSONL / parquet files (`path`, `eval_path`) with configurable field names;
- 'reasoning_gym': a reasoning-gym generator (`task`), training and evaluation sets by seed;
- 'hf': a local Hugging Face dataset (`path`: a save_to_disk directory, a hub snapshot of
  parquet / JSON lines shards, or one file; data/hf_source.py), split `split`;
- 'tfds': a prepared TFDS dataset directory (`path`, local or gs://), split `split`.
For 'hf' and 'tfds' the evaluation set is split `eval_split` (default 'test') of `eval_path`
(default `path`), read when either is set; field names as for files.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.data.problem import Problem

SOURCES = ("carry_multiplication", "file", "reasoning_gym", "hf", "tfds")


@dataclasses.dataclass(frozen=True)
class ProblemSets:
    train: list[Problem]
    eval: list[Problem]
    easy: list[Problem]
    verifier: str  # config.data.verifier: the one name mining, training and evaluation all use


def load_problem_sets(data, rewards_path: str = "") -> ProblemSets:
    """Problem sets from `config.data`, scored by `data.verifier` or, when `rewards_path`
    (config.rewards.path) names one, a function in a file; fails early when neither is a
    verifier."""
    from jaxprefix import rewards

    verifier = rewards.verifier_name(rewards_path, data.verifier)
    sets = _load(data)  # a built-in task registers its verifier here
    if verifier not in rewards.names():
        raise ValueError(f"config.data.verifier={data.verifier!r}: expected one of "
                         f"{sorted(rewards.names())}")
    return dataclasses.replace(sets, verifier=verifier)


def _load(data) -> ProblemSets:
    if data.source == "carry_multiplication":
        from jaxprefix.data.tasks import carry_multiplication as task

        task.register_verifier()
        shape = dict(digits=tuple(data.digits), multipliers=tuple(data.multipliers))
        train = task.generate(data.train_size, seed=data.seed, **shape)
        held_out = task.generate(data.eval_size, seed=data.eval_seed, **shape)
        easy = task.generate(data.get("easy_size", 0), digits=tuple(data.easy_digits),
                             seed=data.seed + 1) if data.get("easy_size", 0) else []
        return ProblemSets(train, held_out, easy, data.verifier)
    if data.source == "file":
        from jaxprefix.data import load_problems

        fields = dict(question_field=data.question_field, solution_field=data.solution_field,
                      answer_field=data.answer_field)
        train = load_problems(data.path, **fields)[:data.train_size or None]
        held_out = load_problems(data.eval_path, **fields) if data.eval_path else []
        return ProblemSets(train, held_out[:data.eval_size or None], [], data.verifier)
    if data.source in ("hf", "tfds"):
        if data.source == "hf":
            from jaxprefix.data.hf_source import hf_problems as read
        else:
            from jaxprefix.data.tfds_source import tfds_directory_problems as read
        fields = dict(question_field=data.question_field, solution_field=data.solution_field,
                      answer_field=data.answer_field)
        train = read(data.path, data.split, **fields)[:data.train_size or None]
        held_out = []
        if data.eval_path or data.eval_split:
            held_out = read(data.eval_path or data.path, data.eval_split or "test", **fields)
        return ProblemSets(train, held_out[:data.eval_size or None], [], data.verifier)
    if data.source == "reasoning_gym":
        from jaxprefix.data import reasoning_gym_problems

        train = reasoning_gym_problems(data.task, data.train_size, data.seed)
        held_out = reasoning_gym_problems(data.task, data.eval_size, data.eval_seed)
        return ProblemSets(train, held_out, [], data.verifier)
    raise ValueError(f"config.data.source={data.source!r}: expected one of {SOURCES}")
