"""A method is added in one file: registered here, it trains through the rl job on the smoke config.

`twice`: GRPO that asks each problem twice a step, as two plain contexts (a method that builds
its contexts differently and reads a field of its own, train.problems_per_step aside). Nothing
outside this file knows its name: preflight checks it, the rl job builds it from the registry,
and the loop samples what it lays out.
"""
import dataclasses
import os

import numpy as np
import pytest

from jaxprefix.errors import ConfigError
from jaxprefix.methods.grpo import GrpoMethod, GrpoSettings
from jaxprefix.methods.registry import METHODS, MethodSpec, method_spec, register_method
from jaxprefix.run_config import from_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TwiceMethod(GrpoMethod):
    """Each problem of a step as two plain contexts; records every step's reward shape."""

    name = "twice"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reward_shapes = []

    def _contexts(self, batch, step):
        contexts, problems, guided, prefixes = super()._contexts(batch, step)
        return contexts * 2, problems * 2, guided * 2, prefixes * 2

    def observe(self, request, rewards):
        self.reward_shapes.append(np.shape(rewards))


BUILT = []


def _build(settings, inputs):
    BUILT.append(TwiceMethod(inputs.prompts, inputs.sets.train, **inputs.common))
    return BUILT[-1]


@pytest.fixture
def twice():
    spec = register_method(MethodSpec(
        name="twice", settings=GrpoSettings.from_config, build=_build,
        contexts_per_problem=lambda settings: 2, needs=lambda settings: ()))
    yield spec
    del METHODS[spec.name]


def smoke_config(method: str):
    config = from_file(os.path.join(ROOT, "configs", "grpo.py"), "smoke")
    config.method = method
    config.mining.train_on = "all"  # no hard set to mine: the method asks for none
    config.sft.max_steps = 2        # an untrained base is enough: nothing is expected to learn
    config.eval.every = 0           # no evaluation, one checkpoint: the steps are the test
    config.checkpoint.every = config.train.total_steps
    return config


def test_unknown_method_is_refused_in_one_line_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"config.method='twice': expected one of \("):
        method_spec("twice")


@pytest.mark.slow  # ~1 min on 2 shared cores: the SFT base, the sampler's and learner's compiles
def test_a_method_registered_in_a_test_file_trains_through_the_rl_job(twice, tmp_path):
    from jaxprefix.jobs.rl import run_rl
    from jaxprefix.run_setup import preflight

    config = smoke_config("twice")
    workdir = str(tmp_path / "run")
    settings = preflight.check(config, workdir)
    assert settings.method.spec is twice
    # Two contexts a problem: the step's contexts and the loop's batch follow from the method.
    assert settings.method.contexts_per_step == 2 * config.train.problems_per_step
    result = run_rl(config, workdir, settings=settings)
    assert result["step"] == config.train.total_steps
    method = BUILT[-1]
    assert method.reward_shapes == [(2 * config.train.problems_per_step, config.rollout.n)] * (
        config.train.total_steps)


def test_a_method_block_field_on_a_method_that_reads_none_is_refused(twice, tmp_path):
    from jaxprefix.run_setup import preflight

    config = smoke_config("twice")
    config.pope.unguided_copies = 3
    with pytest.raises(ConfigError, match=r"config.pope.unguided_copies"):
        preflight.check(config, str(tmp_path / "run"))


def test_the_built_in_methods_are_registered_with_their_blocks():
    assert {name: method_spec(name).blocks for name in ("grpo", "pope", "prefixrl")} == {
        "grpo": (), "pope": ("pope", "schedule"), "prefixrl": ("prefixrl", "schedule")}
    assert dataclasses.is_dataclass(method_spec("pope").settings(smoke_config("pope")))
