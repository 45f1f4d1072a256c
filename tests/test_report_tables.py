"""Every table rebuilt from committed per-problem counts (jaxprefix/jobs/report_tables.py), on
tiny synthetic counts files and on the committed ones."""
import os

import numpy as np
import pytest

from jaxprefix import run_config, statistics, storage
from jaxprefix.jobs import isocompute_prereg, report_tables
from jaxprefix.studies import guided_share
from jaxprefix.rl.compute_ledger import ComputeLedger

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS, SAMPLES = 128, 16


def _evaluation(counts, grouped=True):
    # problems from a file or reasoning-gym carry no difficulty knob: no groups
    groups = {"multiplier": [2 + p % 8 for p in range(len(counts))]} if grouped else {}
    return {"correct_counts": list(map(int, counts)), "num_samples": SAMPLES, "groups": groups,
            "pass@1": float(np.mean(counts)) / SAMPLES}


@pytest.mark.parametrize("grouped", [True, False])
def test_results_report_is_rebuilt_from_its_counts_file(tmp_path, grouped):
    config = run_config.from_file(os.path.join(ROOT, "configs", "results.py"), "smoke")
    config.results.runs = ("pope_cap0.25", "grpo_matched")
    config.eval.ks = (1, 16)
    rng = np.random.default_rng(0)
    zeros = [0] * PROBLEMS
    grpo = [rng.binomial(SAMPLES, 0.05, PROBLEMS).tolist() for _ in range(3)]
    ledger = ComputeLedger(1000).to_dict() | {"sampling_flops": 1e9}
    curve = [{"flops": 1e9, "eval/pass@16": 0.0}]
    runs = {}
    for seed in range(3):
        runs[f"pope_cap0.25_seed{seed}"] = {"name": "pope_cap0.25", "seed": seed, "steps": 2,
                                            "ledger": ledger, "curve": curve,
                                            "after": _evaluation(zeros, grouped),
                                            "after_hard_set": _evaluation(zeros, grouped)}
        runs[f"grpo_matched_seed{seed}"] = {"name": "grpo_matched", "seed": seed, "steps": 2,
                                            "ledger": ledger, "curve": curve,
                                            "after": _evaluation(grpo[seed], grouped),
                                            "after_hard_set": _evaluation(grpo[seed], grouped)}
    study = {"digits": [8, 8], "hard": PROBLEMS, "candidates": PROBLEMS, "k": 16,
             "base": _evaluation(zeros, grouped), "base_hard_set": _evaluation(zeros, grouped)}
    report = {"runs": runs, "studies": {"hard": study}}
    config.results.output_dir = str(tmp_path)
    counts = report_tables.write_counts(report, config, "runs/synthetic")
    assert os.path.getsize(counts) < 100_000  # small enough to commit

    assert report_tables.regenerate(str(tmp_path)) == f"{tmp_path}: REPORT.md from counts.json"
    text = storage.read_text(str(tmp_path / "REPORT.md"))
    # 0 of 3 x 128 x 16 samples: the cell states the bound (1 - 0.05^(1/6144) = 4.87e-4).
    assert "| pope_cap0.25 | 3 | 0.000 ± 0.000 [0.000, 0.000] (rate < 4.9e-4, 0 of 6144) |" in text
    grpo_cell = statistics.format_cell(statistics.summary(
        statistics.pass_at_k_table(grpo, SAMPLES, 1), samples=3 * PROBLEMS * SAMPLES))
    assert f"| grpo_matched | 3 | {grpo_cell} |" in text
    assert "(rate < 1.5e-3, 0 of 2048)" in text  # the base: one evaluation
    assert ("held-out pass@16 by multiplier" in text) == grouped


def test_prereg_outcome_and_report_are_rebuilt_from_counts_and_the_committed_prediction(
        tmp_path):
    groups = ["digits <= 9"] * 6 + ["digits > 9"] * 4
    curves = {}
    for n, rate in ((2, 0.25), (8, 0.75)):
        for seed in (0, 1):
            counts = np.full((2, len(groups)), 4 * rate)
            counts[0] = 0  # the first evaluation, at 1024 rollouts, solves nothing
            curves[(n, 4, seed)] = ([1024, 4096], counts / 4, 4)
    isocompute_prereg.write_counts(str(tmp_path / "counts.json"), curves, groups, [0, 1])
    entry = {"problems": 6, "envelope": {"4096": 2}, "rule": {}, "fit": None,
             "degenerate": "log2 n* moves +0.00 over the fit's budgets"}
    prediction = {"fit_max_rollouts": 2048, "predicted_budgets": [4096], "ns": [2, 8],
                  "seeds": [0, 1], "lr_rule": "constant",
                  "groups": {"digits <= 9": entry, "digits > 9": entry | {"problems": 4}}}
    storage.write_json(str(tmp_path / "prediction.json"), prediction)
    line = report_tables.regenerate(str(tmp_path))
    assert line.endswith("outcome.json and REPORT.md from counts.json and prediction.json")
    outcome = storage.read_json(str(tmp_path / "outcome.json"))
    cell = outcome["groups"]["digits <= 9"]["4096"]
    assert cell["best"] == 8 and cell["mean"] == {"2": 0.25, "8": 0.75}
    assert cell["envelope"]["minus_best"] == -0.5 and not cell["envelope"]["holds"]
    assert storage.read_json(str(tmp_path / "prediction.json")) == prediction  # never refitted
    assert "| 4096 | 2 | - | n=2: 0.250" in storage.read_text(str(tmp_path / "REPORT.md"))


