"""The rl job: a policy, a problem set, a method, and the RL loop to `train.total_steps`.

    python -m jaxprefix.main --config=configs/pope.py:rl --workdir=/tmp/pope

POPE and PrefixRL first mine what they need with the base policy (run_setup/mining.py, cached
in the mining directory); that sampling compute starts the run's ledger, so every FLOPs figure
the run reports includes it. Running the command again resumes from the last checkpoint.
"""
from __future__ import annotations

from absl import logging

from jaxprefix import distributed, models, run_identity, storage
from jaxprefix import key_step_probe as probing
from jaxprefix.data import tasks
from jaxprefix.errors import ConfigError
from jaxprefix.rl import compute_ledger, loop
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.scoring import episode_source
from jaxprefix.run_setup.mining import set_up
from jaxprefix.run_setup.run_settings import RunSettings, resolve
from jaxprefix.storage import workdir_lock

def build_method(settings: RunSettings, policy, sets, mining):
    """The configured method over its training problems, mining first where it needs to."""
    config, evals = settings.config, settings.loop.eval
    # Every host builds the same global request (problem lists are small): the sampler and the
    # learner then place their rows over the global mesh, and all hosts agree on every batch.
    common = dict(problems_per_step=config.train.problems_per_step, n=settings.loop.n,
                  seed=settings.loop.seed, eval_problems=sets.eval, eval_n=evals.n)
    if evals.hard_set:
        common["hard_eval_problems"] = mining.hard_set().problems
    return settings.method.build(policy.prompts, sets, mining, **common)


def key_step_probe(source: str, policy, sets):
    """The teacher-forced key-step figures of the eval set of built-in task `source`
    (jaxprefix/key_step_probe.py) as a function of the model: the loop logs them as probe/* at
    each evaluation under eval.key_step_probe."""
    task, problems, tokenizer = tasks.get(source), list(sets.eval), policy.tokenizer
    return lambda model: probing.probe(model, problems, tokenizer, task).metrics()


def training_cost(config, contexts_per_step: int, num_params: int) -> str:
    """The line logged before the RL loop samples: steps x contexts x samples x new tokens, and
    the FLOPs bound of sampling them (2 N D) and training on them (6 N D), D the generated tokens
    at their cap (contexts add their own length, which varies by problem)."""
    steps, n = config.train.total_steps, config.rollout.n
    new = config.rollout.max_new_tokens * config.rollout.get("max_turns", 1)  # every turn's
    rollouts = steps * contexts_per_step * n
    tokens = rollouts * new
    budget = float(config.train.get("flops_budget", 0.0))
    # Under a FLOPs budget total_steps is only a cap: the ledger ends the run before it.
    until = f", or fewer: the run stops at its FLOPs budget {budget:.3g}" if budget else ""
    return (f"{config.method}: will train {steps} step{'s' * (steps != 1)} x {contexts_per_step} "
            f"contexts x {n} samples x up to {new} new tokens ({rollouts} rollouts): <= "
            f"{compute_ledger.sampling_flops(num_params, tokens):.3g} FLOPs to sample and <= "
            f"{compute_ledger.update_flops(num_params, tokens):.3g} to train on them (2 N D and "
            f"6 N D, N = {num_params:.3g} parameters; contexts add their length){until}")


@workdir_lock.holds_workdir
def run_rl(config, workdir: str, settings: RunSettings | None = None) -> dict:
    """Mines (if needed) and trains; returns the loop's result plus the policy and the ledger.

    settings: the config resolved (preflight's, which main hands over); a run started otherwise
    (the demo's and results' arms, the sweep's points, tests) resolves its config here, once."""
    settings = settings or resolve(config)  # isocompute.budget > 0: n, B, M from the rule
    config, contexts = settings.config, settings.method.contexts_per_step
    run_identity.claim(config, workdir)  # a resume under another config stops here, unmined
    # Before any work: a mesh or device split these devices cannot hold is one line.
    try:
        mesh, sampler_mesh = models.split_meshes(settings.rollout.devices, **settings.mesh)
    except ValueError as e:
        raise ConfigError(f"config.{e}" if str(e).startswith("rollout.") else str(e)) from None
    policy, sets, mining = set_up(config, workdir)
    models.shard_model(policy.model, mesh)  # in place: the prober samples the sharded model
    method = build_method(settings, policy, sets, mining)
    mined = mining.cost(settings.method.needs)
    ledger = ComputeLedger(policy.model.config.num_params())
    logging.info("%s: mining spent %.3g FLOPs", config.method, mined.extra_flops)
    logging.info(training_cost(config, contexts, ledger.n_params))
    result = loop.train(settings.loop, workdir, method=method, model=policy.model,
                        tokenizer=policy.tokenizer, learner_config=settings.train,
                        rollout=settings.rollout, contexts_per_step=contexts,
                        stop_ids=policy.stop_ids, mesh=mesh, sampler_mesh=sampler_mesh,
                        ledger=ledger,
                        probe=(key_step_probe(config.data.source, policy, sets)
                               if settings.loop.eval.key_step_probe else None),
                        episodes=episode_source(settings.tools, settings.environment,
                                                policy.tokenizer,
                                                policy.model.config.max_position_embeddings))
    # Mining is charged from the mining directory's ledger, the truth for a resumed run too.
    ledger.extra_rollouts, ledger.extra_flops = mined.extra_rollouts, mined.extra_flops
    if result["preempted"]:
        raise loop.Preempted(f"{workdir}: stopped by SIGTERM at step {result['step']}, "
                             f"checkpoint saved; rerun the same command to resume")
    if distributed.is_primary():
        storage.write_json(storage.join(workdir, "compute.json"), ledger.to_dict())
    # The trained weights, for callers (the demo) that evaluate them next.
    policy.model = result["learner"].model(result["state"])
    return result | {"policy": policy, "ledger": ledger, "sets": sets, "mining": mining}
