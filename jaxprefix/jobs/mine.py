"""The mine job: what POPE and PrefixRL compute once with the base policy, before RL.

- the hard set: training problems the base policy solves 0 of k times;
- POPE: the shortest oracle prefix with which each hard problem is solved at least once;
- PrefixRL: a pool of successful traces by rejection sampling.

Each result is written under the mining directory (`config.mining.dir`, default
<workdir>/mining) and read back on the next run instead of sampled again, so a resumed or repeated
run sees exactly the same hard set, prefixes and pool. The sampling compute of each artifact is
recorded apart in mining/ledger.json, and each run is charged for the artifacts its method uses
(GRPO does not pay for POPE's prefix search, nor POPE for PrefixRL's pool).

    python -m jaxprefix.main --config=configs/pope.py --config.job=mine --workdir=/tmp/pope
"""
from __future__ import annotations

from absl import logging

from jaxprefix import storage
from jaxprefix.methods import pope, prefixrl
from jaxprefix.methods.isocompute import ComputeLedger
from jaxprefix.methods.probing import Prober, SamplingSpec

HARD_SET, PREFIXES, LEDGER = "hard_set.json", "prefixes.json", "ledger.json"
TRACE_POOL, TRACE_POOL_STATS = "trace_pool.jsonl", "trace_pool_stats.json"
ARTIFACTS = ("hard_set", "prefixes", "trace_pool")  # the keys of ledger.json


def mining_dir(config, workdir: str) -> str:
    return config.mining.get("dir") or storage.join(workdir, "mining")


def make_prober(config, policy, ledger: ComputeLedger, verifier: str) -> Prober:
    rollout = config.rollout
    spec = SamplingSpec(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                        top_p=rollout.top_p, top_k=rollout.top_k, stop_ids=policy.stop_ids)
    return Prober(policy.model, policy.tokenizer, spec, verifier=verifier, ledger=ledger,
                  rows_per_call=config.mining.rows_per_call,
                  verifier_timeout_s=config.rewards.timeout_s)


