"""The results job: the papers' claims tested side by side on the demo task, as docs/RESULTS.md.

    python -m jaxprefix.main --config=configs/results.py --workdir=runs/results

Runs (each in its own workdir under --workdir, so an interrupted job resumes where it stopped;
`results.runs` names them, `results.seeds` the seeds of each), all from one SFT base:
- on the 20-digit hard set (solved 0 of k times by the base), at the same rollouts per step and
  steps: GRPO; POPE at several prefix caps (guided in the prompt, as pope.guidance says); the
  papers' baselines
  (entropy bonus, pass@k advantages, hard + easy problems, SFT on the policy's own correct guided
  answers then GRPO, SFT on the oracle solutions then GRPO); POPE with a forced answer prefix;
  PrefixRL with its own rejection-sampled traces (the limit case: the pool is nearly empty);
- in PrefixRL's regime (a problem length where rejection sampling finds traces, chosen by a
  stated rule from the base's measured success rates): PrefixRL against SFT on the same traces
  then GRPO, both charged for the sampling that found the traces;
- an IsoCompute sweep over (n, B) at several seeds, with the fitted frontier.
Then studies/results_report.py writes the markdown report and figures. Nothing is tuned to an
outcome: the report states what the runs measured, effect or not.
"""
from __future__ import annotations

import math
import shlex
import sys
import time

from absl import logging

from jaxprefix import storage
from jaxprefix.errors import ConfigError
from jaxprefix.jobs import isocompute as iso_jobs
from jaxprefix.jobs.rl import key_step_probe, run_rl
from jaxprefix.methods import pope, prefixrl
from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.run_setup.method_settings import contexts_per_problem
from jaxprefix.jobs.report_tables import write_counts
from jaxprefix.jobs.study_setup import guiding_searches, study_of
from jaxprefix.run_setup import sft_base
from jaxprefix.run_setup.mining import LEDGER, mined_artifacts
from jaxprefix.run_setup.policy import base_dir, load_policy
from jaxprefix.run_setup.study_arms import RUNS, arm_config
from jaxprefix.run_setup.study_settings import ReportSettings, guided_design
from jaxprefix.studies import guided_share, prefixrl_controls, results_report, warm_start
from jaxprefix.studies.study import CUT, Study


def _set(config, field: str, value) -> None:
    section, _, name = field.rpartition(".")
    node = config
    for part in section.split(".") if section else ():
        node = node[part]
    node[name] = value


