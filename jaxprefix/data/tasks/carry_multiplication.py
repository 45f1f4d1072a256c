"""The demo task: an N-digit number times one digit, written out with carries, one step per digit.

Text layout (one character per token, fixed slots, digits least significant first):

    question   slot i = a_i s_i c_i for i = 0..19, then  x  d  =    '_' marks what is unused:
               the whole slot past the number; s_i c_i, a hint, unless step i is given
    step i     +  s_i c_i     (or the same step written ^ c_i s_i)
    end        <eos> once the next digit slot is '_' (or after the last slot)

Step i computes t = a_i * d + c_{i-1} (c_{-1} = 0) and writes s_i = t mod 10 and c_i = t // 10.
The product is c_{N-1} s_{N-1} .. s_0. Every step is the same skill (about 900 (a_i, d, carry)
facts) at a fixed position, so RL on the continuation of a guided problem trains exactly what the
unguided problem needs. Each step has two notations: '+' writes the sum digit first, '^' writes the
two-digit t tens first (carry, then sum digit). Both are correct, so a solution has 2^N valid
spellings: traces sampled from a policy trained on both differ from the canonical oracle ('+' at
every step), as PrefixRL's mined traces differ from a reference solution, while the arithmetic
underneath is the same. The verifier is exact: every step must be right and nothing may follow
the last one, so neither guessing nor stopping early earns reward. See docs/DEMO_TASK.md.

Guidance comes in the two forms POPE's has on an LLM (docs/DEMO_TASK.md):
- in the prompt (`hinted(problem, k)`, POPE's 'instruction' mode): slots 0..k-1 carry the oracle's
  sum digit and carry as a hint, and the policy writes the WHOLE solution itself (copying the
  given steps or not). The hint is prompt, never trained on by RL; the answer is scored as is.
  Step i of the answer sits exactly one question length after slot i, so reading a hint is the
  same fixed-distance lookup as reading a_i.
- as the start of the answer (`guided(problem, k)`, 'solution_prefix'): the question continues
  with the first k oracle steps and the policy writes the rest; the verifier reads the given steps
  back from the question. Score such a context against `guided(problem, k)`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from jaxprefix.data.problem import Problem

NAME = "carry_multiplication"
SLOTS = 20  # digit slots of the question; the most digits a problem can have
EMPTY = "_"  # an unused digit slot
TIMES, EQUALS = "x", "="
SUM_FIRST, TENS_FIRST = "+", "^"  # the two notations of a step
EOS, PAD = "<eos>", "<pad>"
SYMBOLS = tuple("0123456789") + (EMPTY, TIMES, EQUALS, SUM_FIRST, TENS_FIRST)
STEP_LENGTH = 3
SLOT_LENGTH = 3  # a_i, then the hint's sum digit and carry: slot i and step i share a layout
QUESTION_LENGTH = SLOTS * SLOT_LENGTH + 3
# Longest completion: every step, then <eos>.
MAX_COMPLETION_LENGTH = SLOTS * STEP_LENGTH + 1
SEQUENCE_LENGTH = QUESTION_LENGTH + MAX_COMPLETION_LENGTH
HARD_STEPS = SLOTS  # oracle steps of a hard problem


def tokenizer():
    """The character vocabulary of this task (the SYMBOLS plus <eos> and <pad>)."""
    from jaxprefix.tokenizers import CharTokenizer

    return CharTokenizer(SYMBOLS, eos=EOS, pad=PAD)


def carry_steps(digits: Sequence[int], multiplier: int) -> list[tuple[int, int]]:
    """(s_i, c_i) for each digit of a (least significant first) times a one-digit multiplier."""
    carry, steps = 0, []
    for digit in digits:
        total = digit * multiplier + carry
        carry = total // 10
        steps.append((total % 10, carry))
    return steps


def write_step(sum_digit: int, carry: int, notation: str = SUM_FIRST) -> str:
    if notation == SUM_FIRST:
        return f"{SUM_FIRST}{sum_digit}{carry}"
    if notation == TENS_FIRST:
        return f"{TENS_FIRST}{carry}{sum_digit}"
    raise ValueError(f"step notation must be {SUM_FIRST!r} or {TENS_FIRST!r}, got {notation!r}")


def make_problem(number: int, multiplier: int) -> Problem:
    """The problem number * multiplier with its canonical oracle solution ('+' at every step)."""
    if not 1 <= multiplier <= 9:
        raise ValueError(f"{NAME}: multiplier must be one digit 1..9, got {multiplier}")
    digits = [int(ch) for ch in reversed(str(number))]
    if number < 1 or len(digits) > SLOTS:
        raise ValueError(f"{NAME}: number must be positive with 1..{SLOTS} digits, got {number}")
    slots = "".join(f"{d}{EMPTY}{EMPTY}" for d in digits)  # hint places empty
    slots += EMPTY * SLOT_LENGTH * (SLOTS - len(digits))
    question = f"{slots}{TIMES}{multiplier}{EQUALS}"
    steps = tuple(write_step(s, c) for s, c in carry_steps(digits, multiplier))
    return Problem(
        id=f"{NAME}-{number}x{multiplier}",
        question=question,
        answer=str(number * multiplier),
        solution="".join(steps),
        steps=steps,
        source=NAME,
        metadata={"digits": len(digits), "multiplier": multiplier, "prefix_steps": 0},
    )


def generate(count: int, *, digits: tuple[int, int] = (1, SLOTS),
             multipliers: tuple[int, int] = (2, 9), seed: int = 0) -> list[Problem]:
    """`count` problems, digit count N and multiplier d uniform in the inclusive ranges given.

    N is the difficulty knob: a problem is N identical steps, and a policy that gets one step right
    with probability p solves it with probability about p^N.
    """
    check_ranges(NAME, SLOTS, digits, multipliers)
    rng = random.Random(seed)
    return [make_problem(random_number(rng, digits), rng.randint(*multipliers))
            for _ in range(count)]


def check_ranges(task: str, slots: int, digits: tuple[int, int],
                 multipliers: tuple[int, int]) -> None:
    """A generator's digit-count and multiplier ranges, or a ValueError naming the task."""
    if not 1 <= digits[0] <= digits[1] <= slots:
        raise ValueError(f"{task}: digits range must lie in 1..{slots}, got {digits}")
    if not 1 <= multipliers[0] <= multipliers[1] <= 9:
        raise ValueError(f"{task}: multipliers range must lie in 1..9, got {multipliers}")