class Mining:
    """Cached mining results of one directory, computed on first request."""

    def __init__(self, config, policy, sets, directory: str):
        self.config, self.policy, self.sets, self.dir = config, policy, sets, directory
        self.costs = self._load_costs()
        self.prober = make_prober(config, policy, self._new_ledger(), sets.verifier)

    def _path(self, name: str) -> str:
        return storage.join(self.dir, name)

    def _new_ledger(self) -> ComputeLedger:
        return ComputeLedger(self.policy.model.config.num_params())

    def _load_costs(self) -> dict[str, ComputeLedger]:
        if not storage.exists(self._path(LEDGER)):
            return {}
        record = storage.read_json(self._path(LEDGER))
        if set(record) - set(ARTIFACTS):
            raise ValueError(f"{self._path(LEDGER)}: expected a ledger per artifact among "
                             f"{ARTIFACTS}, got keys {sorted(record)} (a mining directory of an "
                             f"older jaxprefix, which kept one total); remove {self.dir} to mine "
                             f"again")
        return {name: ComputeLedger.from_dict(d) for name, d in record.items()}

    def _booking(self, artifact: str) -> None:
        """Books the prober's next samples to `artifact`."""
        self.prober.ledger = self.costs[artifact] = self._new_ledger()

    def _save(self, name: str, record) -> None:
        # The artifact first, then its cost: a run killed between the two mines it again.
        storage.write_json(self._path(name), record)
        storage.write_json(self._path(LEDGER), {k: v.to_dict() for k, v in self.costs.items()})

    def cost(self, artifacts) -> ComputeLedger:
        """What mining the named artifacts spent (those not mined yet cost nothing)."""
        total = self._new_ledger()
        for name in artifacts:
            if name not in ARTIFACTS:
                raise ValueError(f"mining artifact {name!r}: expected one of {ARTIFACTS}")
            if name in self.costs:
                total.extra_rollouts += self.costs[name].extra_rollouts
                total.extra_flops += self.costs[name].extra_flops
        return total

    def hard_set(self) -> pope.HardSet:
        by_id = {p.id: p for p in self.sets.train}
        if storage.exists(self._path(HARD_SET)):
            record = storage.read_json(self._path(HARD_SET))
            return pope.HardSet([by_id[i] for i in record["hard_ids"]], record["k"],
                                record["solve_counts"])
        k = self.config.mining.k
        self._booking("hard_set")
        hard = pope.mine_hard_set(self.prober, self.policy.prompts, self.sets.train, k=k,
                                  seed=self.config.seed)
        logging.info("hard set: %d of %d problems solved 0 of %d times", len(hard.problems),
                     len(self.sets.train), k)
        self._save(HARD_SET, hard.to_json())
        return hard

    def prefixes(self, hard: pope.HardSet) -> dict:
        if storage.exists(self._path(PREFIXES)):
            return storage.read_json(self._path(PREFIXES))["shortest_units"]
        m = self.config.mining
        self._booking("prefixes")
        found = pope.shortest_solvable_prefixes(
            self.prober, self.policy.prompts, hard.problems, m=m.prefix_samples,
            max_units=m.max_prefix_units, guidance=self.config.pope.guidance,
            template=pope.TEMPLATES[self.config.pope.template], seed=self.config.seed + 1)
        solved = sum(v is not None for v in found.values())
        logging.info("shortest solvable prefix found for %d of %d hard problems", solved, len(found))
        self._save(PREFIXES, {"samples": m.prefix_samples, "max_units": m.max_prefix_units,
                              "shortest_units": found})
        return found

    def trace_pool(self, problems) -> prefixrl.TracePool:
        path = self._path(TRACE_POOL)
        pool_file = self.config.prefixrl.get("pool_path")
        if pool_file:  # traces from elsewhere (another model): their sampling is not ours to count
            return prefixrl.TracePool.load_jsonl(pool_file, self.policy.prompts)
        if self.config.prefixrl.oracle_traces:
            return prefixrl.oracle_trace_pool(self.policy.prompts, problems)
        if storage.exists(path):
            pool = prefixrl.TracePool.load_jsonl(path, self.policy.prompts)
            if storage.exists(self._path(TRACE_POOL_STATS)):  # the samples of the misses too
                stats = storage.read_json(self._path(TRACE_POOL_STATS))
                pool.samples_per_problem = stats["samples_per_problem"]
            return pool
        p = self.config.prefixrl
        self._booking("trace_pool")
        pool = prefixrl.build_trace_pool(self.prober, self.policy.prompts, problems,
                                         samples_per_round=p.samples_per_round,
                                         max_samples=p.max_samples, seed=self.config.seed + 2)
        logging.info("trace pool: %d of %d problems, %d samples", len(pool.traces), len(problems),
                     sum(pool.samples_per_problem.values()))
        pool.save_jsonl(path, self.policy.tokenizer)
        self._save(TRACE_POOL_STATS, {"samples_per_problem": pool.samples_per_problem})
        return pool


def run_mine(config, workdir: str) -> dict:
    """Computes (or reads) everything the configured method needs; returns a summary."""
    from jaxprefix.jobs.policy import load_policy
    from jaxprefix.jobs.problem_sets import load_problem_sets

    from jaxprefix.jobs.rl import check_method_settings

    check_method_settings(config)
    policy = load_policy(config, workdir)
    mining = Mining(config, policy, load_problem_sets(config.data), mining_dir(config, workdir))
    hard = mining.hard_set()
    summary = {"hard": len(hard.problems), "candidates": len(mining.sets.train)}
    if config.method == "pope":
        found = mining.prefixes(hard)
        summary["prefix_found"] = sum(v is not None for v in found.values())
    if config.method == "prefixrl":
        summary["pool"] = len(mining.trace_pool(hard.problems).traces)
    summary["ledger"] = {name: ledger.to_dict() for name, ledger in mining.costs.items()}
    return summary
