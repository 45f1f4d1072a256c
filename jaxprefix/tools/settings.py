"""ToolSettings: the config's `tools` block (and rollout.max_turns) parsed and checked once.

The RL loop, the tool study and preflight take a ToolSettings rather than reading the config.
`episodes` is whether the run samples multi-turn episodes at all: rollout.max_turns > 1. A
`tools` field set on a run of one turn is refused (it would change nothing), and so are turns
with no tool to call.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jaxprefix.errors import need
from jaxprefix.tools import registry
from jaxprefix.tools.api import DEFAULT_MAX_CHARS
from jaxprefix.tools.environments import Environment, environment
from jaxprefix.tools.episodes import rollout_episodes
from jaxprefix.tools.python_tool import PythonLimits

# Episode rollouts by name (tools.rollout): each takes rollout_episodes' arguments and returns
# its Episodes, the same ones. 'reference' re-prefills the conversation every turn; 'kv_kept'
# keeps every turn's KV in the continuous decode (sampling.sample_turns), its tools running
# while the device decodes the other rows.
ROLLOUTS: dict[str, Callable] = {"reference": rollout_episodes,
                                 "kv_kept": functools.partial(rollout_episodes, kv_kept=True)}


@dataclasses.dataclass(frozen=True)
class ToolSettings:
    max_turns: int = 1
    names: tuple[str, ...] = ()
    environment: str = "chat"
    format: str = ""
    episode_token_budget: int = 0       # 0: the model's context
    max_observation_chars: int = DEFAULT_MAX_CHARS
    workers: int = 1
    rollout: str = "kv_kept"
    python: PythonLimits | None = None  # None: the python tool is off

    def __post_init__(self):
        def check(ok, field, expected):
            need(ok, f"config.tools.{field}", getattr(self, field), expected)
        need(self.max_turns >= 1, "config.rollout.max_turns", self.max_turns, ">= 1")
        check(self.episode_token_budget >= 0, "episode_token_budget", ">= 0 (0: the model's "
              "context)")
        check(self.max_observation_chars >= 1, "max_observation_chars", ">= 1")
        check(self.workers >= 1, "workers", ">= 1")
        check(self.rollout in ROLLOUTS, "rollout", f"one of {sorted(ROLLOUTS)}")
        if self.episodes:
            need(bool(self.names), "config.tools.names", self.names,
                 f"the tools of rollout.max_turns={self.max_turns} episodes (built-in names "
                 f"or FILE.py:FUNCTION)")
        registry(self.names, self.python)  # unknown names, missing files: one line

    @property
    def episodes(self) -> bool:
        return self.max_turns > 1

    @classmethod
    def from_config(cls, config) -> ToolSettings:
        """The settings of `config.tools` and `config.rollout.max_turns`; a tools field set on
        a run of one turn is refused, naming it."""
        t, default = config.get("tools"), cls()
        max_turns = int(config.rollout.get("max_turns", 1))
        if not t:
            return cls(max_turns=max_turns)
        p, limits = t.python, PythonLimits()
        fields = [f.name for f in dataclasses.fields(PythonLimits)]
        python = PythonLimits(*(p[field] for field in fields)) if p.enabled else None
        for field in fields:
            need(p.enabled or p[field] == getattr(limits, field), f"config.tools.python.{field}",
                 p[field], "left at its default: tools.python.enabled=False (the python tool "
                 "is off)")
        settings = cls(max_turns, tuple(t.names), t.environment, t.format,
                       t.episode_token_budget, t.max_observation_chars, t.workers, t.rollout,
                       python)
        if not settings.episodes:
            for field in ("names", "environment", "format", "episode_token_budget",
                          "max_observation_chars", "workers", "rollout", "python"):
                need(getattr(settings, field) == getattr(default, field),
                     f"config.tools.{field}", t.get(field), "left at its default: "
                     "rollout.max_turns=1 runs no tool (a tool's observation needs a next turn)")
        return settings

    def prompt_tools(self) -> tuple[dict, ...]:
        """The tools' schemas for a chat prompt to list (the chat template's own tool section,
        as TRL and verl pass `tools` to it): the `chat` environment's, whose calls are the
        template's own; none for a run of one turn or an environment of its own format."""
        if not self.episodes or self.environment != "chat":
            return ()
        return tuple(registry(self.names, self.python).schemas())

    def environment_for(self, tokenizer) -> Environment:
        """The run's environment over its tools (one-line errors naming the field)."""
        return environment(self.environment, tokenizer, registry(self.names, self.python),
                           format=self.format)

    def episode_budget(self, context_length: int) -> int:
        """The tokens an episode may hold in all, its context included."""
        return self.episode_token_budget or context_length

    def episode_rollout(self, tokenizer, context_length: int) -> Callable:
        """The episode rollout (tools.rollout) bound to the run's environment, turns and
        budget: `fn(model, contexts, n=, seed=, stop_ids=, **sampler keywords) -> Episodes`."""
        return functools.partial(
            ROLLOUTS[self.rollout], tokenizer=tokenizer, max_turns=self.max_turns,
            episode_token_budget=self.episode_budget(context_length),
            max_observation_chars=self.max_observation_chars, tool_workers=self.workers,
            **self.environment_for(tokenizer).rollout_keywords())
