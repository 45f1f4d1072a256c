"""The teacher-forced key-step probe against the same probabilities read off the model by hand."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from jaxprefix import key_step_probe, models
from jaxprefix.data.tasks import keyed_multiplication as task
from jaxprefix.run_setup import sft_base
from tests.test_sft import load_config

TOKENIZER = task.tokenizer()
MODEL = models.Decoder(sft_base.model_config(load_config("smoke"), TOKENIZER), rngs=nnx.Rngs(3))


def sequence_probabilities(problem, solution):
    """P(each token of the solution | the question and the tokens before it), by a plain
    forward pass and log-softmax: [len(solution)]."""
    ids = task.training_ids(problem, solution, TOKENIZER)[0]
    logits = MODEL(np.asarray([ids], np.int32), mask=np.ones((1, len(ids)), bool))[0]
    logprobs = jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1)
    start = task.QUESTION_LENGTH
    return np.exp([logprobs[t - 1, ids[t]] for t in range(start, start + len(solution))])


def by_hand(problem):
    """(P(a right key step), P(right key step and every carry step's digits)) summed over the
    markers the verifier accepts, and the oracle marker's P(name) and P(digits | name)."""
    key = success = 0.0
    for marker in task.key_markers(problem):
        p = sequence_probabilities(problem, marker + problem.solution[1:])
        digits = [i for i in range(len(p)) if i % task.STEP_LENGTH]  # each step's two digits
        key += p[0] * p[1] * p[2]
        success += p[0] * np.prod(p[digits])
        if marker == problem.solution[0]:
            name, read = p[0], p[1] * p[2]
    return key, success, name, read


@pytest.mark.parametrize("names_rule", [False, True])
def test_probe_matches_the_probabilities_read_by_hand(names_rule):
    problems = task.hard_set(3, seed=5, names_rule=names_rule)
    probe = key_step_probe.probe(MODEL, problems, TOKENIZER, task)
    key, success, name, read = map(np.mean, zip(*map(by_hand, problems)))
    assert probe.key_step == pytest.approx(key, rel=1e-4)
    assert probe.success == pytest.approx(success, rel=1e-4)
    assert probe.key_name == pytest.approx(name, rel=1e-4)
    assert probe.key_digits == pytest.approx(read, rel=1e-4)
    assert probe.carry_given_key == pytest.approx(success / key, rel=1e-4)
    # Without the notation '*' is the only marker: a right key step is the oracle's.
    assert (probe.key_step > probe.key_name * probe.key_digits) == names_rule
    assert set(probe.metrics()) == {f"probe/{k}" for k in ("key_step", "key_name", "key_digits",
                                                            "carry_given_key", "success",
                                                            "step_accuracy")}


def test_probe_refuses_no_problems():
    with pytest.raises(ValueError, match="no problems"):
        key_step_probe.probe(MODEL, [], TOKENIZER, task)


def test_probe_bases_on_a_base_with_the_restating_notation(tmp_path):
    from jaxprefix.jobs import probe_bases

    config = load_config("smoke")
    config.data.key_names_rule = True
    base = sft_base.train_base(config, str(tmp_path / "named"))
    out = tmp_path / "bases.json"
    probe_bases.main([base, "--out", str(out)])
    (row,) = json.loads(out.read_text())
    assert row["base"] == base and row["chosen_step"] == config.max_steps
    # A hard problem's oracle names '>': the probe's read is the own-'>' way's.
    assert row["key_digits"] == pytest.approx(row["key_digits_own_>"])
    for key, value in row.items():
        if key.startswith(("key_", "carry_", "success")):
            assert 0 <= value <= 1, key
    with pytest.raises(ValueError, match="without data.key_names_rule"):
        probe_bases.probe_base(sft_base.train_base(load_config("smoke"), str(tmp_path / "plain")))
