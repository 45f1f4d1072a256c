"""Math answers: extract the final answer of a completion, decide equivalence with math-verify.

The final answer is the content of the LAST `\\boxed{...}` (braces balanced, so `\\boxed{\\frac{1}{2}}`
is whole); a completion that changes its mind is judged on what it settled on, and parsing the
whole completion would give math-verify a set of every boxed answer. Where there is no box,
configurable fallbacks apply in order: `answer_is` ("the final answer is X", "Answer: X") and
`last_number`.

math-verify guards itself with signal.alarm, which fails outside the main thread, so its timeouts
are switched off here (`parsing_timeout=None, timeout_seconds=None`); the worker pool of
`jaxprefix.rewards.pool` enforces the time limit by killing the worker instead.
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from jaxprefix.data.problem import Problem

# math-verify warns once per process that its own timeouts are off; the pool enforces them.
logging.getLogger("math_verify").setLevel(logging.ERROR)

FALLBACKS = ("answer_is", "last_number")
DEFAULT_FALLBACKS = ("answer_is",)

_BOX_NAMES = ("\\boxed", "\\fbox")
_BRACES = re.compile(r"[{}]")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?(.+)", re.IGNORECASE)  # up to the end of its line
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) with balanced braces, else None.

    Linear in the text (policy output is untrusted: a megabyte of unclosed `\\boxed{` must not
    take hours): one pass pairs every brace, then closed braces are tried from the last, each
    looking back over its whitespace for the box command.
    """
    closing = _closing_braces(text)
    for opening in sorted(closing, reverse=True):  # an unclosed last box falls back to the one before
        before = opening
        while before > 0 and text[before - 1].isspace():
            before -= 1
        if text.endswith(_BOX_NAMES, 0, before):
            return text[opening + 1:closing[opening]].strip()
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """Position of each '{' that is closed -> position of its '}'."""
    pairs, open_at = {}, []
    for m in _BRACES.finditer(text):
        if m.group() == "{":
            open_at.append(m.start())
        elif open_at:
            pairs[open_at.pop()] = m.start()
    return pairs


def extract_answer(completion: str, fallbacks: tuple[str, ...] = DEFAULT_FALLBACKS) -> str | None:
    """The completion's final answer as text: last box, else the first fallback that matches."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    for fallback in fallbacks:
        if fallback == "answer_is":
            matches = _ANSWER_IS.findall(completion)
            if matches:
                return matches[-1].strip().rstrip(".").strip().strip("$").strip()
        elif fallback == "last_number":
            numbers = _NUMBER.findall(completion)
            if numbers:
                return numbers[-1]
        else:
            raise ValueError(f"unknown answer fallback {fallback!r}; expected one of {FALLBACKS}")
    return None


def _as_latex(answer: str) -> str:
    # math-verify only reads LaTeX inside delimiters: a bare "1/2" or "\frac12" must be wrapped.
    if "$" in answer or "\\boxed" in answer or "\\(" in answer or "\\[" in answer:
        return answer
    return f"${answer}$"


def _parse(text: str):
    return parse(_as_latex(text), extraction_config=_EXTRACTION, parsing_timeout=None)


def math_reward(completion: str, answer: str, *, fallbacks: tuple[str, ...] = DEFAULT_FALLBACKS) -> float:
    """1.0 if the completion's final answer equals `answer` mathematically (math-verify), else 0.0.

    No time limit of its own: call it through `score_batch` (worker processes) when the text comes
    from a policy, as some answers (`\\boxed{9^{9^{9^9}}}`) take sympy forever.
    """
    predicted = extract_answer(completion, fallbacks)
    if predicted is None or not predicted.strip():
        return 0.0
    gold = _parse(str(answer))
    guess = _parse(predicted)
    if not gold or not guess:
        return 0.0
    return 1.0 if verify(gold, guess, timeout_seconds=None) else 0.0


def answer_key(completion: str, fallbacks: tuple[str, ...] = DEFAULT_FALLBACKS) -> str | None:
    """A normalised answer string for majority voting (maj@k): spacing and `\\dfrac` folded."""
    predicted = extract_answer(completion, fallbacks)
    if predicted is None:
        return None
    key = re.sub(r"\s+", "", predicted).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key.rstrip(".") or None


def math_verifier(completion: str, problem: Problem) -> float:
    """Verifier `math`: the problem's reference answer against the completion's last box."""
    return math_reward(completion, problem.answer)


def math_verifier_lenient(completion: str, problem: Problem) -> float:
    """Verifier `math_lenient`: as `math`, also reading "answer is X" and then the last number."""
    return math_reward(completion, problem.answer, fallbacks=FALLBACKS)


def format_reward(completion: str, problem: Problem) -> float:
    """Verifier `format`: 1.0 when the completion ends its reasoning with a closed `\\boxed{}`."""
    del problem  # the format does not depend on the problem
    return 1.0 if last_boxed(completion) else 0.0
