"""What POPE and PrefixRL compute once with the base policy, before RL, cached on disk.

- the hard set: training problems the base policy solves 0 of k times;
- POPE: the shortest oracle prefix with which each hard problem is solved at least once, within
  a cap (`pope.max_prefix_fraction` of the solution, `mining.max_prefix_units` steps); one search
  per (guidance, template, cap), each its own artifact;
- PrefixRL: a pool of successful traces by rejection sampling.

A run of tool episodes (rollout.max_turns > 1) mines with them: every sample is an episode as
its RL samples it, its final answer scored, so the hard set holds what the policy fails with its
tools, and a trace keeps its tools' observations (masked apart: prefixrl.Trace).

Each result is written under the mining directory (`config.mining.dir`, default
<workdir>/mining) and read back on the next run instead of sampled again, so a resumed or repeated
run sees exactly the same hard set, prefixes and pool. The sampling compute of each artifact is
recorded apart in mining/ledger.json, and each run is charged for the artifacts its method uses
(`mined_artifacts`: GRPO does not pay for POPE's prefix search, nor POPE for PrefixRL's pool).
`set_up` is the one sequence every job that samples the policy starts with.
"""
from __future__ import annotations

import dataclasses

from absl import logging
import jax

from jaxprefix import storage
from jaxprefix.errors import ConfigError
from jaxprefix.sampling import RolloutSpec, token_ids
from jaxprefix.tpu import costing, topology
from jaxprefix.methods import pope, prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.scoring import EpisodeSource
from jaxprefix.methods.probing import Prober
from jaxprefix.run_setup.method_settings import MethodSettings
from jaxprefix.tools.settings import ToolSettings

HARD_SET, LEDGER = "hard_set.json", "ledger.json"
TRACE_POOL, TRACE_POOL_STATS = "trace_pool.jsonl", "trace_pool_stats.json"
IMPORTED_POOL = "imported_pool.json"
# The keys of ledger.json: prefixes_<search>, and imported_pool (its declared generation cost).
ARTIFACTS = ("hard_set", "prefixes", "trace_pool", "imported_pool")


def prefix_search(config) -> str:
    """The artifact name of the configured prefix search: its guidance, template and cap."""
    return pope.PopeSettings.from_config(config).search_name


def _artifact_kind(name: str) -> str:
    return "prefixes" if name.startswith("prefixes_") else name


def mined_artifacts(config) -> tuple[str, ...]:
    """The mining artifacts (ARTIFACTS) the configured method trains on: its bill."""
    return MethodSettings.from_config(config).needs


def mining_dir(config, workdir: str) -> str:
    return config.mining.get("dir") or storage.join(workdir, "mining")