def run_config(config, study: Study, name: str, seed: int):
    """One run's config: the compute-matched method config of the study of `config`, plus the
    run's settings."""
    spec = RUNS[name]
    c = arm_config(config, study.workdir, study.mining.dir, spec.method, seed)
    for field, value in spec.settings.items():
        _set(c, field, value)
    if name == "grpo_easy":  # as many easy problems as POPE asks guided copies of hard ones
        c.pope.easy_per_step = c.train.problems_per_step
    if spec.regime == "prefixrl":
        # The training reward PrefixRL's paper plots against FLOPs, unguided, every 10 steps
        # (regime.eval_n samples in the run; the final evaluation takes eval.n).
        r = config.results.regime
        c.eval.update(hard_set=True, every=r.eval_every, n=r.eval_n)
        c.train.total_steps = r.steps
        c.train.problems_per_step = max(1, r.contexts_per_step
                                        // contexts_per_problem(c, spec.method))
    if spec.pool == "other":
        c.prefixrl.pool_path, stats = _other_pool(config, study)
        c.prefixrl.pool_flops = stats["flops"]
    return c


def run_results(config, workdir: str) -> dict:
    # pope_no_restate on a built-in task (whose hint has no wording) is refused by preflight.
    names = list(config.results.runs)
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise ConfigError(f"config.results.runs: unknown runs {unknown}; expected among "
                          f"{sorted(RUNS)}, as a tuple: --config.results.runs=\"('grpo','pope_cap1')\"")
    if config.results.regime.get("flops_budget", 0.0) < 0:
        raise ConfigError(f"config.results.regime.flops_budget="
                          f"{config.results.regime.flops_budget}: expected >= 0 FLOPs (0: "
                          f"regime.steps each)")
    if config.results.regime.get("flops_budget", 0.0) and not any(
            RUNS[name].regime == "prefixrl" for name in names):
        raise ConfigError(f"config.results.regime.flops_budget="
                          f"{config.results.regime.flops_budget} is set but no run of "
                          f"results.runs={tuple(names)} is in PrefixRL's regime; expected 0, or "
                          f"runs among {sorted(n for n in RUNS if RUNS[n].regime == 'prefixrl')}")
    if any(RUNS[name].regime == "prefixrl" for name in names):
        regime_target(config)  # a rule it has not got is refused before any work
    for i, name in enumerate(names):  # a FLOP-matched run follows what it spends (one at least)
        if RUNS[name].flops_match and not set(RUNS[name].flops_match) & set(names[:i]):
            raise ConfigError(f"config.results.runs: {name} spends the larger FLOPs of "
                              f"{' or '.join(RUNS[name].flops_match)}; expected one of them "
                              f"(or both) before it, got {tuple(names)}")
    # Mining a run needs happens when it first runs (the limit case's trace pool, each cap's
    # prefix search), so an interrupted study has spent its time on the runs listed first.
    hard = study_of(config, workdir)
    if config.results.same_problems:  # every arm on the hard problems all POPE arms guide
        hard = hard.on_problems_all_guide(guiding_searches(
            [run_config(config, hard, name, config.seed) for name in names
             if RUNS[name].method == "pope" and RUNS[name].regime == "hard"]))
    studies = {"hard": (config, hard)}  # each regime's config (its arms' source) and study
    report = {"runs": {}}
    # Seed-major: an interrupted study has answered every question at its first seeds.
    total, started = len(config.results.seeds) * len(names), time.perf_counter()
    for i, (seed, name) in enumerate((s, n) for s in config.results.seeds for n in names):
        if i:  # where a study of hours stands, in the log
            elapsed = time.perf_counter() - started
            logging.info("results: run %d of %d (%s, seed %d); %.0f s so far, ~%.0f s left at "
                         "this pace", i + 1, total, name, seed, elapsed,
                         elapsed / i * (total - i))
        if RUNS[name].regime not in studies:
            regime_config, regime, report["regime_probe"] = _prefixrl_regime(config, hard,
                                                                             workdir)
            studies["prefixrl"] = (regime_config, regime)
        key = f"{name}_seed{seed}"
        saved = storage.join(workdir, key, RECORD)
        if config.results.report_only and not storage.exists(saved):
            report["runs"][key] = {"name": name, "seed": seed, "skipped": "not run"}
            continue
        # what it spends: those of its matched runs this study runs (the eps sweep's floor
        # levels run the value hint alone: no restating prefix exists there)
        matched = [report["runs"].get(f"{m}_seed{seed}") for m in RUNS[name].flops_match
                   if m in names]
        report["runs"][key] = _run(*studies[RUNS[name].regime], name, seed,
                                   storage.join(workdir, key), matched)
    # After the runs: their prefix searches (one per cap) are in the mining ledgers by now.
    report["studies"] = {name: _study_record(*pair) for name, pair in studies.items()}
    # The command as given, for the report's first line (a rebuilt report keeps it).
    report["command"] = " ".join(["python -m jaxprefix.main", *map(shlex.quote, sys.argv[1:])])
    if config.results.isocompute:
        report["isocompute"] = _isocompute(config, hard, storage.join(workdir, "iso"))
    storage.write_json(storage.join(workdir, "results.json"), report, default=float)
    write_counts(report, config, workdir)
    results_report.write_report(report, ReportSettings.from_config(config, RUNS), workdir, RUNS)
    return report


def _study_record(config, study: Study) -> dict:
    """The base, the hard set and the mining of one study, for the report."""
    record = {"digits": list(config.data.digits), "hard": len(study.hard.problems),
              "candidates": len(study.sets.train), "k": study.hard.k,
              "base": study.evaluate(study.policy.model, "eval base"),
              "base_hard_set": study.evaluate(study.policy.model, "eval base on the hard set",
                                              study.hard.problems),
              "mining": {}}
    if config.eval.get("key_step_probe"):  # the base's eps, a, rho: the sweep's x axis
        record["base_probe"] = key_step_probe(config.data.source, study.policy, study.sets)(
            study.policy.model)
    record["mining"] = storage.read_json(storage.join(study.mining.dir, LEDGER))
    if storage.exists(storage.join(study.mining.dir, CUT)):
        record["cut"] = storage.read_json(storage.join(study.mining.dir, CUT))
    if "trace_pool" in record["mining"]:
        pool = study.trace_pool()
        samples = pool.samples_per_problem
        record["trace_pool"] = {"problems": len(pool.traces), "samples": int(sum(samples.values())),
                                "samples_found": [int(t.samples) for t in pool.traces.values()]}
    for key, name in (("other_trace_pool", prefixrl_controls.OTHER_POOL_STATS),
                      ("solved_pool", prefixrl_controls.SOLVED_POOL_STATS)):
        if storage.exists(storage.join(study.mining.dir, name)):
            record[key] = storage.read_json(storage.join(study.mining.dir, name))
    searches = {}
    for name in record["mining"]:
        if name.startswith("prefixes_"):
            search = storage.read_json(storage.join(study.mining.dir, f"{name}.json"))
            searches[name] = {"found": sum(v is not None for v in search["shortest_units"].values()),
                              "revealed_fractions": search["revealed_fractions"],
                              "answers": len(search["answers"])}
    record["prefix_searches"] = searches
    return record


RECORD = "results_record.json"  # a finished run's record: evaluated once, read back after


def _run(config, study: Study, name: str, seed: int, run_dir: str, matched=()) -> dict:
    """Trains one run (or finds it finished) and evaluates it; its record for the report.
    `matched`: the records of the runs whose largest FLOPs this one spends (RunSpec.flops_match)."""
    spec = RUNS[name]
    c = run_config(config, study, name, seed)
    if spec.flops_match:
        ran = [m for m in matched if "ledger" in m]  # a skipped run spent nothing to match
        if not ran:
            return {"name": name, "seed": seed,
                    "skipped": f"none of {', '.join(spec.flops_match)} ran to match"}
        # RL FLOPs up to the largest matched total (mining included) less this run's mining.
        target = max(ComputeLedger.from_dict(m["ledger"]).total_flops for m in ran)
        c.train.flops_budget = target - study.mining.cost(mined_artifacts(c)).extra_flops
        c.train.total_steps *= 10  # the budget, not the steps, ends it
    saved = storage.join(run_dir, RECORD)
    if storage.exists(saved):
        record = storage.read_json(saved)
        if record.get("steps") == c.train.total_steps or record.get("flops_budget"):
            return record
    record, warm_flops = {"name": name, "seed": seed}, 0.0
    if spec.flops_match:
        record["flops_budget"] = c.train.flops_budget
    if spec.pool == "other" and not _other_pool(config, study)[1]["problems"]:
        return record | {"skipped": "the second base found no trace"}
    if any(name.startswith("prefixes_") for name in mined_artifacts(c)):  # POPE's guided
        kept = _pope_problems(study, c)
        record["pope_problems"] = kept
        if not kept:  # nothing to guide within the cap: the run cannot happen, and says so
            return record | {"skipped": "no hard problem has a solvable prefix within the cap"}
    if spec.warm_start:
        examples = _warm_examples(config, study, spec.warm_start, seed)
        if not examples:
            return record | {"skipped": f"no examples to train on ({spec.warm_start})"}
        warm = warm_start.run_warm_start(
            study.policy, c.model.path, examples,
            storage.join(run_dir, "warm_start"), seed=seed, **config.results.warm_start)
        # The SFT updates, and the mining its examples came from (a baseline pays for its data).
        c.model.path = warm.path
        warm_flops = warm.flops + warm_start_mining(config, study, spec.warm_start).extra_flops
        policy = load_policy(c, run_dir)
        record["warm_start"] = study.evaluate(policy.model, f"eval {name} SFT")
        record["warm_start_hard_set"] = study.evaluate(policy.model, f"eval {name} SFT, hard set",
                                                       study.hard.problems)
        record["warm_start_examples"] = warm.report["problems"]
    budget = float(config.results.regime.get("flops_budget", 0.0))
    if spec.regime == "prefixrl" and budget:
        # Every arm of the regime to one total: its mining, warm start and second base included.
        artifacts = mined_artifacts(c)
        fixed = study.mining.cost([a for a in artifacts if a != "imported_pool"]).extra_flops \
            + warm_flops
        if "imported_pool" in artifacts:  # the second base's traces: booked when the run
            fixed += float(c.prefixrl.get("pool_flops", 0.0))  # imports them, after this
        if fixed >= budget:  # its SFT, if any, was evaluated: a row of the report
            return record | {"warm_flops": warm_flops,
                             "skipped": f"its mining and SFT ({fixed:.3g} FLOPs) spend the "
                                        f"regime's whole budget ({budget:.3g})"}
        c.train.flops_budget = record["flops_budget"] = budget - fixed
        c.train.total_steps *= 10  # the budget, not the steps, ends it
    out = run_rl(c, run_dir)
    out["ledger"].extra_flops += warm_flops
    record |= {"steps": out["step"],
               "after": study.evaluate(out["policy"].model, f"eval {name}"),
               "after_hard_set": study.evaluate(out["policy"].model, f"eval {name}, hard set",
                                                study.hard.problems),
               "ledger": out["ledger"].to_dict(), "warm_flops": warm_flops,
               "curve": _curve(run_dir, warm_flops)}
    if spec.method == "pope":
        record |= _guided_contexts(run_dir)
        share = guided_share.guided_share(record, guided_design(config, spec),
                                          len(study.hard.problems))
        if share is not None:
            print(f"results: {name} seed {seed}: {guided_share.share_sentence(share)}")
    storage.write_json(saved, record, default=float)
    return record


def _other_pool(config, study: Study) -> tuple[str, dict]:
    """The second base's trace pool (trained and mined beside the study's workdir, once)."""
    directory = storage.join(storage.dirname(study.workdir), "other_base")
    other = config.results.other_base
    return prefixrl_controls.other_policy_pool(
        study, lambda: sft_base.train_base(other_base_config(config), directory),
        {key: other[key] for key in ("seed", "layers", "width", "mlp_width")})


def other_base_config(config):
    """The second base's SFT config: the study's, with results.other_base's seed and model
    shape (the notation mix stays the first base's), sampled every 50 steps from the start of
    evaluation: with the first base's gate (step accuracy 0.3) a second base solved a hard problem
    at its first sampled point (step 625), leaving no point to keep; it is kept at its last point
    before a hard success (any policy with traces serves here)."""
    c = config.sft.copy_and_resolve_references()
    other = config.results.other_base
    c.seed = other.seed
    c.model.update(layers=other.layers, width=other.width, mlp_width=other.mlp_width)
    c.eval_every = 50
    c.criterion.sample_from_step_accuracy = 0.0
    return c


def _solved(study: Study) -> tuple[list, dict]:
    """The more-SFT control's examples (the base's own traces of problems it solves, as many as
    the hard set's trace pool holds, none of them hard) and the stats of finding them."""
    count = len(study.trace_pool().traces)
    return prefixrl_controls.solved_examples(study, count)


def _pope_problems(study: Study, c) -> int:
    """How many hard problems a POPE run guides (the rest have no solvable prefix in its cap)."""
    search = pope.PopeSettings.from_config(c)
    return len(pope.guided_units(study.hard.problems,
                                 study.prefix_search(search)["shortest_units"], search))


def warm_start_mining(config, study: Study, kind: str):
    """What mining the examples of a warm start of `kind` cost (a ledger), paid as the method
    they come from pays for it: the trace pool (PrefixRL's) for SFT on traces, the prefix search
    (POPE's) for SFT on own guided answers; oracle solutions cost nothing."""
    if kind in ("other_traces", "more_sft"):  # a second base's SFT and sampling; the solved
        cost = study.mining.cost(())          # problems' sampling
        if kind == "other_traces":
            stats = _other_pool(config, study)[1]
        else:
            stats = _solved(study)[1]
        cost.extra_flops = stats["flops"]
        return cost
    method = {"traces": "prefixrl", "own_guided": "pope"}.get(kind)
    if method is None:  # oracle solutions: nothing mined
        return study.mining.cost(())
    c = config.copy_and_resolve_references()
    c.method = method
    return study.mining.cost([a for a in mined_artifacts(c) if a != "hard_set"])


def _warm_examples(config, study: Study, kind: str, seed: int) -> list:
    problems = study.hard.problems
    if kind == "more_sft":
        return _solved(study)[0]
    if kind == "other_traces":
        path, stats = _other_pool(config, study)
        if not stats["problems"]:
            return []
        pool = prefixrl.TracePool.load_jsonl(path, study.policy.prompts)
        return warm_start.trace_examples(problems, pool)
    if kind == "oracle":
        return warm_start.oracle_examples(study.policy, problems)
    if kind == "own_guided":
        answers = study.prefix_search()["answers"]
        return warm_start.own_guided_examples(problems, answers)
    if kind == "traces":
        return warm_start.trace_examples(problems, study.trace_pool(problems))
    raise ValueError(f"warm start {kind!r}: expected 'oracle', 'own_guided', 'traces', "
                     f"'other_traces' or 'more_sft'")


def regime_target(config) -> tuple[float, str]:
    """The per-sample base success rate PrefixRL's regime is chosen by, and the rule's words.
    'middle': the length closest (in log) to 1 / sqrt(k * max_samples), the geometric middle
    between a rate the mining k (pass@k = 0) rarely sees and one the rejection-sampling budget
    still finds. 'hard': the shortest length at most 1 - (1 - p)^(1/k), where the base's pass@k
    is at most p = regime.max_pass (issue 43: at 'middle' the base reached 0.145 pass@16 on
    the held-out problems of its 'hard' set)."""
    r, k = config.results.regime, config.mining.k
    if r.get("rule", "middle") == "middle":
        target = 1.0 / math.sqrt(k * config.prefixrl.max_samples)
        return target, (f"the length whose base success rate per sample is closest (in log) "
                        f"to 1 / sqrt(k x max_samples) = {target:.4f}")
    if r.rule != "hard":
        raise ConfigError(f"config.results.regime.rule={r.rule!r}: expected 'middle' or 'hard'")
    target = 1.0 - (1.0 - r.max_pass) ** (1.0 / k)
    return target, (f"the shortest length whose base success rate per sample is above 0 and "
                    f"at most 1 - (1 - {r.max_pass:g})^(1/{k}) = {target:.2e}, so that the "
                    f"base's pass@{k} there is at most {r.max_pass:g}")


def choose_length(rates: dict[int, float], rule: str, target: float) -> int | None:
    """The regime's problem length from the base's per-sample success rates by `rule`
    (`regime_target`); None where no length has a success. 'hard' where no measured length is
    as hard as its target: the hardest measured one (the closest to it; the probe records that
    the target was missed), never an easier one."""
    measured = {d: v for d, v in rates.items() if v > 0}
    if not measured:
        return None
    if rule == "hard":
        within = [d for d, v in measured.items() if v <= target]
        return min(within) if within else min(measured, key=measured.get)
    return min(measured, key=lambda d: abs(math.log(measured[d]) - math.log(target)))


def _prefixrl_regime(config, hard: Study, workdir: str):
    """PrefixRL's regime: the problem length `regime_target` chooses, measured on the base;
    (its config, its study, the probe)."""
    r = config.results.regime
    path = storage.join(workdir, "regime_probe.json")
    if storage.exists(path):
        probe = storage.read_json(path)
    else:
        target_rate, rule = regime_target(config)
        probe = {"digits": {}, "target_rate": target_rate, "rule": rule}
        from jaxprefix.data import tasks

        task = tasks.get(config.data.source)

        for digits in r.probe_digits:
            problems = task.generate(r.probe_problems, digits=(digits, digits),
                                     multipliers=tuple(config.data.multipliers),
                                     seed=config.data.seed + 100 + digits)
            rates = hard.evaluate(hard.policy.model, f"regime probe {digits} digits", problems,
                                  n=r.probe_samples)
            probe["digits"][str(digits)] = rates["pass@1"]
        chosen = choose_length({int(d): v for d, v in probe["digits"].items()},
                               r.get("rule", "middle"), target_rate)
        if chosen is None:  # an untrained (smoke) base: no length has a success, said so
            probe["chosen"], probe["no_success"] = min(r.probe_digits), True
        else:
            probe["chosen"] = chosen
            # the 'hard' rule's target out of the probed lengths' reach: the hardest, said so
            probe["target_missed"] = probe["digits"][str(chosen)] > target_rate
        storage.write_json(path, probe)
    c = config.copy_and_resolve_references()
    c.data.digits = (probe["chosen"], probe["chosen"])
    c.model.path = base_dir(config, workdir)
    regime_dir = storage.join(workdir, "prefixrl_regime")
    c.mining.dir = storage.join(regime_dir, "mining")
    return c, study_of(c, regime_dir, prefixes=False, trace_pool=True), probe


def _isocompute(config, study: Study, iso_dir: str) -> dict:
    """The sweep from the study's base on mid-length problems, where plain GRPO has signal."""
    c = config.copy_and_resolve_references()
    c.model.path = base_dir(config, study.workdir)
    c.data.update(digits=tuple(c.results.iso_digits), multipliers=(2, 9))
    c.data.eval_size = c.results.iso_eval_size
    c.mining.train_on = "all"
    return iso_jobs.run_sweep(c, iso_dir)


def _guided_contexts(run_dir: str) -> dict:
    """The training contexts of a run, and how many were guided, over its steps' metrics."""
    rows = read_metrics(run_dir)
    guided = sum(r.get("contexts/guided", 0.0) for r in rows)
    return {"guided_contexts": int(guided),
            "contexts": int(guided + sum(r.get("contexts/unguided", 0.0) for r in rows))}


def _curve(run_dir: str, warm_flops: float = 0.0) -> list:
    """Per in-run evaluation: FLOPs (RL + mining + `warm_flops`) and every eval/*, hard_set/*
    and probe/* metric."""
    extra = storage.read_json(storage.join(run_dir, "compute.json"))["extra_flops"] + warm_flops
    points = []
    for r in read_metrics(run_dir):
        metrics = {k: v for k, v in r.items() if k.startswith(("eval/", "hard_set/", "probe/"))}
        if metrics:
            points.append({"step": r["step"], "flops": r["flops/total"] + extra} | metrics)
    return points
