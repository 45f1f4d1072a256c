"""Exact match: the completion's final answer, normalised, equals the reference answer as text.

For answers with one spelling (the built-in procedural tasks, labels, words), where math
equivalence is not wanted and the check must cost microseconds (it runs in-process).
"""

from __future__ import annotations

import re

from jaxprefix.data.problem import Problem
from jaxprefix.rewards.math import extract_answer


def normalize(text: str) -> str:
    """Case, surrounding `$`, a trailing period and runs of whitespace do not count."""
    text = text.strip().strip("$").strip().rstrip(".")
    return re.sub(r"\s+", " ", text).casefold()


def final_answer_text(completion: str) -> str | None:
    """The last `\\boxed{}`, else an "answer is X" / "Answer: X", else the last non-empty line."""
    answer = extract_answer(completion, ("answer_is",))
    if answer is None:
        lines = [line for line in completion.strip().split("\n") if line.strip()]
        answer = lines[-1] if lines else None
    return answer


def exact_match(completion: str, problem: Problem) -> float:
    """Verifier `exact`: 1.0 when the final answer equals `problem.answer` after `normalize`."""
    answer = final_answer_text(completion)
    return 1.0 if answer is not None and normalize(answer) == normalize(problem.answer) else 0.0
