"""Teacher-forced probes of a policy on a built-in task's oracle solutions: how likely each step is.

A sampled estimate of a rate near 1e-5 needs ~1e5 samples a point; the probability the policy
puts on the oracle's tokens is exact from one forward pass. On keyed_multiplication (POPE's
study, docs/results/pope/PREDICTIONS.md) the quantities the predictions name are:

- `key_step` (eps): P(a right key step | the question), summed over every key marker the
  verifier accepts (with the restating notation a key step may name either rule: '<' with the
  right digits counts as '>' does);
- `key_name` (a): P(the oracle's marker | the question), the rule's name on a hard problem;
- `key_digits` (rho): P(the right d c | the question and the oracle's marker);
- `success`: P(a right key step, then every carry step's digits right), each carry step along
  the oracle's digits (its notation as the oracle writes it; the digits are what is judged):
  the unguided per-sample success rate, without sampling;
- `carry_given_key`: `success` / `key_step`, success given a right key step, weighted by how
  the policy writes it (under either name, with the notation);
- `step_accuracy`: the fraction of steps whose digits are all the argmax.

Each is a mean over problems of a per-problem probability.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprefix import models


@nnx.jit
def greedy_tokens(model, tokens, real):
    """The argmax token at every position (position t predicts token t + 1)."""
    return jnp.argmax(model(tokens, mask=real), axis=-1)


@nnx.jit
def token_probabilities(model, tokens, real):
    """P(token t | tokens before t) at every position t >= 1 (position 0 gets 1), as the
    learner scores them (models.token_logprobs)."""
    return jnp.exp(models.token_logprobs(model, tokens, real)[0])


def forced_rows(problems, solutions, tokenizer, task) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, real mask), [rows, task.SEQUENCE_LENGTH]: question + solution + <eos> per row."""
    tokens = np.full((len(problems), task.SEQUENCE_LENGTH), tokenizer.pad_id, np.int32)
    for i, (problem, solution) in enumerate(zip(problems, solutions)):
        ids = task.training_ids(problem, solution, tokenizer)[0]
        tokens[i, :len(ids)] = ids
    return tokens, tokens != tokenizer.pad_id


@dataclasses.dataclass(frozen=True)
class KeyStepProbe:
    key_step: float
    key_name: float
    key_digits: float
    carry_given_key: float
    success: float
    step_accuracy: float

    def metrics(self, prefix: str = "probe/") -> dict[str, float]:
        return {f"{prefix}{k}": v for k, v in dataclasses.asdict(self).items()}


def steps(model, problems, solutions, tokenizer, task):
    """Per row, along `solutions`: P(the key step's marker), P(its digits | the marker),
    P(every carry step's digits | the key step); and the fraction of steps whose digits are all
    the argmax."""
    tokens, real = forced_rows(problems, solutions, tokenizer, task)
    probabilities = np.asarray(token_probabilities(model, tokens, real))
    predicted = np.asarray(greedy_tokens(model, tokens, real))
    name, digits, carry, right = [], [], [], []
    for i, problem in enumerate(problems):
        spans = task.answer_digit_spans(problem)  # the key's d c, then each carry step's
        step_probability = [np.prod(probabilities[i, a:b]) for a, b in spans]
        name.append(probabilities[i, spans[0][0] - 1])
        digits.append(step_probability[0])
        carry.append(np.prod(step_probability[1:]))
        # logits at position t predict token t + 1
        right += [bool((predicted[i, a - 1:b - 1] == tokens[i, a:b]).all()) for a, b in spans]
    return np.asarray(name), np.asarray(digits), np.asarray(carry), float(np.mean(right))


def probe(model, problems, tokenizer, task) -> KeyStepProbe:
    """The teacher-forced key-step probe of `model` on `problems` (module docstring)."""
    if not problems:
        raise ValueError("key_step_probe: no problems to probe")
    name, digits, carry, accuracy = steps(model, problems, [p.solution for p in problems],
                                           tokenizer, task)
    key_step, success = name * digits, name * digits * carry
    # Every other marker the verifier accepts: the same solution with it in the oracle's place.
    accepted = getattr(task, "key_markers", lambda p: (p.solution[0],))
    for other in sorted({m for p in problems for m in accepted(p)}):
        rows = [i for i, p in enumerate(problems)
                if other in accepted(p) and other != p.solution[0]]
        if rows:
            n, d, c, _ = steps(model, [problems[i] for i in rows],
                                [other + problems[i].solution[1:] for i in rows], tokenizer, task)
            key_step[rows] += n * d
            success[rows] += n * d * c
    return KeyStepProbe(
        key_step=float(key_step.mean()), key_name=float(name.mean()),
        key_digits=float(digits.mean()), success=float(success.mean()),
        carry_given_key=float(success.mean() / max(key_step.mean(), 1e-30)),
        step_accuracy=accuracy)
