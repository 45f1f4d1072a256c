"""PrefixRL: on-policy RL on the continuations of successful off-policy traces (arXiv 2601.18795).

Sampling FLOPs already spent are reused: a pool of successful traces, found by rejection sampling
with the base policy (or loaded from another model's JSONL), supplies prefixes. The policy
continues each prefix as its own unfinished answer and is trained on the continuation alone; the
prefix is context, never trained on. Training only on prefixed problems still improves the
unprefixed ones ("back-generalization").

Pipeline:
1. `build_trace_pool`: rounds of k samples for each problem still without a correct trace, until
   one is found or `max_samples` is spent. Every sample is booked in the prober's ledger: the
   papers compare methods at equal compute with this sampling included.
2. `cut_points`: `prefixes_per_problem` cuts at uniform fractions in [lo, hi] of each trace's
   tokens, drawn once per problem from the seed. A trace of tool episodes (its observations
   masked apart) is cut only where the policy writes next (`Trace.can_cut`).
3. `PrefixRLMethod`: each step, B problems from the pool, each as its prefixed contexts and
   `unprefixed_copies` plain ones (3:1 by default).
"""
from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Sequence

import numpy as np

from jaxprefix import storage
from jaxprefix.data.files import read_records
from jaxprefix.data.problem import DataError, Problem
from jaxprefix.errors import need
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prefix_schedules import make_prefix_schedule, schedule_settings
from jaxprefix.methods.probing import Prober
from jaxprefix.methods.method_spec import MethodSpec, register_method
from jaxprefix.methods.prompting import with_response_prefix


@dataclasses.dataclass(frozen=True)
class Trace:
    """A successful answer to one problem: its tokens and how many samples finding it took.

    `sampled`: for a trace of tool episodes, 1 on the tokens the policy sampled and 0 on its
    tools' observations; empty where the policy wrote every token (one turn, or another model's
    text)."""

    problem_id: str
    tokens: tuple
    samples: int
    sampled: tuple = ()

    def __post_init__(self):
        if self.sampled and len(self.sampled) != len(self.tokens):
            raise ValueError(f"trace {self.problem_id}: {len(self.sampled)} sampled flags for "
                             f"{len(self.tokens)} tokens")

    def can_cut(self) -> np.ndarray:
        """bool [len(tokens) + 1]: whether a prefix of that many tokens may be shown, so that the
        policy writes the next token as it did. Any length of a trace of one turn; in a trace of
        tool episodes, one that ends just after an observation (a turn's start) or inside the
        last turn (the answer), never inside an observation, nor inside an earlier turn, whose
        tool call the continuation would cut in two (a turn's call is parsed from its own
        sampled text)."""
        if not self.sampled:
            return np.ones(len(self.tokens) + 1, bool)
        # Past the last token: the stop token the policy writes.
        sampled = np.append(np.asarray(self.sampled, bool), True)
        starts = sampled & ~np.concatenate([[False], sampled[:-1]])
        last = np.flatnonzero(starts)[-1]
        return starts | (sampled & (np.arange(len(sampled)) >= last))

    def prefix(self, length: int) -> tuple:
        """The longest prefix of at most `length` tokens that may be shown (`can_cut`)."""
        allowed = np.flatnonzero(self.can_cut()[:length + 1])
        return self.tokens[:int(allowed[-1]) if len(allowed) else 0]


@dataclasses.dataclass
class TracePool:
    """Successful traces by problem id, and what the search for them cost."""

    traces: dict
    samples_per_problem: dict  # problem id -> samples drawn, found or not

    def save_jsonl(self, path: str, tokenizer) -> None:
        lines = [json.dumps({"id": trace.problem_id, "tokens": list(trace.tokens),
                             "text": tokenizer.decode(list(trace.tokens)),
                             "samples": trace.samples}
                            | ({"sampled": list(trace.sampled)} if trace.sampled else {})) + "\n"
                 for trace in self.traces.values()]
        storage.write_atomic(path, "".join(lines))

    @classmethod
    def load_jsonl(cls, path: str, prompts=None) -> "TracePool":
        """A pool written by `save_jsonl`, or traces from another model: `id` and `text` per record
        (re-tokenised with `prompts.response` when there are no `tokens`; `sampled`, optional,
        masks a tool episode's observations as 0); .jsonl, .json or .parquet."""
        traces = {}
        for location, record in read_records(path):
            if "id" not in record or not ("tokens" in record or "text" in record):
                raise DataError(f"{path}:{location}: expected fields 'id' and 'tokens' or 'text'")
            tokens = record.get("tokens")
            if tokens is None:
                if prompts is None:
                    raise DataError(f"{path}:{location}: text-only trace needs a tokenizer")
                tokens = prompts.response(record["text"])
            sampled = tuple(record.get("sampled") or ())
            if sampled and len(sampled) != len(tokens):
                raise DataError(f"{path}:{location}: field 'sampled' has {len(sampled)} flags "
                                f"for {len(tokens)} tokens; expected one per token")
            traces[str(record["id"])] = Trace(str(record["id"]), tuple(tokens),
                                              int(record.get("samples", 0)), sampled)
        if not traces:
            raise DataError(f"{path}: no traces")
        return cls(traces, {i: t.samples for i, t in traces.items()})