def test_a_report_without_counts_says_it_cannot_be_rebuilt(tmp_path):
    (tmp_path / "REPORT.md").write_text("# old\n")
    assert report_tables.report_folders(str(tmp_path)) == [str(tmp_path)]
    assert "no counts.json" in report_tables.regenerate(str(tmp_path))


def test_a_pope_arm_that_guides_few_contexts_is_stated_as_a_defect_not_a_result():
    # Issue 43: the restating arm found a prefix for 66 of 254 hard problems and trained the
    # rest unguided (pope.unsolved=unguided): 66 x 1 guided of 254 x 2 contexts = 0.13.
    from jaxprefix.rl.scoring import RolloutRequest, Scored, reward_metrics
    from jaxprefix.run_setup.study_arms import RUNS
    from jaxprefix.run_setup.study_settings import ReportSettings, guided_design
    from jaxprefix.studies.study_tables import Row

    config = run_config.from_file(os.path.join(ROOT, "configs", "results.py"), "eps")
    config.pope.unsolved = "unguided"
    design = guided_design(config, RUNS["pope_restating_hint"])
    expected = guided_share.guided_share({"pope_problems": 66}, design, 254)
    assert expected["share"] == 66 / 508 and not expected["counted"] and expected["defect"]
    assert guided_share.guided_share({"pope_problems": 251},
                                     guided_design(config, RUNS["pope_value_hint"]),
                                     254)["defect"] is False  # 0.494 >= 0.45
    assert guided_design(config, RUNS["grpo_matched_hints"]) is None
    assert guided_share.guided_share({"pope_problems": 251}, None, 254) is None
    # Counted in training: the loop logs each step's contexts on both sides of the tag.
    guided = np.array([True, False, False, False])
    request = RolloutRequest([[1]] * 4, [None] * 4, {"guided": guided}, n=2)
    metrics = reward_metrics(Scored(request, None, np.zeros((4, 2)), 0, 0.0, 0.0))
    assert (metrics["contexts/guided"], metrics["contexts/unguided"]) == (1.0, 3.0)
    counted = guided_share.guided_share(
        {"pope_problems": 254, "guided_contexts": 1, "contexts": 4}, design, 254)
    assert counted["counted"] and counted["share"] == 0.25 and counted["defect"]
    assert "1 of 4 training contexts" in guided_share.share_sentence(counted)
    # The report's rows say so wherever the arm appears.
    row = Row("pope_restating_hint", [{"pope_problems": 66, "seed": 0}])
    [marked] = guided_share.marked_rows([row], ReportSettings.from_config(config, RUNS).designs,
                                        254)
    assert marked.label == "pope_restating_hint (defect: 0.13 guided)"


def _rebuilt_in_a_copy(tmp_path, folder: str) -> tuple[str, str]:
    """(the committed REPORT.md, the one rebuilt in a copy of the folder from its records)."""
    import shutil

    source = os.path.join(ROOT, "docs", "results", folder)
    copy = tmp_path / folder.replace("/", "_")
    shutil.copytree(source, copy)
    report_tables.regenerate(str(copy))
    return (storage.read_text(os.path.join(source, "REPORT.md")),
            storage.read_text(str(copy / "REPORT.md")))


def test_every_committed_report_rebuilds_byte_for_byte_from_its_records(tmp_path):
    for folder in ("tools", "isocompute", "prefixrl", "prefixrl_hard", "prefixrl_hard8", "pope",
                   "overlap", "pope_eps/taught0", "pope_eps/taught0.01", "pope_eps/taught0.05",
                   "pope_eps/taught0.2"):
        committed, rebuilt = _rebuilt_in_a_copy(tmp_path, folder)
        assert rebuilt == committed, folder


def test_a_difference_is_called_a_tie_only_inside_the_registered_margin():
    from jaxprefix.studies.study_tables import verdict

    assert verdict(0.01, 0.2, 0.05) == "higher" and verdict(-0.3, -0.02) == "lower"
    assert verdict(-0.04, 0.03, 0.05) == "tie, within ±0.05"
    assert verdict(0.0, 0.0, 0.05) == "identical"
    # No margin stated before the runs: never a tie. Wider than the margin and holding 0: not a
    # tie, and what it could have seen is stated (1.43 x the half-width: 80% power, 5%).
    assert verdict(-0.04, 0.03) == "not distinguishable; detectable ≥ 0.05"
    assert verdict(-0.29, 0.22, 0.05) == "not distinguishable; detectable ≥ 0.36"


def test_prefixrl_regime_rules_choose_the_length_from_the_measured_rates():
    """'hard' (issue 43): the shortest length whose base pass@16 is at most 0.02, a rate above
    0 (rejection sampling must find traces); 'middle': the rate closest in log to the target.
    The rates are the 2026-12 study's probe (32 x 32 samples a length)."""
    from jaxprefix.jobs.results import choose_length, regime_target

    rates = {8: 0.0117, 10: 0.0068, 12: 0.0, 14: 0.00098, 16: 0.00098, 18: 0.0}
    config = run_config.from_file(os.path.join(ROOT, "configs", "results.py"), "carry")
    target, words = regime_target(config)
    assert config.results.regime.rule == "hard" and "at most 0.02" in words
    assert target == pytest.approx(1 - 0.98 ** (1 / 16))  # ~1.26e-3
    assert choose_length(rates, "hard", target) == 14
    assert choose_length(rates, "middle", 1 / (16 * 512) ** 0.5) == 8
    assert choose_length({8: 0.0, 10: 0.0}, "hard", target) is None
    # none as hard as the target: the hardest measured, never the easiest (issue 43's rerun
    # chose 8 digits at 0.036 when 18 measured 0.002)
    assert choose_length({8: 0.036, 12: 0.006, 18: 0.002, 20: 0.0}, "hard", target) == 18
