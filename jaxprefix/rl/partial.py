"""Partial rollouts (rollout.partial_tokens = S > 0; Kimi k1.5's): a step does not wait for its
longest rollouts.

Each sampling round gives every row at most S new tokens. A group (a context's n rows) whose
rows have not all ended (a stop id, or rollout.max_new_tokens in all) is carried. A step draws
the method's request (two at the run's first step, so that one is always in flight), then
continues every unfinished row, S tokens a round, until it has a batch of ended groups
(contexts_per_step, oldest first) and every group carried into it has ended; what is left goes
into the next step. So the long tails of one step's groups decode beside the next request's
first tokens, in the same rounds, instead of the device waiting on them alone.

A continued row's tokens so far end its context, prefilled again by the weights sampling then
(its KV recomputed, not kept), so the next tokens are drawn as those weights draw after that
prefix; every token keeps the log-prob of the weights that drew it, so the learner's ratio
stays exact per token, and `Scored.versions` counts the tokens each version drew (the staleness
metrics are per token). The bound: a group carried into a step ends in it (it is continued
until it does), so no token is more than one step older than its step's own.

A batch's groups are scored when it is taken, each trained once. `Carry` holds the
groups between steps; it travels in the checkpoint (`state`/`restore`), so a resumed run
continues them. The method's `observe` sees the groups its step trains on.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Sequence

import numpy as np

from jaxprefix import sampling
from jaxprefix.rl import overlap
from jaxprefix.rl.scoring import RolloutRequest, Scored, completion_texts, score_rollouts


@dataclasses.dataclass
class Group:
    """One context's n rows, sampled over one or more rounds."""
    context: Any                 # a sampling Context (token ids or a SharedContext)
    problem: Any
    tags: dict                   # tag name -> this context's value
    response_prefix: str
    tokens: list                 # per row: its own tokens so far (a sampled stop token included)
    logprobs: list
    stopped: list                # per row: its last token is a stop id
    versions: dict               # {weights version: tokens it drew}
    carried: int = 0             # steps it has been carried into

    def unfinished(self, max_new_tokens: int) -> list[int]:
        """Its rows that neither stopped nor reached max_new_tokens."""
        return [j for j, (s, t) in enumerate(zip(self.stopped, self.tokens))
                if not s and len(t) < max_new_tokens]

    def ended(self, max_new_tokens: int) -> bool:
        return not self.unfinished(max_new_tokens)


def _row_parts(rollouts: sampling.Rollouts, row: int) -> tuple[list, list]:
    start, length = rollouts.context_lengths[row], rollouts.lengths[row]
    return (rollouts.tokens[row, start:start + length].tolist(),
            rollouts.logprobs[row, start:start + length].tolist())


def new_groups(request: RolloutRequest, rollouts: sampling.Rollouts, version: int) -> list[Group]:
    """The request's groups after their first round."""
    groups = []
    for c, context in enumerate(request.contexts):
        rows = range(c * request.n, (c + 1) * request.n)
        parts = [_row_parts(rollouts, row) for row in rows]
        groups.append(Group(
            context, request.problems[c], {k: v[c] for k, v in request.tags.items()},
            request.response_prefixes[c] if request.response_prefixes else "",
            [p[0] for p in parts], [p[1] for p in parts],
            [bool(rollouts.stopped[row]) for row in rows],
            {version: int(sum(len(p[0]) for p in parts))}))
    return groups


def continue_rows(groups: Sequence[Group], sample: Callable, version: int,
                  max_new_tokens: int) -> tuple[int, int]:
    """One more round of every unfinished row of `groups`: `sample(contexts)` draws up to S
    tokens after each (a context: the group's, then the row's tokens so far; one sample each).
    Returns (tokens prefilled, tokens drawn)."""
    rows = [(g, j) for g in groups for j in g.unfinished(max_new_tokens)]
    if not rows:
        return 0, 0
    contexts = [sampling.token_ids(g.context) + g.tokens[j] for g, j in rows]
    rollouts = sample(contexts)
    drawn = 0
    for row, (g, j) in enumerate(rows):
        tokens, logprobs = _row_parts(rollouts, row)
        room = max_new_tokens - len(g.tokens[j])
        g.stopped[j] = bool(rollouts.stopped[row]) and len(tokens) <= room
        tokens, logprobs = tokens[:room], logprobs[:room]
        g.tokens[j] += tokens
        g.logprobs[j] += logprobs
        g.versions[version] = g.versions.get(version, 0) + len(tokens)
        drawn += len(tokens)
    return sum(map(len, contexts)), drawn