def verified_pool(pool: TracePool, problems: Sequence[Problem], *, verifier: str, decode,
                  timeout_s: float = 10.0) -> tuple[TracePool, dict]:
    """The traces of `pool` that solve their problem by `verifier`, and what was dropped.

    An imported pool (another model's traces) is checked before any RL trains on it: a trace
    whose id names no training problem, or whose text the verifier rejects, is dropped and
    counted, so a wrong or stale file cannot feed the policy wrong prefixes.
    """
    from jaxprefix import rewards

    by_id = {p.id: p for p in problems}
    matched = [t for t in pool.traces.values() if t.problem_id in by_id]
    scores, _ = rewards.score_batch(verifier, [decode(list(t.tokens)) for t in matched],
                                    [by_id[t.problem_id] for t in matched], timeout_s=timeout_s)
    kept = {t.problem_id: t for t, score in zip(matched, scores) if score > 0.5}
    stats = {"traces": len(pool.traces), "kept": len(kept),
             "unknown_problem": len(pool.traces) - len(matched),
             "failed_verification": len(matched) - len(kept)}
    return TracePool(kept, {i: pool.samples_per_problem.get(i, 0) for i in kept}), stats


def oracle_trace_pool(prompts, problems: Sequence[Problem]) -> TracePool:
    """Oracle solutions as the traces: off-policy data that cost no sampling (smoke runs, or
    comparing PrefixRL with POPE on the same privileged information)."""
    traces = {p.id: Trace(p.id, tuple(prompts.response(p.solution)), 0)
              for p in problems if p.solution}
    return TracePool(traces, {i: 0 for i in traces})


def build_trace_pool(prober: Prober, prompts, problems: Sequence[Problem], *,
                     samples_per_round: int, max_samples: int, seed: int) -> TracePool:
    """Rejection sampling: keep the first correct trace per problem, at most `max_samples` each."""
    traces, spent = {}, {p.id: 0 for p in problems}
    pending = list(problems)
    round_index = 0
    while pending:
        result = prober.probe([prompts.question(p) for p in pending], pending, samples_per_round,
                              seed=seed + round_index, keep_successes=True,
                              description=f"trace pool round {round_index + 1}")
        still = []
        for problem, success in zip(pending, result.first_success):
            spent[problem.id] += samples_per_round
            if success is not None:
                success = success.without_stop(prober.stop_ids)
                traces[problem.id] = Trace(problem.id, tuple(success.tokens), spent[problem.id],
                                           tuple(success.sampled) if 0 in success.sampled
                                           else ())
            elif spent[problem.id] + samples_per_round <= max_samples:
                still.append(problem)
        pending = still
        round_index += 1
    return TracePool(traces, spent)


def cut_points(num_tokens: int, count: int, lo: float, hi: float,
               rng: np.random.Generator, can_cut: np.ndarray | None = None) -> list[int]:
    """`count` prefix lengths at uniform fractions in [lo, hi] of a trace of `num_tokens`.

    Each keeps at least one token and leaves at least one to generate; given `can_cut`
    (Trace.can_cut), each moves to the nearest length where a prefix may end (the shorter of
    two as near).
    """
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"prefixrl cut fractions must satisfy 0 <= lo <= hi <= 1, got {lo}, {hi}")
    fractions = rng.uniform(lo, hi, size=count)
    cuts = [int(np.clip(round(f * num_tokens), 1, max(1, num_tokens - 1))) for f in fractions]
    allowed = None if can_cut is None else np.flatnonzero(can_cut[1:num_tokens]) + 1
    if allowed is None or not len(allowed):
        return cuts
    return [int(allowed[np.argmin(np.abs(allowed - cut))]) for cut in cuts]


