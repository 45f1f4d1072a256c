"""What the configured method asks of a run: its blocks checked once, into a typed object.

`MethodSettings.from_config(config)` looks config.method up in the registry (methods/registry.py)
and checks what that method reads (its blocks, naming the field) before any model is loaded or
problem mined; the jobs then take the object (preflight makes it; run_settings.resolve makes it
for each training run) and check nothing again. `contexts_per_problem` counts what a method
samples of a problem, for the jobs that plan runs (allocation, studies, the results job).
"""
from __future__ import annotations

import dataclasses

from jaxprefix.methods.registry import MethodInputs, MethodSpec, method_spec


@dataclasses.dataclass(frozen=True)
class MethodSettings:
    spec: MethodSpec           # the registered method
    options: object            # its own settings (spec.settings: PopeSettings, ...)
    contexts_per_step: int     # the contexts one step samples, n times each

    @classmethod
    def from_config(cls, config) -> MethodSettings:
        spec = method_spec(config.method)
        options = spec.settings(config)  # raises naming the method's field
        contexts = (config.train.problems_per_step * spec.contexts_per_problem(options)
                    + spec.extra_contexts_per_step(options))
        return cls(spec, options, contexts)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def needs(self) -> tuple[str, ...]:
        """The mining artifacts the method trains on (run_setup/mining.ARTIFACTS): its bill."""
        return self.spec.needs(self.options)

    def build(self, prompts, sets, mining, **common):
        """The method over its training problems (mining first where it needs to)."""
        return self.spec.build(self.options, MethodInputs(prompts, sets, mining, common))


def contexts_per_problem(config, method: str) -> int:
    """How many contexts `method` asks of each training problem (POPE's guided and plain copies,
    PrefixRL's prefixed and plain ones, GRPO's one)."""
    spec = method_spec(method)
    return spec.contexts_per_problem(spec.settings(config))
