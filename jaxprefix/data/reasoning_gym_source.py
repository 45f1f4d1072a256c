"""Problems from reasoning-gym's offline procedural generators (basic_arithmetic, gsm_symbolic, ...).

`reasoning_gym.create_dataset(task, seed=, size=, **config)` is deterministic, so a problem stores
only (task, seed, size, config, index) in its metadata; the `reasoning_gym` verifier rebuilds the
dataset from them in its worker process and scores with the generator's own `score_answer`.
Where a generator writes a worked solution into its entry metadata (gsm_symbolic's `answer_cot`,
or an `explanation`), it becomes the oracle solution; else, where data/worked_solutions.py has a
writer for the task (chain_sum), that writes one; otherwise `solution` stays None.
"""

from __future__ import annotations

import json
from typing import Any

from jaxprefix.data.problem import DataError, Problem
from jaxprefix.data.worked_solutions import WRITERS

# Entry-metadata keys that hold a worked solution as text, in order of preference. Many
# generators also use `solution` for the bare answer object; only text longer than the answer
# counts as an oracle solution.
ORACLE_KEYS = ("answer_cot", "explanation", "cot", "rationale", "solution")


def _create(task: str, seed: int, size: int, config: dict[str, Any]):
    import reasoning_gym  # 0.7 s of imports, paid only by users of this source

    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    except Exception as e:
        raise DataError(f"reasoning-gym task {task!r} (seed={seed}, size={size}, config={config}): "
                        f"cannot be created: {e}") from e


def _oracle_text(task: str, entry: dict, answer: str) -> str | None:
    entry_metadata = entry.get("metadata") or {}
    for key in ORACLE_KEYS:
        text = entry_metadata.get(key)
        if isinstance(text, str) and len(text.strip()) > len(answer.strip()):
            return text
    return WRITERS[task](entry) if task in WRITERS else None


def reasoning_gym_problems(task: str, size: int, seed: int, **config: Any) -> list[Problem]:
    """`size` problems of the reasoning-gym generator `task`; `config` goes to its config class."""
    if size <= 0:
        raise DataError(f"reasoning-gym task {task!r}: size must be positive, got {size}")
    dataset = _create(task, seed, size, config)
    config_json = json.dumps(config, sort_keys=True)
    problems = []
    for index in range(size):
        entry = dataset[index]
        answer = str(entry["answer"])
        entry_metadata = dict(entry.get("metadata") or {})
        difficulty = entry_metadata.get("difficulty")
        metadata = {
            "rg_task": task, "rg_seed": seed, "rg_size": size, "rg_config": config_json,
            "rg_index": index, "tags": [task],
            "entry": entry_metadata,
        }
        if isinstance(difficulty, (int, float)):
            metadata["difficulty"] = difficulty
        problems.append(Problem(
            id=f"rg/{task}/{seed}/{config_json}/{index}" if config else f"rg/{task}/{seed}/{index}",
            question=entry["question"], answer=answer,
            solution=_oracle_text(task, entry, answer),
            source=f"reasoning_gym/{task}", metadata=metadata))
    return problems
