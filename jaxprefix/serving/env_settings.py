"""EnvironmentSettings: the config's `environment` block (an external environment the RL loop's
rollouts run in, docs/TOOLS.md) parsed and checked once.

`source` '' (the default) leaves the run's own sampler and verifier; 'FILE.py:NAME' names a
function NAME(tokenizer) in that file that returns the environment (external.ExternalEnvironment;
the policy's tokenizer, for an environment that writes token-id prompts). With
one set, every round of the loop serves the current policy on 127.0.0.1 (live.py), runs n
episodes of each of the method's problems against it (external.rollout), and trains on their
turns' tokens and the environment's rewards.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

from jaxprefix.errors import need
from jaxprefix.rewards import from_file
from jaxprefix.serving.external import rollout

FIELD = "config.environment.source"


@dataclasses.dataclass(frozen=True)
class EnvironmentSettings:
    source: str = ""
    max_concurrent: int = 0
    max_batch_rows: int = 64
    timeout_s: float = 600.0
    episode_timeout_s: float = 3600.0

    def __post_init__(self):
        def check(ok, field, expected):
            need(ok, f"config.environment.{field}", getattr(self, field), expected)
        check(self.max_concurrent >= 0, "max_concurrent", ">= 0 (0: every episode of a round)")
        check(self.max_batch_rows >= 1, "max_batch_rows", ">= 1")
        check(self.timeout_s > 0, "timeout_s", "> 0 seconds")
        check(self.episode_timeout_s > 0, "episode_timeout_s", "> 0 seconds")
        if self.source:
            from_file.load(self.source, FIELD)  # a missing file or function: one line

    @property
    def active(self) -> bool:
        return bool(self.source)

    @classmethod
    def from_config(cls, config) -> EnvironmentSettings:
        e = config.environment
        return cls(e.source, e.max_concurrent, e.max_batch_rows, e.timeout_s,
                   float(e.get("episode_timeout_s", 3600.0)))

    def environment(self, tokenizer):
        """The environment `source` names (NAME(tokenizer) of FILE.py), checked to have an
        async run_episode."""
        made = from_file.load(self.source, FIELD).fn(tokenizer)
        if not inspect.iscoroutinefunction(getattr(made, "run_episode", None)):
            raise ValueError(f"{FIELD}={self.source!r}: returned {type(made).__name__}, expected "
                             f"an object with `async def run_episode(client, model, problem, "
                             f"sampling_args)` (jaxprefix.serving.external)")
        return made

    def episode_source(self, tokenizer, context_length: int):
        """`fn(model, problems, n=, stop_ids=, seed=, **sampler keywords) -> (Episodes, rewards
        [len(problems), n])`: the round's episodes against `model` served live."""
        import jax

        if jax.process_count() > 1:  # each host's server would batch its own requests apart
            raise ValueError(f"{FIELD}={self.source!r}: an external environment runs on one "
                             f"host; this run has {jax.process_count()} processes")
        return functools.partial(rollout, self.environment(tokenizer), tokenizer=tokenizer,
                                 context_length=context_length,
                                 max_concurrent=self.max_concurrent,
                                 max_batch_rows=self.max_batch_rows, timeout_s=self.timeout_s,
                                 episode_timeout_s=self.episode_timeout_s)