class PrefixRLMethod(GrpoMethod):
    """Pool problems asked with prefixes of their traces, mixed with unprefixed copies."""

    name = "prefixrl"

    def __init__(self, prompts, problems: Sequence[Problem], pool: TracePool, *, schedule,
                 prefixes_per_problem: int = 3, unprefixed_copies: int = 1,
                 cut_range: tuple = (0.4, 0.8), seed: int, **kwargs):
        in_pool = [p for p in problems if p.id in pool.traces]
        if not in_pool:
            raise ValueError("prefixrl: the trace pool holds no trace for any training problem")
        super().__init__(prompts, in_pool, seed=seed, **kwargs)
        self.pool, self.schedule = pool, schedule
        self.unprefixed_copies = unprefixed_copies
        self.cuts = {}
        for problem in in_pool:
            # Cuts drawn per problem from (seed, id): the same whatever the pool's order.
            rng = np.random.default_rng([seed, zlib.crc32(problem.id.encode())])
            trace = pool.traces[problem.id]
            self.cuts[problem.id] = cut_points(len(trace.tokens), prefixes_per_problem,
                                               *cut_range, rng, trace.can_cut())

    def prefix_tokens(self, problem: Problem, j: int, step: int) -> tuple:
        cut = self.cuts[problem.id][j]
        length = self.schedule.length(f"{problem.id}/{j}", cut, step)
        return self.pool.traces[problem.id].prefix(length)

    def _contexts(self, batch: Sequence[Problem], step: int):
        contexts, problems, guided, prefixes = [], [], [], []
        decode = self.prompts.tokenizer.decode
        for problem in batch:
            for j in range(len(self.cuts[problem.id])):
                prefix = self.prefix_tokens(problem, j, step)
                contexts.append(with_response_prefix(self.prompts, problem, prefix))
                prefixes.append(decode(list(prefix)))
                guided.append(True)
                problems.append(problem)
            contexts.extend([self.prompts.question(problem)] * self.unprefixed_copies)
            prefixes.extend([""] * self.unprefixed_copies)
            guided.extend([False] * self.unprefixed_copies)
            problems.extend([problem] * self.unprefixed_copies)
        return contexts, problems, guided, prefixes

    def observe(self, request, rewards: np.ndarray) -> None:
        keys, rows = [], []
        seen: dict = {}
        for i, (problem, is_prefixed) in enumerate(zip(request.problems, request.tags["guided"])):
            if is_prefixed:
                j = seen.get(problem.id, 0)
                seen[problem.id] = j + 1
                # A batch crossing an epoch boundary may hold a problem twice: its cuts again.
                keys.append(f"{problem.id}/{j % len(self.cuts[problem.id])}")
                rows.append(i)
        self.schedule.observe(keys, rewards[rows])

    def state(self) -> dict:
        return super().state() | {"schedule": self.schedule.state()}

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.schedule.restore(state["schedule"])


@dataclasses.dataclass(frozen=True)
class PrefixRLSettings:
    """The prefixrl block and the prefix-length schedule, checked once (see `from_config`)."""
    cut_range: tuple[float, float] = (0.4, 0.8)  # cut points, as shares of a trace
    prefixes_per_problem: int = 3                # prefixed contexts of a problem
    unprefixed_copies: int = 1                   # and its plain ones
    pool: str = "trace_pool"  # where traces come from: 'trace_pool' (rejection sampling),
    #                           'imported_pool' (prefixrl.pool_path) or 'oracle'
    pool_path: str = ""                          # an imported pool's file
    pool_flops: float = 0.0                      # and its declared generation cost
    samples_per_round: int = 64                  # rejection sampling: samples a round
    max_samples: int = 2500                      # and a problem's most
    schedule: tuple = (("kind", "fixed"),)

    @classmethod
    def from_config(cls, config) -> PrefixRLSettings:
        p = config.prefixrl
        need(0.0 <= p.cut_lo <= p.cut_hi <= 1.0, "config.prefixrl.cut_lo/cut_hi",
             (p.cut_lo, p.cut_hi), "0 <= cut_lo <= cut_hi <= 1")
        pool_path, oracle = p.get("pool_path", ""), p.oracle_traces
        pool = "imported_pool" if pool_path else "oracle" if oracle else "trace_pool"
        return cls((p.cut_lo, p.cut_hi), p.prefixes_per_problem, p.unprefixed_copies, pool,
                   pool_path, float(p.get("pool_flops", 0.0)), p.samples_per_round,
                   p.max_samples, schedule_settings(config))


def _build(settings: PrefixRLSettings, inputs) -> PrefixRLMethod:
    hard = inputs.mining.hard_set()
    return PrefixRLMethod(
        inputs.prompts, hard.problems, inputs.mining.trace_pool(hard.problems, settings),
        schedule=make_prefix_schedule(dict(settings.schedule)),
        prefixes_per_problem=settings.prefixes_per_problem,
        unprefixed_copies=settings.unprefixed_copies, cut_range=settings.cut_range,
        **inputs.common)


register_method(MethodSpec(
    name="prefixrl", settings=PrefixRLSettings.from_config, build=_build,
    blocks=("prefixrl", "schedule"),
    contexts_per_problem=lambda s: s.prefixes_per_problem + s.unprefixed_copies,
    # Another model's traces are billed at their declared cost; the oracle's cost nothing.
    needs=lambda s: ("hard_set",) + ((s.pool,) if s.pool != "oracle" else ()),
    mined_summary=lambda s, mining, hard: {
        "pool": len(mining.trace_pool(hard.problems, s).traces)}))