def as_request(groups: Sequence[Group], n: int) -> RolloutRequest:
    prefixes = [g.response_prefix for g in groups]
    tags = {k: np.asarray([g.tags[k] for g in groups]) for k in (groups[0].tags if groups else {})}
    return RolloutRequest([g.context for g in groups], [g.problem for g in groups], tags, n,
                          prefixes if any(prefixes) else None)


def as_rollouts(groups: Sequence[Group], n: int) -> sampling.Rollouts:
    rows = [(g, j) for g in groups for j in range(n)]
    width = max((len(g.tokens[j]) for g, j in rows), default=1) or 1
    completions = np.zeros((len(rows), width), np.int32)
    logprobs = np.zeros((len(rows), width), np.float32)
    for row, (g, j) in enumerate(rows):
        completions[row, :len(g.tokens[j])] = g.tokens[j]
        logprobs[row, :len(g.tokens[j])] = g.logprobs[j]
    return sampling.Rollouts.from_parts(
        [sampling.token_ids(g.context) for g in groups], completions, logprobs,
        np.asarray([len(g.tokens[j]) for g, j in rows]), [g.stopped[j] for g, j in rows], n)


class Carry:
    """The groups sampled but not yet trained (unfinished, or ended past a step's batch), in the
    order they were first sampled; see the module docstring."""

    def __init__(self, partial_tokens: int, max_new_tokens: int):
        self.partial_tokens, self.max_new_tokens = partial_tokens, max_new_tokens
        self.groups: list[Group] = []

    def step(self, next_request: Callable[[], RolloutRequest], *, sample: Callable, tokenizer,
             scoring, version: int, seed: Callable[[int], int]) -> Scored:
        """The step's batch: as many ended groups as a request has contexts, oldest first, as
        one Scored (its `figures`: partial/*). next_request() -> the method's next request;
        sample(contexts, n, seed) -> Rollouts of up to S new tokens each; seed(round) -> the
        round's seed."""
        start = time.perf_counter()
        for g in self.groups:
            g.carried += 1
        # With nothing carried (the run's first step) two requests: one to train on now, one
        # in flight, so every later step trains the groups the step before it drew.
        requests = [next_request() for _ in range(1 if self.groups else 2)]
        prefilled = generated = 0
        for i, request in enumerate(requests):
            fresh = sample(request.contexts, request.n, seed(i))
            prefilled += int(fresh.context_lengths.sum())
            generated += int(fresh.lengths.sum())
            self.groups += new_groups(request, fresh, version)
        target, n, rounds = len(requests[0].contexts), requests[0].n, len(requests)
        # Continue while the batch is short, or a carried group has not ended (the bound).
        while (sum(g.ended(self.max_new_tokens) for g in self.groups) < target
               or any(g.carried and not g.ended(self.max_new_tokens) for g in self.groups)):
            more = continue_rows(self.groups, lambda c: sample(c, 1, seed(rounds)), version,
                                 self.max_new_tokens)
            prefilled, generated, rounds = prefilled + more[0], generated + more[1], rounds + 1
        batch = [g for g in self.groups if g.ended(self.max_new_tokens)][:target]
        taken = {id(g) for g in batch}
        self.groups = [g for g in self.groups if id(g) not in taken]
        sampled = time.perf_counter()
        batch_request, rollouts = as_request(batch, n), as_rollouts(batch, n)
        texts = completion_texts(tokenizer, rollouts, batch_request.response_prefixes)
        rewards, failures, too_long = score_rollouts(batch_request, rollouts, scoring, texts)
        versions = dict(sum((collections.Counter(g.versions) for g in batch),
                            collections.Counter()))
        figures = {"partial/rounds": rounds,
                   "partial/carried_groups_trained": sum(g.carried > 0 for g in batch),
                   "partial/groups_left": len(self.groups),
                   "partial/rows_left_unfinished": sum(
                       len(g.unfinished(self.max_new_tokens)) for g in self.groups)}
        return Scored(batch_request, rollouts, rewards, failures, sampled - start,
                      time.perf_counter() - sampled, too_long, prefilled, generated,
                      versions=versions, figures=figures)

    def state(self) -> str:
        """The groups left, as checkpoint metadata (pickled, as the steps in flight are)."""
        return overlap.encode_in_flight(self.groups)

    def restore(self, text: str | None) -> None:
        self.groups = overlap.decode_in_flight(text)
