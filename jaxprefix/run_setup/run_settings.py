"""A training run's settings, resolved once before any work into typed, frozen objects.

    settings = resolve(config)   # settings.config, .method, .rollout, .train

applies the allocation rule first (isocompute.budget: the run's n, B, M and learning rate), then
checks and types each block the run reads: the method's (MethodSettings), the rollout's
(RolloutSpec), the learner's (TrainConfig) and the loop's (LoopSettings, both from
run_setup/learner_settings), the tools'
(ToolSettings: read where rollout.max_turns > 1, refused on a one-turn run) and the external
environment's (EnvironmentSettings: config.environment; a source needs method grpo and one
turn of the run's own, the environment taking its turns itself). Each error is
one line naming the field. Preflight resolves the rl job's config and main hands the result to
the job; a run started otherwise (the demo's and the results job's arms, the sweep's points, a
test) is resolved once where it starts (jobs/rl.run_rl). Nothing downstream checks these blocks
again: the loop, the method and the sampler take the objects.
"""
from __future__ import annotations

import dataclasses

from jaxprefix.rl.loop_settings import LoopSettings
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.run_setup import learner_settings
from jaxprefix.run_setup.allocation import allocated
from jaxprefix.run_setup.method_settings import MethodSettings
from jaxprefix.sampling import RolloutSpec
from jaxprefix.serving.env_settings import EnvironmentSettings
from jaxprefix.tools.settings import ToolSettings


@dataclasses.dataclass(frozen=True)
class RunSettings:
    config: object           # the ConfigDict the run reads: the given one, allocation applied
    method: MethodSettings
    rollout: RolloutSpec
    train: TrainConfig
    loop: LoopSettings
    tools: ToolSettings
    environment: EnvironmentSettings
    mesh: dict               # config.mesh: the learner's axes (data, fsdp, tensor)


def resolve(config) -> RunSettings:
    """The settings of the training run `config` describes (see the module's docstring)."""
    config = allocated(config)
    method = MethodSettings.from_config(config)
    rollout = RolloutSpec.from_config(config.rollout, training=True)
    train = learner_settings.validate(config, contexts_per_step=method.contexts_per_step)
    tools = ToolSettings.from_config(config)
    environment = EnvironmentSettings.from_config(config)
    if environment.active:
        # The environment builds its own prompts from the problem: a method that puts guidance
        # or a prefix into the context (POPE, PrefixRL) would not reach it.
        if not method.spec.plain_contexts:
            raise ValueError(f"config.environment.source={environment.source!r} is set with "
                             f"method {method.name}: the environment writes its own prompts, "
                             f"so only a method of plain problems reaches it; expected "
                             f"method=grpo")
        if rollout.partial_tokens:
            raise ValueError(f"config.rollout.partial_tokens={rollout.partial_tokens} is set "
                             f"with config.environment.source={environment.source!r}: the "
                             f"environment samples its episodes whole; expected 0")
        if tools.episodes:
            raise ValueError(f"config.rollout.max_turns={tools.max_turns} is set with "
                             f"config.environment.source={environment.source!r}: the "
                             f"environment takes its own turns; expected rollout.max_turns=1")
    return RunSettings(config, method, rollout, train, learner_settings.loop_settings(config),
                       tools, environment, dict(config.mesh))
