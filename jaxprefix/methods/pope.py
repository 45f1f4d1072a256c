"""POPE: privileged on-policy exploration (arXiv 2601.18779).

On a hard problem the base policy samples no correct rollout, so GRPO's advantages are all zero.
POPE asks each hard problem twice: once plainly, once guided by a prefix of its oracle solution,
so that guided rollouts earn reward; what RL learns on the guided continuation transfers back to
the unguided problem.

Pipeline:
1. `mine_hard_set`: k samples per problem with the base policy; keep those solved 0 of k.
2. `shortest_solvable_prefixes`: per hard problem, oracle prefixes of growing length (in steps),
   m samples each; keep the shortest with at least one success. Computed once, before RL.
3. `PopeMethod`: each step, B hard problems, each as `guided_copies` guided and `unguided_copies`
   unguided contexts (1:1 by default), optionally with easy problems mixed in.

Guidance comes in two forms. 'instruction' (the paper, instruction-tuned LLMs): the prefix goes
into the user turn with an instruction to continue it; the prompt gets no loss. 'solution_prefix'
(policies that follow no instruction, like the demo's tiny model): the prefix is forced as the
start of the answer, and the verifier judges prefix + continuation.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxprefix.data.loader import ProblemLoader
from jaxprefix.data.problem import Problem
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.probing import Prober
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


def guided_context(prompts, problem: Problem, units: int, *, guidance: str,
                   template: str = GUIDED_TEMPLATE):
    """(context, response prefix text) of `problem` guided by its first `units` oracle steps."""
    partial = oracle_prefix_text(problem, units)
    if guidance == "instruction":
        text = template.format(question=problem.question, partial_response=partial)
        return prompts.user_turn(text), ""
    if guidance == "solution_prefix":
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


def shortest_solvable_prefixes(prober: Prober, prompts, problems: Sequence[Problem], *, m: int,
                               max_units: int, guidance: str, template: str = GUIDED_TEMPLATE,
                               seed: int) -> dict:
    """Per problem id, the fewest oracle steps with which m samples hold a success (None: none).

    Lengths are tried in increasing order for all still-unsolved problems at once, so each
    sampler call is a full batch.
    """
    found: dict = {p.id: None for p in problems}
    for units in range(1, max_units + 1):
        pending = [p for p in problems if found[p.id] is None and units <= oracle_units(p)]
        if not pending:
            break
        pairs = [guided_context(prompts, p, units, guidance=guidance, template=template)
                 for p in pending]
        result = prober.probe([c for c, _ in pairs], pending, m, seed=seed + units,
                              response_prefixes=[r for _, r in pairs],
                              description=f"prefix search {units} steps")
        for problem, solved in zip(pending, result.num_correct):
            if solved:
                found[problem.id] = units
    return found


class PopeMethod(GrpoMethod):
    """Hard problems asked guided and unguided, mixed `guided_copies : unguided_copies`."""

    name = "pope"

    def __init__(self, prompts, hard: Sequence[Problem], prefix_units: dict, *, schedule,
                 guidance: str = "instruction", template: str = GUIDED_TEMPLATE,
                 guided_copies: int = 1, unguided_copies: int = 1,
                 easy: Sequence[Problem] = (), easy_per_step: int = 0, seed: int, **kwargs):
        super().__init__(prompts, hard, seed=seed, **kwargs)
        if guidance not in GUIDANCE_MODES:
            raise ValueError(f"pope.guidance must be one of {GUIDANCE_MODES}, got {guidance!r}")
        if guided_copies < 0 or unguided_copies < 0 or guided_copies + unguided_copies == 0:
            raise ValueError("pope: guided_copies and unguided_copies must be >= 0, not both 0")
        # A problem with no solvable prefix within the searched range gets the longest tried.
        self.prefix_units = {p.id: prefix_units.get(p.id) or oracle_units(p) for p in hard}
        self.schedule = schedule
        self.guidance, self.template = guidance, template
        self.guided_copies, self.unguided_copies = guided_copies, unguided_copies
        self.easy_loader = (ProblemLoader(list(easy), easy_per_step, seed + 1)
                            if easy and easy_per_step else None)

    def _contexts(self, batch: Sequence[Problem], step: int):
        contexts, problems, guided, prefixes = [], [], [], []
        for problem in batch:
            units = self.schedule.length(problem.id, self.prefix_units[problem.id], step)
            for _ in range(self.guided_copies):
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
