"""Plain on-policy GRPO batches, and the batch-building skeleton POPE and PrefixRL extend.

A method decides, each step, which contexts the policy continues: here, B problems from the
loader, each asked unguided. POPE and PrefixRL override `_contexts` to add guided or prefixed
copies of the same problems; everything else (data order, evaluation, checkpointed state) is
shared.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from jaxprefix.data.loader import ProblemLoader
from jaxprefix.data.problem import Problem
from jaxprefix.errors import need
from jaxprefix.methods.method_spec import MethodSpec, register_method
from jaxprefix.rl.scoring import RolloutRequest


class GrpoMethod:
    """Each step: `problems_per_step` problems, unguided, `n` samples each."""

    name = "grpo"

    def __init__(self, prompts, problems: Sequence[Problem], *, problems_per_step: int, n: int,
                 seed: int, eval_problems: Sequence[Problem] = (), eval_n: int = 8,
                 hard_eval_problems: Sequence[Problem] = (), shard_index: int = 0,
                 shard_count: int = 1):
        if not problems:
            raise ValueError(f"{self.name}: no training problems")
        self.prompts = prompts
        self.n = n
        self.loader = ProblemLoader(list(problems), problems_per_step, seed,
                                    shard_index=shard_index, shard_count=shard_count)
        self.eval_problems = list(eval_problems)
        # The training hard set, asked unguided: the training reward PrefixRL's paper plots.
        self.hard_eval_problems = list(hard_eval_problems)
        self.eval_n = eval_n

    def next_request(self, step: int) -> RolloutRequest:
        batch = self.loader.next_batch()
        contexts, problems, guided, prefixes = self._contexts(batch, step)
        return RolloutRequest(contexts=contexts, problems=problems,
                              tags={"guided": np.asarray(guided, bool)}, n=self.n,
                              response_prefixes=prefixes)

    def _contexts(self, batch: Sequence[Problem], step: int):
        """(contexts, problems, guided flags, response prefixes) for one batch of problems."""
        contexts = [self.prompts.question(p) for p in batch]
        return contexts, list(batch), [False] * len(batch), [""] * len(batch)

    def observe(self, request: RolloutRequest, rewards: np.ndarray) -> None:
        """Per-step feedback ([C, n] rewards); plain GRPO keeps no state from it."""

    def eval_requests(self) -> dict[str, RolloutRequest]:
        """Held-out problems, unguided: the number every method is judged by (and the training
        hard set, unguided, when asked)."""
        requests = {}
        for name, problems in (("eval", self.eval_problems), ("hard_set", self.hard_eval_problems)):
            if problems:
                contexts = [self.prompts.question(p) for p in problems]
                requests[name] = RolloutRequest(
                    contexts=contexts, problems=list(problems),
                    tags={"guided": np.zeros(len(contexts), bool)}, n=self.eval_n,
                    response_prefixes=[""] * len(contexts))
        return requests

    def state(self) -> dict:
        return {"loader": self.loader.state()}

    def restore(self, state: dict) -> None:
        self.loader.restore(state["loader"])


@dataclasses.dataclass(frozen=True)
class GrpoSettings:
    train_on: str = "all"  # 'all' training problems, or the mined 'hard' set

    @classmethod
    def from_config(cls, config) -> GrpoSettings:
        train_on = config.mining.train_on
        need(train_on in ("all", "hard"), "config.mining.train_on", train_on, "'all' or 'hard'")
        return cls(train_on)


def _build(settings: GrpoSettings, inputs) -> GrpoMethod:
    hard = settings.train_on == "hard"
    problems = inputs.mining.hard_set().problems if hard else inputs.sets.train
    return GrpoMethod(inputs.prompts, problems, **inputs.common)


register_method(MethodSpec(
    name="grpo", settings=GrpoSettings.from_config, build=_build,
    contexts_per_problem=lambda settings: 1, plain_contexts=True,
    needs=lambda settings: ("hard_set",) if settings.train_on == "hard" else ()))