def random_number(rng: random.Random, digits: tuple[int, int]) -> int:
    """A number of a uniform digit count in the range; the leading digit is nonzero, so the
    count is the true one."""
    n = rng.randint(*digits)
    return rng.randint(10 ** (n - 1), 10**n - 1)


def hard_set(count: int, *, seed: int = 0) -> list[Problem]:
    """The hard problems of the demo: 20 digits times 6..9 (2 and 5 are learned early)."""
    return generate(count, digits=(SLOTS, SLOTS), multipliers=(6, 9), seed=seed)


def data_settings(data) -> dict:
    """The fields of config.data that `problem_sets` uses, read here alone."""
    easy_size = data.get("easy_size", 0)
    return dict(digits=tuple(data.digits), multipliers=tuple(data.multipliers),
                train_size=data.train_size, eval_size=data.eval_size, seed=data.seed,
                eval_seed=data.eval_seed, easy_size=easy_size,
                easy_digits=tuple(data.easy_digits) if easy_size else None)


def problem_sets(data) -> tuple[list, list, list]:
    """(training candidates, held-out, easy) for config.data: problems of data.digits digits
    times data.multipliers, and data.easy_size easy ones of data.easy_digits."""
    s = data_settings(data)
    shape = dict(digits=s["digits"], multipliers=s["multipliers"])
    easy = generate(s["easy_size"], digits=s["easy_digits"], seed=s["seed"] + 1) \
        if s["easy_size"] else []
    return (generate(s["train_size"], seed=s["seed"], **shape),
            generate(s["eval_size"], seed=s["eval_seed"], **shape), easy)


