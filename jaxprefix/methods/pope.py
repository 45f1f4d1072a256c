"""POPE: privileged on-policy exploration (arXiv 2601.18779).

On a hard problem the base policy samples no correct rollout, so GRPO's advantages are all zero.
POPE asks each hard problem twice: once plainly, once guided by a prefix of its oracle solution,
so that guided rollouts earn reward; what RL learns on the guided continuation transfers back to
the unguided problem.

Pipeline:
1. `mine_hard_set`: k samples per problem with the base policy; keep those solved 0 of k.
2. `shortest_solvable_prefixes`: per hard problem, oracle prefixes of growing length (in steps),
   m samples each, up to `prefix_limit` (a cap in steps and as a fraction of the solution, never
   the whole solution); keep the shortest with at least one success. Computed once, before RL.
3. `PopeMethod`: each step, B hard problems, each as `guided_copies` guided and `unguided_copies`
   unguided contexts (1:1 by default), optionally with easy problems mixed in. A problem with no
   solvable prefix within the cap is dropped (and counted), guided by the longest prefix tried,
   or kept with all its copies unguided ('unguided': every hard problem stays in training).

Guidance comes in two forms. 'instruction' (the paper): the prefix goes into the prompt, on an
instruction-tuned LLM in the user turn with an instruction to continue it, on the demo task in the
question's hint slots (`prompts.hinted_question`); the prompt gets no loss and the answer, the
policy's own, is scored alone. 'solution_prefix' (PrefixRL's mechanism, kept as an ablation): the
prefix is forced as the start of the answer, and the verifier judges prefix + continuation.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxprefix.data.loader import ProblemLoader
from jaxprefix.errors import NothingToTrain, need
from jaxprefix.data.problem import Problem
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prefix_schedules import make_prefix_schedule, schedule_settings
from jaxprefix.methods.probing import Prober
from jaxprefix.methods.method_spec import MethodSpec, register_method
from jaxprefix.methods.prompting import oracle_prefix_text, oracle_units, with_response_prefix

# The instruction seen in the authors' data (unconfirmed as the paper's exact text). It lets the
# model revisit the partial response: the paper found that forbidding that hurts transfer.
GUIDED_TEMPLATE = (
    "You are given a problem and a partial solution. Study the partial response carefully, then "
    "complete the solution from where it left off. Put your final answer within \\boxed{{}}.\n\n"
    "Problem: {question}\n\nPartial Response: {partial_response}\n\n"
    "Continue solving the problem, starting from where the partial response ends.")
# The ablation: better guided accuracy, worse transfer to unguided problems.
NO_RESTATE_TEMPLATE = GUIDED_TEMPLATE + (
    " Do not restate, repeat or summarise any part of the partial response.")
TEMPLATES = {"default": GUIDED_TEMPLATE, "no_restate": NO_RESTATE_TEMPLATE}
GUIDANCE_MODES = ("instruction", "solution_prefix")
# A problem with no solvable prefix within the cap: dropped, guided by the longest prefix
# tried, or kept with every copy unguided (its unguided copies stay in training).
UNSOLVED_MODES = ("drop", "longest", "unguided")


@dataclasses.dataclass(frozen=True)
class PopeSettings:
    """How POPE mixes and guides its contexts: the config's `pope` block (and the prefix cap in
    steps, mining.max_prefix_units, and the prefix-length schedule), checked where it is made:
    the registry's settings (`from_config`) make one before any work, and PopeMethod takes it
    and checks nothing again."""
    guidance: str = "instruction"  # GUIDANCE_MODES
    template: str = "default"      # a TEMPLATES name: the instruction around a guided prompt
    guided_copies: int = 1
    unguided_copies: int = 1
    easy_per_step: int = 0
    unsolved: str = "drop"         # UNSOLVED_MODES
    max_units: int = 0             # the cap in steps (0: none beyond the fraction)
    max_fraction: float = 1.0      # the cap as a share of the solution (never all of it)
    schedule: tuple = (("kind", "fixed"),)  # prefix_schedules.schedule_settings

    def __post_init__(self):
        need(self.guidance in GUIDANCE_MODES, "config.pope.guidance", self.guidance,
             f"one of {GUIDANCE_MODES}")
        need(self.template in TEMPLATES, "config.pope.template", self.template,
             f"one of {tuple(TEMPLATES)}")
        need(min(self.guided_copies, self.unguided_copies) >= 0
             and self.guided_copies + self.unguided_copies > 0,
             "config.pope.guided_copies/unguided_copies",
             (self.guided_copies, self.unguided_copies), ">= 0 each, not both 0")
        need(self.easy_per_step >= 0, "config.pope.easy_per_step", self.easy_per_step, ">= 0")
        need(self.unsolved in UNSOLVED_MODES, "config.pope.unsolved", self.unsolved,
             f"one of {UNSOLVED_MODES}")
        need(self.max_units >= 0, "config.mining.max_prefix_units", self.max_units, ">= 0")
        need(0.0 < self.max_fraction <= 1.0, "config.pope.max_prefix_fraction",
             self.max_fraction, "in (0, 1]")

    @classmethod
    def from_config(cls, config) -> PopeSettings:
        p = config.pope
        return cls(guidance=p.guidance, template=p.template, guided_copies=p.guided_copies,
                   unguided_copies=p.unguided_copies, easy_per_step=p.easy_per_step,
                   unsolved=p.unsolved, max_units=config.mining.max_prefix_units,
                   max_fraction=p.max_prefix_fraction, schedule=schedule_settings(config))

    @property
    def template_text(self) -> str:
        return TEMPLATES[self.template]

    @property
    def search_name(self) -> str:
        """The mining artifact of this prefix search: its guidance, template and cap."""
        return f"prefixes_{self.guidance}_{self.template}_f{self.max_fraction:g}"


def prefix_limit(problem: Problem, *, max_units: int, max_fraction: float = 1.0) -> int:
    """The longest prefix searched for `problem`: at most `max_units` steps and `max_fraction` of
    its oracle solution, and never the whole solution (that would hand over the answer)."""
    units = oracle_units(problem)
    return max(0, min(int(max_units), math.floor(max_fraction * units + 1e-9), units - 1))


def guided_context(prompts, problem: Problem, units: int, *, guidance: str,
                   template: str = GUIDED_TEMPLATE):
    """(context, response prefix text) of `problem` guided by its first `units` oracle steps.

    With guidance in the prompt, a built-in task whose notation names the key step's rule
    (keyed_multiplication, data.key_names_rule) is guided by its restating hint unless the
    template forbids restating: the oracle's prefix up to that name, forced as the answer's
    start, whatever `units` (the policy reads the key itself: docs/DEMO_TASK.md). Under
    'no_restate' it gets the value hint, as every task without such a notation does."""
    if guidance == "instruction":
        restating = prompts.restating_prefix(problem) if template != NO_RESTATE_TEMPLATE else ""
        if restating:
            return (with_response_prefix(prompts, problem, prompts.response(restating)),
                    restating)
        return prompts.hinted_question(problem, units, template), ""
    if guidance == "solution_prefix":
        partial = oracle_prefix_text(problem, units)
        return with_response_prefix(prompts, problem, prompts.response(partial)), partial
    raise ValueError(f"pope.guidance must be one of {GUIDANCE_MODES}, got {guidance!r}")


@dataclasses.dataclass(frozen=True)
class HardSet:
    """The problems the base policy solved 0 of k times, with what mining measured."""

    problems: list
    k: int
    solve_counts: dict  # problem id -> successes in k samples, for every mined problem

    def to_json(self) -> dict:
        return {"k": self.k, "solve_counts": self.solve_counts,
                "hard_ids": [p.id for p in self.problems]}


def mine_hard_set(prober: Prober, prompts, problems: Sequence[Problem], *, k: int,
                  seed: int) -> HardSet:
    """k unguided samples per problem; the hard set is every problem with 0 successes."""
    contexts = [prompts.question(p) for p in problems]
    result = prober.probe(contexts, problems, k, seed=seed, description=f"mining pass@{k}")
    counts = {p.id: int(c) for p, c in zip(problems, result.num_correct)}
    hard = [p for p in problems if counts[p.id] == 0]
    return HardSet(hard, k, counts)


@dataclasses.dataclass(frozen=True)
class PrefixSearch:
    """What the shortest-prefix search found, per hard problem id."""

    shortest: dict  # the fewest oracle steps with a success in m samples (None: none within cap)
    answers: dict   # the first correct guided answer there: its tokens (response prefix included)


def shortest_solvable_prefixes(prober: Prober, prompts, problems: Sequence[Problem], *, m: int,
                               max_units: int, guidance: str, template: str = GUIDED_TEMPLATE,
                               seed: int, max_fraction: float = 1.0) -> PrefixSearch:
    """Per problem, the fewest oracle steps with which m samples hold a success, searched up to
    `prefix_limit`, and the policy's own correct answer found there (what POPE's SFT baseline
    trains on).

    Lengths are tried in increasing order for all still-unsolved problems at once, so each
    sampler call is a full batch.
    """
    found: dict = {p.id: None for p in problems}
    answers: dict = {}
    limits = {p.id: prefix_limit(p, max_units=max_units, max_fraction=max_fraction)
              for p in problems}
    for units in range(1, max(limits.values(), default=0) + 1):
        pending = [p for p in problems if found[p.id] is None and units <= limits[p.id]]
        if not pending:
            break
        pairs = [guided_context(prompts, p, units, guidance=guidance, template=template)
                 for p in pending]
        result = prober.probe([c for c, _ in pairs], pending, m, seed=seed + units,
                              response_prefixes=[r for _, r in pairs], keep_successes=True,
                              description=f"prefix search {units} steps")
        for problem, (_, prefix), success in zip(pending, pairs, result.first_success):
            if success is not None:
                found[problem.id] = units
                # The stop token is added back where it is trained.
                success = success.without_stop(prober.stop_ids)
                answers[problem.id] = list(prompts.response(prefix)) + success.tokens
    return PrefixSearch(found, answers)


def revealed_fractions(problems: Sequence[Problem], shortest: dict) -> list[float]:
    """units / oracle units of each problem's prefix (None: no solvable prefix, left out)."""
    return [shortest[p.id] / oracle_units(p) for p in problems if shortest.get(p.id)]


