"""End-to-end smoke runs of the study jobs, each as `python -m jaxprefix.main` in a fresh
workdir: the demo and results pipelines, the PrefixRL controls, the eps sweep, the SFT
baselines, the IsoCompute sweep and fit, an allocated run and the tool study. Like
test_jobs.py, nothing here is expected to learn; the checks are on what each job writes."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from jaxprefix.rl.compute_ledger import ComputeLedger
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.studies.results_report import NOTES_MARKER, prefix_search_lines
from tests.job_runs import (CANDIDATES, CAP1_SEARCH, K, N, PREFIX_SEARCH, PROBLEMS_PER_STEP,
                            ROOT, STEPS, check_png, mining_rollouts, rl_run, run_main)


def test_demo_pipeline_smoke(base, tmp_path):
    workdir = tmp_path / "demo"
    run_main("configs/pope.py:demo_smoke", workdir, f"--config.model.path={base}")
    with open(workdir / "demo_report.json") as f:
        report = json.load(f)
    assert sorted(report["runs"]) == ["grpo", "pope"]
    assert report["hard_set"]["candidates"] == CANDIDATES and report["hard_set"]["k"] == K
    for run in report["runs"].values():
        assert run["steps"] == STEPS and "pass@4" in run["after"]
    # The same rollouts a step (GRPO takes twice the problems of POPE's 1 guided : 1 unguided
    # batches), and GRPO runs on until one more step would pass POPE's FLOPs.
    pope, grpo = report["runs"]["pope"], report["runs"]["grpo"]
    assert pope["ledger"]["rollouts"] == STEPS * PROBLEMS_PER_STEP * 2 * N
    assert grpo["ledger"]["rollouts"] == grpo["steps"] * PROBLEMS_PER_STEP * 2 * N
    total = lambda run: run["ledger"]["sampling_flops"] + run["ledger"]["update_flops"] + \
        run["ledger"]["extra_flops"]
    grpo_records = read_metrics(str(workdir / "grpo"))
    step = max(r["flops/sampling"] + r["flops/update"] for r in grpo_records)
    assert total(grpo) <= total(pope) < total(grpo) + step and grpo["steps"] >= STEPS
    table = (workdir / "demo_report.md").read_text()
    assert table.startswith("Held-out hard problems") and "a solvable oracle prefix for " in table
    assert "| policy | pass@1 | pass@4 |" in table
    for row in ("| base (SFT) | 0.", "| POPE (2 steps) |", f"| GRPO ({grpo['steps']} steps) |"):
        assert row in table, row
    check_png(str(workdir / "demo_curves.png"))
    assert [r["step"] for r in read_metrics(str(workdir / "pope"))] == [1, 2]


def test_results_pipeline_smoke(base, tmp_path):
    """Runs of the results job at smoke sizes, PrefixRL's regime and its SFT warm start included:
    its files exist and are well formed, each run is charged for the mining it uses, and the warm
    start's SFT is charged in its run's FLOPs."""
    workdir = tmp_path / "results"
    workdir.mkdir()
    notes = f"{NOTES_MARKER}\n## Notes\nwritten by hand\n"
    (workdir / "REPORT.md").write_text("# an older report\n\n" + notes)
    names = ["grpo", "pope_cap1", "pope_cap0.25", "grpo_easy", "sft_oracle", "prefixrl_regime",
             "sft_traces_regime"]
    run_main("configs/results.py:smoke", workdir, f"--config.model.path={base}",
             f"--config.results.runs=({','.join(repr(n) for n in names)})")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    assert sorted(report["runs"]) == sorted(f"{name}_seed0" for name in names)
    assert report["command"].startswith(  # the report's first line says how it was made
        "python -m jaxprefix.main --config=configs/results.py:smoke ")
    assert report["command"] in (workdir / "REPORT.md").read_text()
    for run in report["runs"].values():
        assert "pass@4" in run["after"] and "pass@4" in run["after_hard_set"], run["name"]
        assert run["curve"] and "flops" in run["curve"][-1], run["name"]
        assert read_metrics(str(workdir / f"{run['name']}_seed0"))[-1]["step"] == STEPS
    # Each method pays for the mining it uses: GRPO the hard set, POPE also its own cap's prefix
    # search, hard + easy (POPE with no guided copies) no prefixes.
    with open(workdir / "mining" / "ledger.json") as f:
        costs = {name: ledger["extra_rollouts"] for name, ledger in json.load(f).items()}
    assert set(costs) == {"hard_set", PREFIX_SEARCH, CAP1_SEARCH}
    assert costs[PREFIX_SEARCH] == mining_rollouts(workdir) - K * CANDIDATES
    charged = {run["name"]: run["ledger"]["extra_rollouts"] for run in report["runs"].values()}
    assert charged["grpo"] == charged["sft_oracle"] == charged["grpo_easy"] == costs["hard_set"]
    assert charged["pope_cap1"] == costs["hard_set"] + costs[CAP1_SEARCH]
    assert charged["pope_cap0.25"] == costs["hard_set"] + costs[PREFIX_SEARCH]
    with open(workdir / "sft_oracle_seed0" / "warm_start" / "warm_start.json") as f:
        warm = json.load(f)
    assert warm["flops"] > 0 and len(warm["losses"]) == warm["steps"] > 0
    assert warm["warmup_steps"] == max(1, round(0.3 * warm["steps"]))  # configs/results.py
    sft_run, grpo_run = report["runs"]["sft_oracle_seed0"], report["runs"]["grpo_seed0"]
    assert "pass@4" in sft_run["warm_start"]
    assert sft_run["ledger"]["extra_flops"] == pytest.approx(
        grpo_run["ledger"]["extra_flops"] + warm["flops"])
    # PrefixRL's regime: its own hard set, evaluated in-run on that training hard set.
    regime = report["studies"]["prefixrl"]
    assert regime["digits"] == [report["regime_probe"]["chosen"]] * 2
    assert "hard_set/pass@1" in report["runs"]["prefixrl_regime_seed0"]["curve"][-1]
    assert "pass@4" in report["runs"]["sft_traces_regime_seed0"]["warm_start_hard_set"]
    # SFT on traces pays for its data as PrefixRL does (here oracle traces, free), plus its SFT.
    with open(workdir / "sft_traces_regime_seed0" / "warm_start" / "warm_start.json") as f:
        sft_flops = json.load(f)["flops"]
    assert report["runs"]["sft_traces_regime_seed0"]["ledger"]["extra_flops"] == pytest.approx(
        report["runs"]["prefixrl_regime_seed0"]["ledger"]["extra_flops"] + sft_flops)
    text = (workdir / "REPORT.md").read_text()
    assert text.endswith("\n" + notes) and "an older report" not in text  # notes kept
    assert "{" not in text, "a template left unformatted"  # 'Hard set: {study[...]}' was
    for name in names:
        assert f"| {name} | 1 |" in text, name
    assert "| sft_oracle: after SFT, before RL | 1 |" in text
    for name in names:  # every cell: mean [95% interval]
        assert re.search(rf"\| {name} \| 1 \| \d\.\d{{3}} \[\d\.\d{{3}}, \d\.\d{{3}}\]", text), name
    assert "Paired differences" in text and "by multiplier" in text
    check_png(str(workdir / "curves.png"))
    check_png(str(workdir / "regime_curves.png"))


def test_prefixrl_controls_smoke(base, tmp_path):
    """PrefixRL's controls: the second base has another shape and is charged its SFT and its
    sampling; the more-SFT control's problems are ones the base solves, charged their sampling;
    every arm runs to one FLOPs total (results.regime.flops_budget)."""
    workdir = tmp_path / "controls"
    names = ["grpo_regime", "sft_more_regime", "prefixrl_other_regime", "sft_other_traces_regime"]
    budget = 4e9
    run_main("configs/results.py:smoke", workdir, f"--config.model.path={base}",
             f"--config.results.runs=({','.join(repr(n) for n in names)})",
             f"--config.results.regime.flops_budget={budget}")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    regime = report["studies"]["prefixrl"]
    other = regime["other_trace_pool"]
    assert other["shape"] == {"layers": 4, "width": 48, "mlp_width": 192}  # configs/results.py
    assert other["sft_flops"] > 0 and other["flops"] == pytest.approx(
        other["sft_flops"] + other["sampling_flops"])
    with open(workdir / "other_base" / "base" / "config.json") as f:
        assert json.load(f)["num_hidden_layers"] == 4
    ran = [r for r in report["runs"].values() if "ledger" in r]
    assert "grpo_regime" in {r["name"] for r in ran}
    for run in ran:  # each to the budget: within one step of it, never past it
        total = ComputeLedger.from_dict(run["ledger"]).total_flops
        step = max(r["flops/sampling"] + r["flops/update"]
                   for r in read_metrics(str(workdir / f"{run['name']}_seed0")))
        assert budget - step < total <= budget, run["name"]
    # The smoke bases solve nothing at this length: both pools come out empty, their arms say
    # so, and the searches were made (and cost what the stats say).
    solved = regime["solved_pool"]
    assert solved["tried"] > 0 and solved["flops"] > 0 and other["samples"] > 0
    runs = report["runs"]
    assert (solved["problems"] == 0) == ("skipped" in runs["sft_more_regime_seed0"])
    assert (other["problems"] == 0) == ("skipped" in runs["prefixrl_other_regime_seed0"])
    text = (workdir / "REPORT.md").read_text()
    assert "to 4e+09 FLOPs in all" in text and "4 layers of width 48" in text


def test_eps_sweep_smoke(base, tmp_path):
    """The overlap axis' runs: both hints on the restating notation, GRPO to the larger's FLOPs,
    the key-step probe in every curve and of the base."""
    workdir = tmp_path / "eps"
    run_main("configs/results.py:eps_smoke", workdir, f"--config.model.path={base}")
    with open(workdir / "results.json") as f:
        report = json.load(f)
    runs = {r["name"]: r for r in report["runs"].values()}
    assert sorted(runs) == ["grpo_matched_hints", "pope_restating_hint", "pope_value_hint"]
    total = {n: ComputeLedger.from_dict(r["ledger"]).total_flops for n, r in runs.items()}
    spent = max(total["pope_restating_hint"], total["pope_value_hint"])
    matched = runs["grpo_matched_hints"]
    assert matched["flops_budget"] == pytest.approx(spent - report["studies"]["hard"]["mining"]
                                                    ["hard_set"]["extra_flops"])
    assert total["grpo_matched_hints"] <= spent
    for run in runs.values():
        assert 0 <= run["curve"][-1]["probe/success"] <= run["curve"][-1]["probe/key_step"] <= 1
    assert report["studies"]["hard"]["base_probe"]["probe/key_name"] > 0
    # One problem set for the three arms (results.same_problems): the smoke guides every hard
    # problem by the longest prefix tried, so the cut keeps them all.
    cut = report["studies"]["hard"]["cut"]
    assert cut["kept"] == cut["hard"] == report["studies"]["hard"]["hard"] > 0
    # Each POPE arm's guided contexts, counted in training (issue 43).
    for name in ("pope_restating_hint", "pope_value_hint"):
        if "after" in runs[name]:
            assert 0 <= runs[name]["guided_contexts"] <= runs[name]["contexts"] / 2
    # The phase table and figure, from the level's committed counts alone.
    from jaxprefix.jobs import eps_phase

    assert eps_phase.main(["eps_phase", str(tmp_path)]) == 0
    phase = (tmp_path / "PHASE.md").read_text()
    for hint in ("value hint", "restating hint"):
        assert re.search(rf"\| {hint} \| (-|\d\.\d\d[^|]*) \| 1 \| [+-]\d\.\d{{3}} \[", phase), hint
    check_png(str(tmp_path / "phase.png"))


def test_every_arm_of_a_level_trains_on_the_problems_both_hints_guide(base, tmp_path):
    """results.same_problems (the eps sweep): the cut keeps the hard problems every POPE arm's
    search solved, GRPO trains on those too, and each arm is still charged the whole mining.
    The smoke base solves no prefix, so the two searches' records are written here by hand."""
    import importlib.util

    from jaxprefix.jobs.results import run_config
    from jaxprefix.jobs.study_setup import guiding_searches, study_of
    from jaxprefix.methods import pope
    from jaxprefix.run_setup.mining import mined_artifacts

    spec = importlib.util.spec_from_file_location("results_config",
                                                  os.path.join(ROOT, "configs", "results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config("eps_smoke")
    config.model.path, config.pope.unsolved = base, "drop"
    study = study_of(config, str(tmp_path))
    arms = ("pope_value_hint", "pope_restating_hint")
    searches = {a: [m for m in mined_artifacts(run_config(config, study, a, 0))
                    if m != "hard_set"][0] for a in arms}
    guiding = guiding_searches([run_config(config, study, a, 0) for a in arms])
    assert [s.search_name for s in guiding] == [searches[a] for a in arms]
    study.on_problems_all_guide(guiding)  # searched: none found
    ids = [p.id for p in study.hard.problems]
    assert len(ids) >= 4
    for arm, solved in zip(arms, (ids[:3], ids[1:4])):
        path = tmp_path / "mining" / f"{searches[arm]}.json"
        record = json.loads(path.read_text())
        record["shortest_units"] = {i: (1 if i in solved else None) for i in ids}
        path.write_text(json.dumps(record))
    cut = study.on_problems_all_guide(guiding)
    assert [p.id for p in cut.hard.problems] == ids[1:3]
    with open(tmp_path / "mining_all_guide" / "cut.json") as f:
        assert json.load(f) == {"hard": len(ids), "kept": 2,
                                "found": {searches[a]: 3 for a in arms}}
    with open(tmp_path / "mining" / "ledger.json") as f:
        spent = {name: ledger["extra_flops"] for name, ledger in json.load(f).items()}
    assert all(spent[searches[a]] > 0 for a in arms)
    for name in (*arms, "grpo_matched_hints"):
        c = run_config(config, cut, name, 0)
        assert c.mining.dir == str(tmp_path / "mining_all_guide")
        needs = mined_artifacts(c)
        assert cut.mining.cost(needs).extra_flops == pytest.approx(sum(spent[a] for a in needs))
        if name in arms:  # both guide every problem they train on
            settings = pope.PopeSettings.from_config(c)
            units = cut.mining.prefixes(cut.hard, settings)
            assert sorted(pope.guided_units(cut.hard.problems, units, settings)) == sorted(ids[1:3])


def test_sft_baselines_pay_for_the_mining_their_examples_came_from(base, tmp_path):
    """SFT on traces is charged PrefixRL's rejection sampling, SFT on own guided answers POPE's
    prefix search, SFT on oracle solutions nothing (they used to be charged none of it: in the
    study, SFT-on-traces-then-RL ran 1.1e12 FLOPs cheaper than PrefixRL on the same traces)."""
    from jaxprefix import variants
    from jaxprefix.jobs.results import warm_start_mining
    from jaxprefix.jobs.study_setup import study_of

    config = variants.method_config(os.path.join(ROOT, "configs", "results.py"), "pope",
                                      "smoke")[0]
    config.model.path = base
    config.prefixrl.update(variants.SMOKE_PREFIXRL)  # what configs/results.py:smoke sets
    config.prefixrl.oracle_traces = False  # rejection sampling, as the study mines its pool
    study = study_of(config, str(tmp_path), trace_pool=True)
    with open(tmp_path / "mining" / "ledger.json") as f:
        mined = {name: ledger["extra_flops"] for name, ledger in json.load(f).items()}
    assert mined["trace_pool"] > 0 and mined[PREFIX_SEARCH] > 0
    assert warm_start_mining(config, study, "traces").extra_flops == mined["trace_pool"]
    assert warm_start_mining(config, study, "own_guided").extra_flops == mined[PREFIX_SEARCH]
    assert warm_start_mining(config, study, "oracle").extra_flops == 0


@pytest.mark.slow  # ~100 s: four GRPO runs, then the fit
def test_isocompute_sweep_and_fit_smoke(carry_base, tmp_path):
    workdir = tmp_path / "iso"
    run_main("configs/isocompute.py:smoke", workdir, f"--config.model.path={carry_base}")
    with open(workdir / "frontier.json") as f:
        frontier = json.load(f)
    # budgets (32, 64), ns (2, 4), batches (4, 8): each (n, B) runs once at the largest budget.
    points = [(2, 4), (2, 8), (4, 4), (4, 8)]
    assert sorted((r["n"], r["batch"]) for r in frontier["runs"]) == points
    assert sorted(os.listdir(workdir / "runs")) == ["n2_b4_s0", "n2_b8_s0", "n4_b4_s0", "n4_b8_s0"]
    # The smoke base solves nothing, so every eval curve is flat at 0 and there is no frontier to
    # fit: frontier.json says why (the fit itself is tested on known sigmoids in
    # test_isocompute.py).
    assert all(max(r["reward"]) == 0.0 for r in frontier["runs"])
    assert frontier["fit"] is None and "record-breaking" in frontier["reason"]


def test_printed_sweep_commands_run(carry_base, tmp_path):
    """print_only prints one command per point; running one (as printed) trains exactly that
    point: its n, B, M, scaled learning rate and evaluation schedule."""
    workdir = tmp_path / "iso"
    printed = run_main("configs/isocompute.py:smoke", workdir, f"--config.model.path={carry_base}",
                       "--config.isocompute.print_only=True").stdout.strip().splitlines()
    assert len(printed) == 4  # (n, B) in {2, 4} x {4, 8}, one seed
    command = next(line for line in printed if "n4_b8_s0" in line)
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "jaxprefix.main"]
    result = subprocess.run([sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workdir / "runs" / "n4_b8_s0"
    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == [1, 2]  # M = 64 // (4 x 8)
    assert records[-1]["lr"] == pytest.approx(1e-4 * (32 / 512) ** 0.5)  # the sqrt rule
    assert "eval/avg@4" in records[0]  # every 16 rollouts: every step
    with open(run_dir / "compute.json") as f:
        assert json.load(f)["rollouts"] == 64


@pytest.mark.slow  # ~1.3 min on 2 cores; test_isocompute checks the allocation itself
def test_allocated_run_spends_its_budget(base, tmp_path):
    """isocompute.budget sets n, B and M from the fitted rule in frontier_path; the run spends
    that budget (rollouts: exactly n B M <= budget < n B (M + 1); FLOPs: within one step)."""
    rule = {"n_curve": {"floor": 2.0, "ceiling": 2.0, "center": 10.0, "width": 1.0},
            "batch": 2, "flops_per_rollout": 5e7}  # n = 4, B = 2
    frontier = tmp_path / "frontier.json"
    frontier.write_text(json.dumps({"allocation": rule}))
    flags = (f"--config.isocompute.frontier_path={frontier}", "--config.eval.every=0")
    workdir = rl_run("configs/grpo.py:smoke", tmp_path / "rollouts", base,
                     "--config.isocompute.budget=30", *flags)
    with open(os.path.join(workdir, "compute.json")) as f:
        assert json.load(f)["rollouts"] == 4 * 2 * 3  # M = 30 // 8
    assert len(read_metrics(workdir)) == 3
    budget = 2e9  # about 3 steps of 8 rollouts of the smoke policy
    workdir = rl_run("configs/grpo.py:smoke", tmp_path / "flops", base,
                     f"--config.isocompute.budget={budget}", "--config.isocompute.budget_unit=flops",
                     *flags)
    with open(os.path.join(workdir, "compute.json")) as f:
        ledger = json.load(f)
    records = read_metrics(workdir)
    step = max(r["flops/sampling"] + r["flops/update"] for r in records)
    spent = ledger["sampling_flops"] + ledger["update_flops"]
    assert abs(budget - spent) <= step and len(records) >= 2
    assert records[-1]["flops/total"] == pytest.approx(spent)


def test_prefix_search_table_counts_a_prefix_at_a_cap_under_that_cap():
    study = {"hard": 8, "prefix_searches": {"prefixes_instruction_default_f0.5": {
        "found": 5, "revealed_fractions": [0.25, 0.3, 0.5, 0.5, 0.95]}}}
    row = prefix_search_lines(study)[-2]
    assert row.endswith("| 1 | 3 | 0 | 1 |"), row  # (0, .25] (.25, .5] (.5, .75] (.75, 1]


# configs/tools.py:smoke (the tools study at smoke sizes): its own smoke SFT base with tool
# episodes, then GRPO with tools (3 steps) and, on to the tools arm's FLOPs, GRPO without, with
# the key in the prompt and with the uninformative reader (the controls).
TOOL_ARMS = ("tools_seed0", "no_tools_seed0", "key_given_seed0", "blind_tool_seed0")
TOOL_METRICS = ("rollout/tool_calls", "rollout/turns_mean", "rollout/tool_failures",
                "rollout/reprefilled_tokens")


@pytest.fixture(scope="module")
def tool_study(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tools")
    run_main("configs/tools.py:smoke", workdir)
    return workdir


def test_tool_study_smoke_from_a_fresh_workdir(tool_study):
    """Every row of both arms carries the tool metrics (the no-tools arm: one turn, no call); the
    ledger books the tools arm's prefilled observations and re-prefills; the no-tools arm stops
    before it would pass the tools arm's FLOPs; the report compares them."""
    for arm in TOOL_ARMS:
        records = read_metrics(str(tool_study / arm))
        assert all(key in r for r in records for key in TOOL_METRICS)
        ledger = json.loads((tool_study / arm / "compute.json").read_text())
        assert ledger["sampled_tokens"] == sum(r["tokens/sampled"] for r in records)
    tools = read_metrics(str(tool_study / "tools_seed0"))
    none = read_metrics(str(tool_study / "no_tools_seed0"))
    assert [r["step"] for r in tools] == [1, 2, 3]
    assert all(r["rollout/turns_mean"] == 1 and r["rollout/tool_calls"] == 0 for r in none)
    # an episode's tokens: every sampled one, and the prompt, observations and re-prefills
    assert all(r["tokens/sampled"] > r["tokens/generated"] + r["rollout/reprefilled_tokens"]
               for r in tools)
    spent = [json.loads((tool_study / arm / "compute.json").read_text()) for arm in TOOL_ARMS]
    total = [ComputeLedger.from_dict(s).total_flops for s in spent]
    for arm, flops in zip(TOOL_ARMS[1:], total[1:]):  # each control on to the tools arm's FLOPs
        last = read_metrics(str(tool_study / arm))[-1]
        assert flops <= total[0] < flops + last["flops/sampling"] + last["flops/update"], arm
    # The key in the prompt: one turn, d and c in the hint slots; the blind reader: called as the
    # tools arm calls its reader, its answers never the key's.
    assert all(r["rollout/tool_calls"] == 0 for r in read_metrics(str(tool_study /
                                                                      "key_given_seed0")))
    report = json.loads((tool_study / "tool_study_report.json").read_text())
    assert set(report["base"]) == {"tools", "no_tools", "key_given", "blind_tool"}
    assert [r["steps"] for r in report["runs"]["tools"]] == [3]
    text = (tool_study / "tool_study_report.md").read_text()
    for line in ("GRPO with tools − GRPO without tools",
                 "GRPO with tools − GRPO with the key in the prompt, no tool",
                 "GRPO with tools − GRPO with an uninformative tool"):
        assert line in text, line


@pytest.mark.slow  # two smoke studies: a few minutes on 2 cores
def test_tool_study_smoke_resumes_after_sigterm_to_the_same_rows(tool_study, tmp_path):
    """SIGTERM in the tools arm's second step: it saves and exits 143; the same command then
    resumes both arms, and every metrics row equals the uninterrupted study's (times aside)."""
    workdir = tmp_path / "tools"
    base = f"--config.model.path={tool_study / 'base'}"  # the same base, not trained again
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/tools.py:smoke",
         f"--workdir={workdir}", base], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    metrics = workdir / "tools_seed0" / "metrics.jsonl"
    deadline = time.time() + 900
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.time() < deadline, "no step was logged"
        time.sleep(0.5)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == 143, stderr[-2000:]
    assert len(read_metrics(str(workdir / "tools_seed0"))) < 3
    run_main("configs/tools.py:smoke", workdir, base)

    def rows(root, arm):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
                for r in read_metrics(str(root / arm))]
    for arm in TOOL_ARMS:
        assert rows(workdir, arm) == rows(tool_study, arm), arm
    reports = [json.loads((w / "tool_study_report.json").read_text())
               for w in (workdir, tool_study)]
    assert reports[0]["runs"] == reports[1]["runs"] and reports[0]["base"] == reports[1]["base"]