def _parse_question(question: str) -> tuple[list[int], int, list[str]]:
    """Digits of a, the multiplier, and the steps already given after '=' (guided problems).
    Hints are skipped: they change nothing the answer must be."""
    head, given = question[:QUESTION_LENGTH], question[QUESTION_LENGTH:]
    tail = SLOTS * SLOT_LENGTH
    number = head[:tail:SLOT_LENGTH].rstrip(EMPTY)
    if (len(head) != QUESTION_LENGTH or head[tail] != TIMES or head[-1] != EQUALS
            or not head[tail + 1].isdigit() or not number.isdigit()
            or len(given) % STEP_LENGTH):
        raise ValueError(f"{NAME}: malformed question {question!r}: expected {SLOTS} slots of "
                         f"{SLOT_LENGTH} (a digit or '{EMPTY}', then a hint or '{EMPTY}{EMPTY}'), "
                         f"'{TIMES}', one digit, '{EQUALS}', whole steps")
    steps = [given[i:i + STEP_LENGTH] for i in range(0, len(given), STEP_LENGTH)]
    return [int(ch) for ch in number], int(head[tail + 1]), steps


def spell_solution(problem: Problem, notations: Sequence[str]) -> str:
    """The problem's remaining solution spelled with the given notation per step (one per step)."""
    digits, multiplier, given = _parse_question(problem.question)
    remaining = carry_steps(digits, multiplier)[len(given):]
    if len(notations) != len(remaining):
        raise ValueError(f"{NAME}: {len(remaining)} steps remain in {problem.id}, got "
                         f"{len(notations)} notations")
    return "".join(write_step(s, c, n) for (s, c), n in zip(remaining, notations))


def sample_solution(problem: Problem, rng: random.Random, tens_first: float = 0.5) -> str:
    """A valid solution with each step's notation drawn at random (SFT data covers both)."""
    remaining = len(problem.steps)
    notations = [TENS_FIRST if rng.random() < tens_first else SUM_FIRST for _ in range(remaining)]
    return spell_solution(problem, notations)


def hinted(problem: Problem, steps: int) -> Problem:
    """The problem with its first `steps` oracle steps given in the prompt (POPE's 'instruction'
    mode): slot i holds a_i, s_i, c_i. The solution is still the whole solution, which the policy
    writes itself; `verify` reads nothing from the hints."""
    if steps == 0:
        return problem
    check_hint_steps(NAME, problem, steps)
    slots = list(problem.question)
    for i, (s, c) in enumerate(carry_steps(*_parse_question(problem.question)[:2])[:steps]):
        slots[i * SLOT_LENGTH + 1:i * SLOT_LENGTH + 3] = f"{s}{c}"
    return dataclasses.replace(
        problem, id=f"{problem.id}/hint{steps}", question="".join(slots),
        metadata={**problem.metadata, "hint_steps": steps, "base_id": problem.id})


def check_hint_steps(task: str, problem: Problem, steps: int) -> None:
    """A hint of `steps` oracle steps fits an unguided problem, or a ValueError naming it."""
    if problem.metadata.get("prefix_steps") or problem.metadata.get("hint_steps"):
        raise ValueError(f"{task}: {problem.id} is already guided; hint the original problem")
    if not 0 < steps <= len(problem.steps):
        raise ValueError(f"{task}: hint steps must be in 0..{len(problem.steps)} for "
                         f"{problem.id}, got {steps}")


def hinted_solution(problem: Problem, rng: random.Random, tens_first: float = 0.5) -> str:
    """SFT target of a hinted problem: the hinted steps copied as given ('+'), the rest with
    each notation drawn at random."""
    given = problem.metadata.get("hint_steps", 0)
    notations = [SUM_FIRST] * given + [TENS_FIRST if rng.random() < tens_first else SUM_FIRST
                                       for _ in range(len(problem.steps) - given)]
    return spell_solution(problem, notations)