def guided_units(hard: Sequence[Problem], prefix_units: dict, settings: PopeSettings) -> dict:
    """Per hard problem POPE guides, the prefix it is guided by: its shortest solvable one, or
    with unsolved='longest' the longest the search tried where none solved it."""
    out = {}
    for p in hard:
        units = prefix_units.get(p.id)
        if units is None and settings.unsolved == "longest":
            units = prefix_limit(p, max_units=settings.max_units,
                                 max_fraction=settings.max_fraction) or None
        if units is not None:
            out[p.id] = units
    return out


class PopeMethod(GrpoMethod):
    """Hard problems asked guided and unguided, mixed `guided_copies : unguided_copies`."""

    name = "pope"

    def __init__(self, prompts, hard: Sequence[Problem], prefix_units: dict, *, schedule,
                 settings: PopeSettings = PopeSettings(), easy: Sequence[Problem] = (),
                 seed: int, **kwargs):
        guided_copies, unsolved = settings.guided_copies, settings.unsolved
        max_units, max_fraction = settings.max_units, settings.max_fraction
        self.prefix_units = guided_units(hard, prefix_units, settings)
        # Without guided copies (hard + easy), or with unsolved='unguided', every hard problem
        # is trained on; those without a prefix unguided only.
        kept = [p for p in hard
                if p.id in self.prefix_units or not guided_copies or unsolved == "unguided"]
        self.dropped = [p.id for p in hard if p not in kept]
        if not hard:
            raise NothingToTrain(
                "pope: no hard problem to train on (each training problem was solved at least "
                "once in mining.k samples); expected harder problems (data.path), a larger "
                "mining.k, or plain GRPO on all of them (configs/grpo.py)")
        if not kept and not any(prefix_limit(p, max_units=max_units, max_fraction=max_fraction)
                                for p in hard):
            longest = max(oracle_units(p) for p in hard)
            raise NothingToTrain(
                f"pope: no prefix of the {len(hard)} hard problems' solutions fits the cap: "
                f"they have at most {longest} step(s) (lines), and a prefix is at most "
                f"mining.max_prefix_units={max_units} steps and pope.max_prefix_fraction="
                f"{max_fraction:g} of them, never all; expected solutions of several lines (one "
                f"step a line), a larger cap, or pope.unsolved=unguided to train them unguided")
        if not kept:
            raise NothingToTrain(
                f"pope: none of the {len(hard)} hard problems has a solvable prefix within the "
                f"cap ({max_fraction:g} of the solution, {max_units} steps); expected "
                f"one: raise pope.max_prefix_fraction, mining.max_prefix_units or "
                f"mining.prefix_samples, or train them unguided with pope.unsolved=unguided "
                f"(or guided by the longest prefix tried: pope.unsolved=longest)")
        super().__init__(prompts, kept, seed=seed, **kwargs)
        self.schedule = schedule
        self.guidance, self.template = settings.guidance, settings.template_text
        self.guided_copies, self.unguided_copies = guided_copies, settings.unguided_copies
        self.easy_loader = (ProblemLoader(list(easy), settings.easy_per_step, seed + 1)
                            if easy and settings.easy_per_step else None)

    def _contexts(self, batch: Sequence[Problem], step: int):
        contexts, problems, guided, prefixes = [], [], [], []
        for problem in batch:
            if problem.id not in self.prefix_units:  # no prefix (unsolved='unguided'): plain
                copies = self.guided_copies + self.unguided_copies
                contexts.extend([self.prompts.question(problem)] * copies)
                prefixes.extend([""] * copies)
                problems.extend([problem] * copies)
                guided.extend([False] * copies)
                continue
            for _ in range(self.guided_copies):
                units = self.schedule.length(problem.id, self.prefix_units[problem.id], step)
                context, prefix = guided_context(self.prompts, problem, units,
                                                 guidance=self.guidance, template=self.template)
                contexts.append(context)
                prefixes.append(prefix)
            contexts.extend([self.prompts.question(problem)] * self.unguided_copies)
            prefixes.extend([""] * self.unguided_copies)
            problems.extend([problem] * (self.guided_copies + self.unguided_copies))
            guided.extend([True] * self.guided_copies + [False] * self.unguided_copies)
        if self.easy_loader is not None:
            easy = self.easy_loader.next_batch()
            contexts.extend(self.prompts.question(p) for p in easy)
            problems.extend(easy)
            guided.extend([False] * len(easy))
            prefixes.extend([""] * len(easy))
        return contexts, problems, guided, prefixes

    def observe(self, request, rewards: np.ndarray) -> None:
        rows = np.flatnonzero(request.tags["guided"])
        self.schedule.observe([request.problems[i].id for i in rows], rewards[rows])

    def state(self) -> dict:
        state = super().state() | {"schedule": self.schedule.state()}
        if self.easy_loader is not None:
            state["easy_loader"] = self.easy_loader.state()
        return state

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.schedule.restore(state["schedule"])
        if self.easy_loader is not None:
            self.easy_loader.restore(state["easy_loader"])


def _build(settings: PopeSettings, inputs) -> PopeMethod:
    hard = inputs.mining.hard_set()
    return PopeMethod(inputs.prompts, hard.problems, inputs.mining.prefixes(hard, settings),
                      schedule=make_prefix_schedule(dict(settings.schedule)), settings=settings,
                      easy=inputs.sets.easy, **inputs.common)


def _mined_summary(settings: PopeSettings, mining, hard: HardSet) -> dict:
    found = mining.prefixes(hard, settings)
    return {"prefix_found": sum(v is not None for v in found.values()),
            "revealed_fractions": revealed_fractions(hard.problems, found)}


register_method(MethodSpec(
    name="pope", settings=PopeSettings.from_config, build=_build, blocks=("pope", "schedule"),
    contexts_per_problem=lambda s: s.guided_copies + s.unguided_copies,
    # With no guided copies (hard + easy only) no prefix is used, so none is searched.
    needs=lambda s: ("hard_set",) + ((s.search_name,) if s.guided_copies else ()),
    extra_contexts_per_step=lambda s: s.easy_per_step,
    guides_in_prompt=lambda s: s.guidance == "instruction",
    mined_summary=_mined_summary))