def sampling_cost(what: str, context_lengths, samples: int, max_new_tokens: int,
                  num_params: int, *, rows_per_call: int = 0, devices=(),
                  episodes: tuple[int, int, tuple[str, ...]] | None = None) -> str:
    """The line logged before a mining stage samples: contexts x samples x tokens (at most
    max_new_tokens sampled after each context) and its FLOPs bound, 2 N D (D: every sample's
    context plus the most it may generate, the ledger's accounting). `episodes`: (max turns,
    token budget, tool names) where each sample is a tool episode of up to max_new_tokens a
    turn, its context, turns and observations within the budget. On TPU `devices`, also the
    roofline floor of that work (tpu/costing.sampling_floor_seconds, bf16 weights)."""
    contexts = len(context_lengths)
    if episodes is None:
        tokens = samples * (sum(context_lengths) + contexts * max_new_tokens)
        sample = f"up to {max_new_tokens} new tokens"
        decode_steps = max_new_tokens
    else:
        turns, budget, names = episodes
        tokens = samples * contexts * budget
        sample = (f"an episode of up to {turns} turns with {', '.join(names)} (up to "
                  f"{max_new_tokens} new tokens a turn, {budget} in all)")
        decode_steps = turns * max_new_tokens
    flops = 2 * num_params * tokens
    line = (f"{what}: will sample {contexts} contexts x {samples} samples x {sample} "
            f"(D <= {tokens:.3g} tokens, contexts included), "
            f"<= {flops:.3g} FLOPs (2 N D, N = {num_params:.3g} parameters)")
    chip = topology.chip_of(devices[0].device_kind) if devices else None
    if chip is None:
        return line
    rows = contexts * samples
    calls = -(-rows // rows_per_call) if rows_per_call else 1
    floor = costing.sampling_floor_seconds(flops=flops, calls=calls, decode_steps=decode_steps,
                                           weight_bytes=2 * num_params, chips=len(devices),
                                           chip=chip)
    return (f"{line}; on {len(devices)} x {chip.generation} at least {floor:.3g} s (the roofline:"
            f" FLOPs at peak, or the weights read at every decode step of {calls} calls)")


def _length(context) -> int:
    return len(token_ids(context))


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """How a policy is sampled to be measured (mining, the studies' evaluations): the sampler's
    spec, rows a call (mining.rows_per_call), the verifier's limits (rewards.*) and the run's
    tools (a run of tool episodes is measured on its episodes)."""
    rollout: RolloutSpec
    rows_per_call: int
    verifier_timeout_s: float
    verifier_max_chars: int
    tools: ToolSettings = ToolSettings()

    @classmethod
    def from_config(cls, config) -> ProbeSettings:
        return cls(RolloutSpec.from_config(config.rollout), config.mining.rows_per_call,
                   config.rewards.timeout_s, config.rewards.max_chars,
                   ToolSettings.from_config(config))

    def prober(self, policy, ledger: ComputeLedger, verifier: str) -> Prober:
        episodes = None
        if self.tools.episodes:
            episodes = EpisodeSource(self.tools.episode_rollout(policy.tokenizer,
                                                                policy.context_length))
        return Prober(policy.model, policy.tokenizer, self.rollout, stop_ids=policy.stop_ids,
                      verifier=verifier, ledger=ledger, rows_per_call=self.rows_per_call,
                      verifier_timeout_s=self.verifier_timeout_s,
                      verifier_max_chars=self.verifier_max_chars, episodes=episodes)


@dataclasses.dataclass(frozen=True)
class MiningSettings:
    """config.mining and the seed, read once: the hard set's k, the samples each prefix length
    gets, and how the base is sampled. What a prefix search or a trace pool is searched with is
    its method's settings (PopeSettings, PrefixRLSettings), handed to the call."""
    k: int
    prefix_samples: int
    seed: int
    probe: ProbeSettings

    @classmethod
    def from_config(cls, config) -> MiningSettings:
        return cls(config.mining.k, config.mining.prefix_samples, config.seed,
                   ProbeSettings.from_config(config))


class Mining:
    """Cached mining results of one directory, computed on first request."""

    def __init__(self, settings: MiningSettings, policy, sets, directory: str):
        self.settings, self.policy, self.sets, self.dir = settings, policy, sets, directory
        self.costs = self._load_costs()
        self.prober = settings.probe.prober(policy, self._new_ledger(), sets.verifier)

    def _path(self, name: str) -> str:
        return storage.join(self.dir, name)

    def _new_ledger(self) -> ComputeLedger:
        return ComputeLedger(self.policy.model.config.num_params())

    def _load_costs(self) -> dict[str, ComputeLedger]:
        if not storage.exists(self._path(LEDGER)):
            return {}
        record = storage.read_json(self._path(LEDGER))
        if {_artifact_kind(k) for k in record} - set(ARTIFACTS):
            raise ConfigError(f"{self._path(LEDGER)}: expected a ledger per artifact among "
                              f"{ARTIFACTS}, got keys {sorted(record)} (a mining directory of an "
                              f"older jaxprefix, which kept one total); remove {self.dir} to mine "
                              f"again")
        return {name: ComputeLedger.from_dict(d) for name, d in record.items()}

    def _log_cost(self, what: str, items, samples: int, contexts: bool = False) -> None:
        """Logs sampling_cost of `samples` samples of each problem's question (or of each given
        context)."""
        lengths = [_length(c) if contexts else len(self.policy.prompts.question(c))
                   for c in items]
        probe = self.settings.probe
        episodes = None
        if probe.tools.episodes:
            episodes = (probe.tools.max_turns,
                        probe.tools.episode_budget(self.policy.context_length),
                        probe.tools.names)
        logging.info("%s", sampling_cost(what, lengths, samples, probe.rollout.max_new_tokens,
                                         self.policy.model.config.num_params(),
                                         rows_per_call=probe.rows_per_call,
                                         devices=jax.devices(), episodes=episodes))

    def _sampled_as(self) -> dict:
        """How this mining samples, as its records keep it: nothing for one turn a sample; the
        turns and tools of a run of episodes."""
        tools = self.settings.probe.tools
        return {"max_turns": tools.max_turns, "tools": list(tools.names)} if tools.episodes else {}

    def _check_sampled_as(self, path: str, record: dict) -> None:
        """A record mined another way (with or without tools) is refused, not reused."""
        mined = {k: record[k] for k in ("max_turns", "tools") if k in record}
        if mined != self._sampled_as():
            raise ConfigError(f"{path}: mined with {mined or 'one turn a sample'}, the config "
                              f"samples {self._sampled_as() or 'one turn a sample'} "
                              f"(rollout.max_turns, tools.names); use another mining.dir")

    def _booking(self, artifact: str) -> None:
        """Books the prober's next samples to `artifact`."""
        self.prober.ledger = self.costs[artifact] = self._new_ledger()

    def _save(self, name: str, record) -> None:
        # The artifact first, then its cost: a run killed between the two mines it again.
        storage.write_json(self._path(name), record)
        # Merged with what is on disk: another Mining of this directory (a run with another
        # prefix cap) may have booked an artifact since this one was read.
        self.costs = self._load_costs() | self.costs
        storage.write_json(self._path(LEDGER), {k: v.to_dict() for k, v in self.costs.items()})

    def cost(self, artifacts) -> ComputeLedger:
        """What mining the named artifacts spent (those not mined yet cost nothing)."""
        total = self._new_ledger()
        for name in artifacts:
            if _artifact_kind(name) not in ARTIFACTS:
                raise ValueError(f"mining artifact {name!r}: expected one of {ARTIFACTS}")
            if name in self.costs:
                total.extra_rollouts += self.costs[name].extra_rollouts
                total.extra_flops += self.costs[name].extra_flops
        return total

    def hard_set(self) -> pope.HardSet:
        by_id = {p.id: p for p in self.sets.train}
        if storage.exists(self._path(HARD_SET)):
            record = storage.read_json(self._path(HARD_SET))
            self._check_sampled_as(self._path(HARD_SET), record)
            return pope.HardSet([by_id[i] for i in record["hard_ids"]], record["k"],
                                record["solve_counts"])
        k = self.settings.k
        self._log_cost("mining the hard set", self.sets.train, k)
        self._booking("hard_set")
        hard = pope.mine_hard_set(self.prober, self.policy.prompts, self.sets.train, k=k,
                                  seed=self.settings.seed)
        logging.info("hard set: %d of %d problems solved 0 of %d times", len(hard.problems),
                     len(self.sets.train), k)
        self._save(HARD_SET, hard.to_json() | self._sampled_as())
        return hard

    def prefixes(self, hard: pope.HardSet, search: pope.PopeSettings) -> dict:
        """Per hard problem id, its shortest solvable prefix within the cap (None: none)."""
        return self.prefix_search(hard, search)["shortest_units"]

    def prefix_search(self, hard: pope.HardSet, search: pope.PopeSettings) -> dict:
        """The record of the search `search` describes (its guidance, template and cap):
        shortest_units, answers (the policy's own correct guided answers, token ids) and the
        settings it ran with."""
        name, samples = search.search_name, self.settings.prefix_samples
        settings = {"samples": samples, "max_units": search.max_units,
                    "max_fraction": search.max_fraction}
        path = self._path(f"{name}.json")
        if storage.exists(path):
            record = storage.read_json(path)
            self._check_sampled_as(path, record)
            if {k: record[k] for k in settings} != settings:
                raise ConfigError(f"{path}: searched with {({k: record[k] for k in settings})}, "
                                  f"the config asks {settings} (mining.prefix_samples, "
                                  f"mining.max_prefix_units); use another mining.dir")
            return record
        # Every prefix length the cap allows each problem, m samples each (a problem stops at
        # its first solved length): the guided contexts the search may sample.
        guide = dict(guidance=search.guidance, template=search.template_text)
        cap = dict(max_units=search.max_units, max_fraction=search.max_fraction)
        guided = [pope.guided_context(self.policy.prompts, problem, units, **guide)[0]
                  for problem in hard.problems
                  for units in range(1, pope.prefix_limit(problem, **cap) + 1)]
        self._log_cost(f"{name} (every length the cap allows)", guided, samples, contexts=True)
        self._booking(name)
        found = pope.shortest_solvable_prefixes(
            self.prober, self.policy.prompts, hard.problems, m=samples, **guide, **cap,
            seed=self.settings.seed + 1)
        solved = sum(v is not None for v in found.shortest.values())
        logging.info("%s: a solvable prefix for %d of %d hard problems", name, solved,
                     len(found.shortest))
        record = settings | self._sampled_as() | {
            "shortest_units": found.shortest, "answers": found.answers,
            "revealed_fractions": pope.revealed_fractions(hard.problems, found.shortest)}
        self._save(f"{name}.json", record)
        return record

    def restricted(self, ids, directory: str) -> "Mining":
        """This directory's hard set cut down to `ids`, in `directory`, with every prefix search
        and ledger entry mined here: runs pointed there train on those problems alone and are
        charged what the whole mining spent (the cut chose its problems from all of it)."""
        keep = set(ids)
        hard = self.hard_set()
        # What is on disk: another Mining of this directory (another arm's search) may have
        # booked an artifact since this one was read.
        self.costs = self._load_costs() | self.costs
        cut = pope.HardSet([p for p in hard.problems if p.id in keep], hard.k, hard.solve_counts)
        storage.write_json(storage.join(directory, HARD_SET), cut.to_json() | self._sampled_as())
        for name in self.costs:
            if name.startswith("prefixes_"):
                record = storage.read_json(self._path(f"{name}.json"))
                record |= {key: {i: v for i, v in record[key].items() if i in keep}
                           for key in ("shortest_units", "answers")}
                record["revealed_fractions"] = pope.revealed_fractions(
                    cut.problems, record["shortest_units"])
                storage.write_json(storage.join(directory, f"{name}.json"), record)
        storage.write_json(storage.join(directory, LEDGER),
                           {k: v.to_dict() for k, v in self.costs.items()})
        return Mining(self.settings, self.policy, self.sets, directory)

    def _imported_pool(self, p: prefixrl.PrefixRLSettings, problems) -> prefixrl.TracePool:
        """An imported pool, each trace verified against its problem (failures dropped and
        counted in imported_pool.json); its declared generation cost (prefixrl.pool_flops) is
        booked as the 'imported_pool' artifact."""
        pool, stats = prefixrl.verified_pool(
            prefixrl.TracePool.load_jsonl(p.pool_path, self.policy.prompts), problems,
            verifier=self.sets.verifier, decode=self.policy.tokenizer.decode,
            timeout_s=self.settings.probe.verifier_timeout_s)
        logging.info("imported trace pool %s: %s", p.pool_path, stats)
        if not pool.traces:
            raise ConfigError(f"config.prefixrl.pool_path={p.pool_path!r}: no trace solves its "
                              f"training problem ({stats})")
        self.costs["imported_pool"] = ComputeLedger(self.policy.model.config.num_params(),
                                                    extra_flops=p.pool_flops)
        self._save(IMPORTED_POOL, {"path": p.pool_path, "declared_flops": p.pool_flops, **stats})
        return pool

    def trace_pool(self, problems, p: prefixrl.PrefixRLSettings) -> prefixrl.TracePool:
        """The pool `p` describes (its source and rejection-sampling budget) of `problems`."""
        path = self._path(TRACE_POOL)
        if p.pool == "imported_pool":  # traces from elsewhere (another model), verified first
            return self._imported_pool(p, problems)
        if p.pool == "oracle":
            return prefixrl.oracle_trace_pool(self.policy.prompts, problems)
        if storage.exists(path):
            pool = prefixrl.TracePool.load_jsonl(path, self.policy.prompts)
            if storage.exists(self._path(TRACE_POOL_STATS)):  # the samples of the misses too
                stats = storage.read_json(self._path(TRACE_POOL_STATS))
                self._check_sampled_as(self._path(TRACE_POOL_STATS), stats)
                pool.samples_per_problem = stats["samples_per_problem"]
            return pool
        self._log_cost("the trace pool (rejection sampling, stops at a success)", problems,
                       p.max_samples)
        self._booking("trace_pool")
        pool = prefixrl.build_trace_pool(self.prober, self.policy.prompts, problems,
                                         samples_per_round=p.samples_per_round,
                                         max_samples=p.max_samples, seed=self.settings.seed + 2)
        logging.info("trace pool: %d of %d problems, %d samples", len(pool.traces), len(problems),
                     sum(pool.samples_per_problem.values()))
        pool.save_jsonl(path, self.policy.tokenizer)
        self._save(TRACE_POOL_STATS,
                   {"samples_per_problem": pool.samples_per_problem} | self._sampled_as())
        return pool


def set_up(config, workdir: str) -> tuple:
    """What every job that samples the configured policy starts from: (policy, problem sets,
    mining), its settings checked before (preflight, run_settings.resolve). The base policy is
    trained first if the config names an SFT'd one that is absent."""
    from jaxprefix.run_setup.policy import load_policy
    from jaxprefix.run_setup.problem_sets import load_problem_sets, prompt_limit

    policy = load_policy(config, workdir)
    sets = load_problem_sets(config.data,
                             prompt_limit(config, policy.prompts, policy.context_length),
                             rewards_path=config.rewards.path)
    return policy, sets, Mining(MiningSettings.from_config(config), policy, sets,
                                mining_dir(config, workdir))