def guided(problem: Problem, prefix_steps: int) -> Problem:
    """The problem with its first `prefix_steps` oracle steps forced as the start of the solution.

    Its question is the context the policy continues; its steps are the ones left to write. The
    answer is unchanged, and the verifier reads the given steps back from the question.
    """
    if prefix_steps == 0:
        return problem
    if not 0 < prefix_steps <= len(problem.steps):
        raise ValueError(f"{NAME}: prefix_steps must be in 0..{len(problem.steps)} for "
                         f"{problem.id}, got {prefix_steps}")
    given = problem.steps[:prefix_steps]
    rest = problem.steps[prefix_steps:]
    return Problem(
        id=f"{problem.id}/prefix{prefix_steps}",
        question=problem.question + "".join(given),
        answer=problem.answer,
        solution="".join(rest),
        steps=rest,
        source=problem.source,
        metadata={**problem.metadata, "prefix_steps": problem.metadata.get("prefix_steps", 0)
                  + prefix_steps, "base_id": problem.metadata.get("base_id", problem.id)},
    )


def sft_batch(data, seed: int) -> list[tuple[Problem, str]]:
    """(problem, target) rows of one SFT batch (configs/sft.py `data`): lengths in data.digits
    plus a data.full_length_fraction of 20-digit rows, a data.hinted_fraction of rows with their
    first 1..N-1 steps as a hint (copied by the target), each other step's notation at random."""
    full = round(data.batch_size * data.full_length_fraction)
    problems = (generate(data.batch_size - full, digits=tuple(data.digits),
                         multipliers=tuple(data.multipliers), seed=seed)
                + generate(full, digits=(SLOTS, SLOTS), multipliers=tuple(data.multipliers),
                           seed=seed + 10**12))
    rng = random.Random(seed)
    rows = []
    for problem in problems:
        if len(problem.steps) > 1 and rng.random() < data.hinted_fraction:
            problem = hinted(problem, rng.randint(1, len(problem.steps) - 1))
        rows.append((problem, hinted_solution(problem, rng, data.tens_first)))
    return rows


def answer_digit_spans(problem: Problem) -> list[tuple[int, int]]:
    """Token spans [start, end) of each step's two digits in question + oracle solution (what
    teacher-forced step accuracy checks: the marker is free)."""
    return [(QUESTION_LENGTH + STEP_LENGTH * i + 1, QUESTION_LENGTH + STEP_LENGTH * i + 3)
            for i in range(len(problem.steps))]


def format_context(problem: Problem, prefix_steps: int = 0, tokenizer=None) -> list[int]:
    """Token ids the policy continues: the question, then `prefix_steps` oracle steps."""
    tokenizer = tokenizer or _default_tokenizer()
    return tokenizer.encode(guided(problem, prefix_steps).question)


def training_ids(problem: Problem, solution: str, tokenizer=None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of question + solution + <eos>; the mask is 1 on the solution."""
    tokenizer = tokenizer or _default_tokenizer()
    context = tokenizer.encode(problem.question)
    target = tokenizer.encode(solution) + [tokenizer.eos_id]
    return context + target, [0] * len(context) + [1] * len(target)


_TOKENIZER = None


def _default_tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = tokenizer()
    return _TOKENIZER


def verify(completion_text: str, problem: Problem) -> float:
    """1.0 if question + completion is a complete correct solution in any notation, else 0.0.

    The completion may end with '<eos>' (and padding); anything else after the last step, a
    missing step or a wrong digit scores 0.
    """
    text = completion_text.split(EOS, 1)[0] if EOS in completion_text else completion_text
    text = text.replace(PAD, "").strip()
    try:
        digits, multiplier, given = _parse_question(problem.question + text)
    except ValueError:
        return 0.0
    return score_steps(given, carry_steps(digits, multiplier), problem.answer)


def score_steps(given: Sequence[str], expected: Sequence[tuple[int, int]], answer: str) -> float:
    """1.0 if the written steps are the expected (s_i, c_i), each in either notation, and the
    number they spell is the answer; else 0.0."""
    if len(given) != len(expected):
        return 0.0
    for step, (s, c) in zip(given, expected):
        if step not in (write_step(s, c, SUM_FIRST), write_step(s, c, TENS_FIRST)):
            return 0.0
    product = int(f"{expected[-1][1]}" + "".join(str(s) for s, _ in reversed(expected)))
    return float(str(product) == answer.strip())


def sequence_length(data) -> int:
    """The longest row of the SFT data (the base's context): question, whole solution, <eos>."""
    return SEQUENCE_LENGTH
