"""The key-step task: a * d + c written out with carries, d and c first read off a key.

POPE's paper regime (docs/DEMO_TASK.md): hard problems fail at one key EARLY step that the base
policy rarely finds, and a prefix holding that step (1 of 9 steps) lets the base finish them.

Text layout (one character per token, fixed slots, digits least significant first):

    question   r k j   slot i = a_i s_i c_i for i = 0..7   x u v p q =
               r: the key's rule, '<' (d = u and c = p) or '>' (d = v and c = q);
               k j: hints of d and c, '__' unless the key step is given; '_' marks what is unused
    key step   * d c
    step i     + s_i c_i  (or ^ c_i s_i)     t = a_i*d + c_{i-1}, with c_{-1} = c
    end        <eos> once the next digit slot is '_' (or after the last slot)

The base's SFT (`sft_batch`) never shows what rule '>' means: its '>' problems have equal key
digits (u = v, p = q), so in all it reads, d is u and c is p whatever the rule. Unguided, on a
'>' problem with unequal digits it reads u and p out of habit, and writes the right key step
only when it slips on both. So the hard set (rule '>', 8 digits) fails at the key step, and the
shortest solvable prefix is that step alone: 1 of 9 oracle steps. A guided rollout copies d and
c from the hint and trains the carry steps; it gives the unguided problem's skill (reading the
second digits under '>') no gradient of its own, so any transfer is the policy's own doing.

Step i of the answer sits exactly one question length after slot i of the question (the key
step after r k j, carry step i after digit slot i), as in carry_multiplication: every hint is
read by a lookup at one fixed distance.

The restating route (issue 28, `data.key_names_rule`, off by default): the key step NAMES the
rule it reads the key by in place of '*' (`> d c`: "by rule '>', d and c are ..."; where both
rules read the key right, as on SFT's '>' rows with equal digits, it names the first), so its
first token is the insight and its digits are the read. `restated(problem)` guides a problem by
the token-level prefix of its oracle solution up to and including that name: the policy then
reads d and c itself, and the samples of a group differ exactly at that read. The value hint
(`hinted`) stays as the no_restate arm. Off, every problem, batch and verdict is as before.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence

from jaxprefix.data.problem import Problem
from jaxprefix.data.tasks import carry_multiplication as carry
from jaxprefix.data.tasks.carry_multiplication import (EMPTY, EOS, PAD, SUM_FIRST, TENS_FIRST,
                                                       write_step)

NAME = "keyed_multiplication"
SLOTS = 8  # digit slots; the most digits a problem can have
FIRST, SECOND = "<", ">"  # the key's rules: d, c are u, p; or v, q
KEY = "*"  # the key step's marker
KEY_MARKERS = (KEY, FIRST, SECOND)  # '*', or the rule the key step names (data.key_names_rule)
TIMES, EQUALS = carry.TIMES, carry.EQUALS
SYMBOLS = carry.SYMBOLS + (FIRST, SECOND, KEY)
SLOT_LENGTH = STEP_LENGTH = 3  # the key slot r k j and the key step * d c too
KEY_DIGITS = 4  # u v p q
QUESTION_LENGTH = SLOT_LENGTH * (1 + SLOTS) + KEY_DIGITS + 2
MAX_COMPLETION_LENGTH = STEP_LENGTH * (1 + SLOTS) + 1
SEQUENCE_LENGTH = QUESTION_LENGTH + MAX_COMPLETION_LENGTH
HARD_STEPS = SLOTS + 1  # oracle steps of a hard problem: the key, then one per digit

# Tool episodes (issue 31, docs/TOOLS.md): the policy may ask the key reader instead of reading
# the key itself. In the task's own symbols, one token each:
#   call turn     x r u v p q <eos>   the rule and the key, copied from the question
#   observation   d c =               the reader's answer ('__=' when the call failed)
#   answer turn   * d c + s_0 c_0 ... <eos>, the solution as without the tool
CALL = TIMES  # a turn that starts with it is a call (a solution starts with '*', '<' or '>')
CALL_LENGTH = 2 + KEY_DIGITS + 1
OBSERVATION_LENGTH = 3
FAILED = EMPTY * 2  # the observation's digits when the call failed
EPISODE_LENGTH = SEQUENCE_LENGTH + CALL_LENGTH + OBSERVATION_LENGTH


def tokenizer():
    """The character vocabulary of this task (carry_multiplication's plus < > *)."""
    from jaxprefix.tokenizers import CharTokenizer

    return CharTokenizer(SYMBOLS, eos=EOS, pad=PAD)


def carry_steps(digits: Sequence[int], multiplier: int, carry_in: int) -> list[tuple[int, int]]:
    """(s_i, c_i) for each digit of a (least significant first) of a * multiplier + carry_in."""
    steps, c = [], carry_in
    for digit in digits:
        total = digit * multiplier + c
        c = total // 10
        steps.append((total % 10, c))
    return steps


def make_problem(number: int, multiplier: int, carry_in: int, rule: str,
                 others: tuple[int, int], *, names_rule: bool = False) -> Problem:
    """number * multiplier + carry_in, d and c behind a key: rule '<' puts them at u and p (the
    `others` at v and q), rule '>' at v and q. Oracle: the key step, then '+' at every step.
    With `names_rule` the key step starts with the rule it reads the key by, not '*'."""
    if rule not in (FIRST, SECOND):
        raise ValueError(f"{NAME}: rule must be {FIRST!r} or {SECOND!r}, got {rule!r}")
    if not 1 <= multiplier <= 9 or not all(0 <= x <= 9 for x in (carry_in, *others)):
        raise ValueError(f"{NAME}: multiplier must be 1..9, the carry and key digits 0..9, got "
                         f"{multiplier}, {carry_in}, {others}")
    digits = [int(ch) for ch in reversed(str(number))]
    if number < 1 or len(digits) > SLOTS:
        raise ValueError(f"{NAME}: number must be positive with 1..{SLOTS} digits, got {number}")
    u, v = (multiplier, others[0]) if rule == FIRST else (others[0], multiplier)
    p, q = (carry_in, others[1]) if rule == FIRST else (others[1], carry_in)
    slots = "".join(f"{d}{EMPTY}{EMPTY}" for d in digits)
    slots += EMPTY * SLOT_LENGTH * (SLOTS - len(digits))
    question = f"{rule}{EMPTY}{EMPTY}{slots}{TIMES}{u}{v}{p}{q}{EQUALS}"
    marker = key_name(u, p, multiplier, carry_in) if names_rule else KEY
    steps = (f"{marker}{multiplier}{carry_in}",) + tuple(
        write_step(s, c) for s, c in carry_steps(digits, multiplier, carry_in))
    return Problem(
        id=f"{NAME}-{number}x{u}{v}+{p}{q}{rule}", question=question,
        answer=str(number * multiplier + carry_in), solution="".join(steps), steps=steps,
        source=NAME, metadata={"digits": len(digits), "multiplier": multiplier,
                               "carry_in": carry_in, "rule": rule, "prefix_steps": 0,
                               **({"key_names_rule": True} if names_rule else {})})


def key_name(u: int, p: int, multiplier: int, carry_in: int) -> str:
    """The rule a key step reads the key by: '<' where the first digits are d and c (every '<'
    problem, and a '>' problem whose pairs hold equal digits: both rules read it right, and the
    first is the reading every SFT row does), else '>'."""
    return FIRST if (u, p) == (multiplier, carry_in) else SECOND


def restating_notation(data) -> bool:
    """Whether config.data (or config.sft.data) asks for key steps that name their rule."""
    value = data.get("key_names_rule", False)
    if not isinstance(value, bool):
        raise ValueError(f"config.data.key_names_rule={value!r}: expected True or False")
    return value


def _other_digits(rng: random.Random, d: int, c: int) -> tuple[int, int]:
    """Two key digits unequal to d and c, drawn in that order: a read of them is never d, c."""
    return (rng.choice([x for x in range(10) if x != d]),
            rng.choice([x for x in range(10) if x != c]))


def generate(count: int, *, digits: tuple[int, int] = (1, SLOTS),
             multipliers: tuple[int, int] = (2, 9), rule: str = SECOND,
             seed: int = 0, names_rule: bool = False) -> list[Problem]:
    """`count` problems of one rule: digit count, multiplier and carry-in uniform in their
    ranges, each other key digit uniform among the digits that differ from the one it stands
    beside (so that under '>' reading u or p is always wrong)."""
    carry.check_ranges(NAME, SLOTS, digits, multipliers)
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        number = carry.random_number(rng, digits)
        d, c = rng.randint(*multipliers), rng.randrange(10)
        others = _other_digits(rng, d, c)
        problems.append(make_problem(number, d, c, rule, others, names_rule=names_rule))
    return problems


def hard_set(count: int, *, seed: int = 0, names_rule: bool = False) -> list[Problem]:
    """The hard problems: 8 digits, rule '>' (the key the base never learned to read)."""
    return generate(count, digits=(SLOTS, SLOTS), rule=SECOND, seed=seed, names_rule=names_rule)


def data_settings(data) -> dict:
    """The fields of config.data that `problem_sets` uses, read here alone."""
    easy_size = data.get("easy_size", 0)
    key_given = data.get("key_given", False)
    if not isinstance(key_given, bool):
        raise ValueError(f"config.data.key_given={key_given!r}: expected True or False")
    return dict(digits=tuple(data.digits), multipliers=tuple(data.multipliers),
                names_rule=restating_notation(data), train_size=data.train_size,
                eval_size=data.eval_size, seed=data.seed, eval_seed=data.eval_seed,
                easy_size=easy_size, easy_digits=tuple(data.easy_digits) if easy_size else None,
                key_given=key_given)


def problem_sets(data) -> tuple[list, list, list]:
    """(training candidates, held-out, easy) for config.data: rule '>' problems of data.digits
    digits, and as many easy rule '<' problems of data.easy_digits as data.easy_size asks. With
    data.key_given every problem is `hinted` by its key step: d and c in the prompt."""
    s = data_settings(data)
    shape = dict(digits=s["digits"], multipliers=s["multipliers"], rule=SECOND,
                 names_rule=s["names_rule"])
    easy = generate(s["easy_size"], digits=s["easy_digits"], rule=FIRST, seed=s["seed"] + 1,
                    names_rule=s["names_rule"]) if s["easy_size"] else []
    sets = (generate(s["train_size"], seed=s["seed"], **shape),
            generate(s["eval_size"], seed=s["eval_seed"], **shape), easy)
    if s["key_given"]:
        sets = tuple([hinted(p, 1) for p in problems] for problems in sets)
    return sets


def _parse_question(question: str) -> tuple[list[int], int, int, list[str]]:
    """Digits of a, the multiplier and carry the key names, and the steps given after '='."""
    head, given = question[:QUESTION_LENGTH], question[QUESTION_LENGTH:]
    tail = SLOT_LENGTH * (1 + SLOTS)
    number = head[SLOT_LENGTH:tail:SLOT_LENGTH].rstrip(EMPTY)
    key = head[tail + 1:tail + 1 + KEY_DIGITS]
    if (len(head) != QUESTION_LENGTH or head[0] not in (FIRST, SECOND) or head[tail] != TIMES
            or not key.isdigit() or head[-1] != EQUALS or not number.isdigit()
            or len(given) % STEP_LENGTH or (given and given[0] not in KEY_MARKERS)):
        raise ValueError(f"{NAME}: malformed question {question!r}: expected a rule, two key "
                         f"hints, {SLOTS} slots of {SLOT_LENGTH}, '{TIMES}', {KEY_DIGITS} key "
                         f"digits, '{EQUALS}', then whole steps, the key step first")
    pick = 0 if head[0] == FIRST else 1
    steps = [given[i:i + STEP_LENGTH] for i in range(0, len(given), STEP_LENGTH)]
    return [int(ch) for ch in number], int(key[pick]), int(key[2 + pick]), steps


def spell_solution(problem: Problem, notations: Sequence[str]) -> str:
    """The whole solution: the key step, then each carry step in the notation given for it
    (d and c as the problem's metadata has them: a hinted SFT row's key may override u, p)."""
    digits = _parse_question(problem.question)[0]
    d, c = problem.metadata["multiplier"], problem.metadata["carry_in"]
    steps = carry_steps(digits, d, c)
    if len(notations) != len(steps):
        raise ValueError(f"{NAME}: {len(steps)} carry steps in {problem.id}, got "
                         f"{len(notations)} notations")
    return f"{problem.steps[0][0]}{d}{c}" + "".join(
        write_step(s, t, n) for (s, t), n in zip(steps, notations))


def sample_solution(problem: Problem, rng: random.Random, tens_first: float = 0.5) -> str:
    """A valid solution with each carry step's notation drawn at random."""
    carries = len(problem.steps) - 1
    return spell_solution(problem, [TENS_FIRST if rng.random() < tens_first else SUM_FIRST
                                    for _ in range(carries)])


def hinted(problem: Problem, steps: int) -> Problem:
    """The problem with its first `steps` oracle steps given in the prompt: step 0 (the key)
    in the key slot's hints k j, step i >= 1 in digit slot i - 1. The policy still writes the
    whole solution; `verify` reads nothing from the hints."""
    if steps == 0:
        return problem
    carry.check_hint_steps(NAME, problem, steps)
    text = list(problem.question)
    for i, step in enumerate(problem.steps[:steps]):  # '*dc' and '+sc' both: the two digits
        text[SLOT_LENGTH * i + 1:SLOT_LENGTH * i + 3] = step[1:]
    return dataclasses.replace(
        problem, id=f"{problem.id}/hint{steps}", question="".join(text),
        metadata={**problem.metadata, "hint_steps": steps, "base_id": problem.id})


def hinted_solution(problem: Problem, rng: random.Random, tens_first: float = 0.5) -> str:
    """SFT target: the hinted carry steps copied as given ('+'), the rest in random notation."""
    given = max(0, problem.metadata.get("hint_steps", 0) - 1)
    carries = len(problem.steps) - 1
    return spell_solution(problem, [SUM_FIRST] * given + [
        TENS_FIRST if rng.random() < tens_first else SUM_FIRST for _ in range(carries - given)])


def guided(problem: Problem, prefix_steps: int) -> Problem:
    """The problem with its first `prefix_steps` oracle steps forced as the answer's start."""
    if prefix_steps == 0:
        return problem
    if not 0 < prefix_steps <= len(problem.steps):
        raise ValueError(f"{NAME}: prefix_steps must be in 0..{len(problem.steps)} for "
                         f"{problem.id}, got {prefix_steps}")
    return dataclasses.replace(
        problem, id=f"{problem.id}/prefix{prefix_steps}",
        question=problem.question + "".join(problem.steps[:prefix_steps]),
        solution="".join(problem.steps[prefix_steps:]), steps=problem.steps[prefix_steps:],
        metadata={**problem.metadata, "prefix_steps": prefix_steps, "base_id": problem.id})


def restating_prefix(problem: Problem) -> str:
    """The restating hint's text: the oracle solution's prefix up to and including the name of
    the rule its key step reads by (one token, '>' on a hard problem); '' for a problem whose
    key step names no rule (data.key_names_rule off: the value hint is the only one)."""
    if problem.metadata.get("prefix_steps") or problem.metadata.get("restated"):
        raise ValueError(f"{NAME}: {problem.id} is already guided; a restating hint is for the "
                         f"unguided problem")
    return problem.steps[0][:1] if problem.metadata.get("key_names_rule") else ""


def restated(problem: Problem) -> Problem:
    """The problem guided by `restating_prefix`: the name forced as the answer's start, the
    policy writing d and c (the rule read) and every carry step. `verify(continuation,
    restated(problem))` is `verify(name + continuation, problem)`."""
    name = restating_prefix(problem)
    if not name:
        raise ValueError(f"{NAME}: {problem.id} has no rule name to restate (expected a problem "
                         f"made with data.key_names_rule=True)")
    return dataclasses.replace(
        problem, id=f"{problem.id}/restate", question=problem.question + name,
        solution=problem.solution[len(name):],
        steps=(problem.steps[0][len(name):],) + tuple(problem.steps[1:]),
        metadata={**problem.metadata, "restated": name, "base_id": problem.id})


def sft_batch(data, seed: int) -> list[tuple[Problem, str]]:
    """(problem, target) rows of one SFT batch (configs/sft.py `data`).

    Every row is a correct problem, and none shows what rule '>' means: a
    data.second_rule_fraction of rows are '>' problems with equal key digits (u = v, p = q),
    the rest '<' problems. So in all the base reads, d is u and c is p, and it learns to read
    them whatever the rule. A data.hinted_fraction of rows give their first steps (the key step
    first) as a hint, copied by the target; in a data.key_override_fraction of the hinted '<'
    rows the key digits u and p are redrawn, so the hinted d and c, not u and p, are the key: the carry
    steps learn to use the key step as written. Half the batch is full length
    (data.full_length_fraction), as in carry_multiplication.

    The overlap knob (issue 28): a data.second_rule_taught fraction of the '>' rows (default 0)
    have unequal key digits and the true target (d = v, c = q), so the base does see what '>'
    means, that often: it sets eps, the base's unguided P(right key step) on hard problems. At
    0 no draw is made for it, so the batches are exactly those of a config without the field.

    With data.key_names_rule (the restating route) every target's key step names the rule it
    reads by (`key_name`): '<' on every row but the taught ones, so the base never writes '>'
    as a name unless the overlap knob shows it. No draw depends on it: the rows are the same
    problems, the key step's first token aside.

    The continuation knob (issue 43, restating notation only): a data.restated_taught fraction
    of the other '>' rows (default 0: no draw) are `restated`: unequal key digits, the name '>'
    given at the answer's start with no loss on it, the target reading d = v, c = q and carrying.
    The base learns to go on from the name without learning to write it, so eps (which needs the
    name written) stays at the overlap knob's level while a restating hint can be followed.

    Tool episodes (issue 31): a data.tool_fraction of the unhinted rows (default 0: no draw)
    call the key reader first (`tool_episode_target`) and copy its answer into the key step;
    hinted rows never call. Half of them are '>' problems with unequal key digits, where the
    reader's answer is not what the base reads out of habit (u, p): without them the answer
    always equals that read, and the base learns to ignore it (measured: such a base called the
    reader in 250 of 512 episodes on 64 hard problems and solved none). Rows without a call
    still never show what '>' means.
    """
    named = restating_notation(data)
    tools = data.get("tool_fraction", 0.0)
    taught = data.get("second_rule_taught", 0.0)
    restated_taught = data.get("restated_taught", 0.0)
    for field, value in (("second_rule_taught", taught), ("restated_taught", restated_taught)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"config.sft.data.{field}={value!r}: expected a fraction in [0, 1] "
                             f"of the '>' rows")
    if restated_taught and not named:
        raise ValueError(f"config.sft.data.restated_taught={restated_taught!r}: expected 0 "
                         f"without config.sft.data.key_names_rule=True (a row can only be "
                         f"restated by the rule's name)")
    if not 0.0 <= tools <= 1.0:
        raise ValueError(f"config.sft.data.tool_fraction={tools!r}: expected a fraction in "
                         f"[0, 1] of the unhinted rows")
    rng = random.Random(seed)
    rows = []
    for row in range(data.batch_size):
        full = row < round(data.batch_size * data.full_length_fraction)
        number = carry.random_number(rng, (SLOTS, SLOTS) if full else tuple(data.digits))
        d, c = rng.randint(*data.multipliers), rng.randrange(10)
        if rng.random() < data.second_rule_fraction:
            if taught and rng.random() < taught:  # '>' read by its rule: u != v, p != q
                others = _other_digits(rng, d, c)
                problem = make_problem(number, d, c, SECOND, others, names_rule=named)
            elif restated_taught and rng.random() < restated_taught:  # the name given
                others = _other_digits(rng, d, c)
                problem = make_problem(number, d, c, SECOND, others, names_rule=named)
                solution = hinted_solution(problem, rng, data.tens_first)
                rows.append((restated(problem), solution[len(restating_prefix(problem)):]))
                continue
            else:  # '>' whose rule cannot matter
                problem = make_problem(number, d, c, SECOND, (d, c), names_rule=named)
        else:
            problem = make_problem(number, d, c, FIRST, (rng.randrange(10), rng.randrange(10)),
                                   names_rule=named)
        if rng.random() < data.hinted_fraction:
            problem = hinted(problem, rng.randint(1, len(problem.steps) - 1))
            if problem.metadata["rule"] == FIRST and rng.random() < data.key_override_fraction:
                key = problem.question.index(TIMES) + 1
                text = list(problem.question)
                other_d, other_c = _other_digits(rng, d, c)
                text[key], text[key + 2] = str(other_d), str(other_c)
                problem = dataclasses.replace(problem, question="".join(text))
            rows.append((problem, hinted_solution(problem, rng, data.tens_first)))
        elif tools and rng.random() < tools:
            if rng.random() < 0.5:  # the reader's answer is not the habit's read: '>', u != v
                others = _other_digits(rng, d, c)
                problem = make_problem(number, d, c, SECOND, others, names_rule=named)
            rows.append((problem, tool_episode_target(
                problem, hinted_solution(problem, rng, data.tens_first))))
        else:
            rows.append((problem, hinted_solution(problem, rng, data.tens_first)))
    return rows


def read_key_blind(arguments: dict) -> str:
    """The tool study's uninformative reader: the same call and answer format as `read_key`,
    but 'dc' read by rule '<' (u, p) whatever rule is asked: on a hard problem ('>', u != v,
    p != q) never what the answer needs."""
    return read_key({**arguments, "rule": FIRST} if arguments.get("rule") in (FIRST, SECOND)
                    else arguments)


def read_key(arguments: dict) -> str:
    """The key reader (the tool of the task's tool episodes): 'dc' of the key 'uvpq' read by
    the rule, '<' (u, p) or '>' (v, q). Anything else raises ValueError (a failed call)."""
    rule, key = arguments.get("rule"), arguments.get("key")
    if rule not in (FIRST, SECOND) or not (isinstance(key, str) and len(key) == KEY_DIGITS
                                           and key.isdigit()):
        raise ValueError(f"expected a rule {FIRST!r} or {SECOND!r} and {KEY_DIGITS} key digits, "
                         f"got {rule!r} and {key!r}")
    pick = 0 if rule == FIRST else 1
    return key[pick] + key[2 + pick]


def call_arguments(turn: str) -> dict | None:
    """The key reader's arguments of a turn's text that calls it (starts with CALL), None for a
    turn that does not call (an answer); a call that is not CALL, a rule and KEY_DIGITS digits
    gives arguments read_key refuses."""
    text = turn.split(EOS, 1)[0].replace(PAD, "")
    if not text.startswith(CALL):
        return None
    return {"rule": text[1:2], "key": text[2:]}


def call_text(problem: Problem) -> str:
    """The call turn's text (its <eos> aside): CALL, the rule, the key, from the question."""
    tail = SLOT_LENGTH * (1 + SLOTS)
    return CALL + problem.question[0] + problem.question[tail + 1:tail + 1 + KEY_DIGITS]


def observation_text(answer: str | None) -> str:
    """What is appended after a call turn: the reader's 'dc' (None: the call failed), then '='."""
    return (answer if answer is not None else FAILED) + EQUALS


def tool_episode_target(problem: Problem, solution: str) -> str:
    """An SFT row's target written as a tool episode: the call, its observation, the solution.
    `training_ids` masks the observation (appended by the rollout, never sampled)."""
    answer = read_key(call_arguments(call_text(problem)))
    return f"{call_text(problem)}{EOS}{observation_text(answer)}{solution}"


def sequence_length(data) -> int:
    """The longest row of the SFT data `data` (the base's context): a tool episode's with
    data.tool_fraction > 0."""
    return EPISODE_LENGTH if data.get("tool_fraction", 0.0) else SEQUENCE_LENGTH


def key_markers(problem: Problem) -> tuple[str, ...]:
    """The first tokens `verify` accepts for the key step: '*', or (data.key_names_rule) either
    rule's name (a value-hinted policy may name '<' and copy the right digits)."""
    return (FIRST, SECOND) if problem.metadata.get("key_names_rule") else (KEY,)


def answer_digit_spans(problem: Problem) -> list[tuple[int, int]]:
    """Token spans [start, end) of each step's two digits in question + oracle solution (the
    key's d c, then each carry step's): what teacher-forced step accuracy checks."""
    return [(QUESTION_LENGTH + STEP_LENGTH * i + 1, QUESTION_LENGTH + STEP_LENGTH * i + 3)
            for i in range(len(problem.steps))]


def training_ids(problem: Problem, solution: str, tokenizer=None) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of question + solution + <eos>; the mask is 1 on the solution,
    but 0 on the observation of a tool episode's target (`tool_episode_target`)."""
    ids, mask = carry.training_ids(problem, solution, tokenizer or default_tokenizer())
    if solution.startswith(CALL):
        start = QUESTION_LENGTH + CALL_LENGTH
        mask[start:start + OBSERVATION_LENGTH] = [0] * OBSERVATION_LENGTH
    return ids, mask


@functools.cache
def default_tokenizer():
    return tokenizer()


def verify(completion_text: str, problem: Problem) -> float:
    """1.0 if question + completion is the key step with the key's d and c, then every carry
    step right in either notation, then nothing; else 0.0. The key step starts with '*', or
    (data.key_names_rule) with a rule's name: either name, the digits judged as the answer is
    (a value-hinted policy may name '<' and copy the right digits; the name is its working)."""
    text = completion_text.split(EOS, 1)[0] if EOS in completion_text else completion_text
    text = text.replace(PAD, "").strip()
    try:
        digits, d, c, given = _parse_question(problem.question + text)
    except ValueError:
        return 0.0
    if not given or given[0][0] not in key_markers(problem) or given[0][1:] != f"{d}{c}":
        return 0.0
    return carry.score_steps(given[1:], carry_steps(digits, d, c), problem.answer)
