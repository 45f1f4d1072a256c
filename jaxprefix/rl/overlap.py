"""Sampling ahead of the learner: off-policy steps with a staleness bound (train.max_staleness).

With max_staleness = k > 0 a sampler thread samples step t's rollouts with the weights of
version max(0, t - k) (a version counts the updates applied) while the learner updates on
earlier steps' rollouts. The version of each step is a function of the step alone, never of
timing, so a run is reproducible and a resumed run follows the uninterrupted one: at a
checkpoint the sampler is let finish every step the published weights allow (through t + k)
and those rollouts are checkpointed with the method's state (`in_flight`), never resampled.

The thread runs the loop's own step sampler (`sample(policy, step)`: requests, dynamic
sampling, rewards) and is the only caller of the method's next_request/observe while it runs;
JAX dispatches both threads' programs at once, on disjoint devices with rollout.devices > 0.
Every trained token then carries its step's version: the update's ratio uses the behaviour
log-probs the sampler recorded (old_logprobs='sampler'), or corrects towards them
(old_logprobs='learner' with tis_cap / ratio_mask).

Weights into a running decode (rollout.inflight_kv='keep' or 'recompute'): the thread samples
each step with sampling.LiveWeights, so a version published while step t decodes (at most t, the
on-policy one) takes over at the decode's next chunk, the KV written so far kept or computed
again by it. A step's tokens then carry several
versions (Scored.versions), the staleness metrics are per token, and which tokens a version
drew depends on timing: such a run is not reproducible token for token (a resume still
checkpoints what is in flight, as above).
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import logging
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

from jaxprefix import sampling
from jaxprefix.errors import UserError


class SamplerFailed(UserError):
    """The sampler thread raised: the run stops in one line (the traceback is in the log)."""


class WaitedTooLong(UserError):
    """One thread of the overlapped loop waited past config.train.wait_timeout_s for the other."""


WAIT_FIELD = "config.train.wait_timeout_s"


def _stalled_learner(line: str) -> None:
    """The sampler waited past its deadline for the learner's weights: the learner (the main
    thread) is stuck in an update, an evaluation, a checkpoint or a collective, where no
    exception can reach it, so the process ends here, as main ends a run, in one line. Like a
    SIGKILL it leaves the last committed checkpoint as the resume point (bench/kill_resume.py
    shows a kill anywhere resumes to the same run)."""
    logging.error("%s", line)
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    os._exit(1)


def sampling_version(step: int, max_staleness: int, start: int = 0) -> int:
    """The weights' version (updates applied) that samples step `step`'s rollouts, in a run (or
    a resume without rollouts in flight) that starts at step `start`."""
    return max(start, step - max_staleness)


def token_versions(sampled: Sampled) -> dict[int, int]:
    """{weights version: tokens of the step it drew}: the step's own version for every token,
    unless newer weights took over mid-decode (Scored.versions)."""
    counts: dict[int, int] = {}
    for chunk in sampled.chunks:
        for version, tokens in (chunk.versions or {sampled.version: chunk.generated}).items():
            counts[version] = counts.get(version, 0) + tokens
    return counts


def step_metrics(sampled: Sampled, waited: float, publish_seconds: float) -> dict:
    """A step's staleness (per token: updates between the weights that drew it and the step's
    training), the share of its tokens drawn by weights newer than those it started with, and
    the overlap's times: the learner's wait for the rollouts, the seconds spent sampling them,
    and the last copy of new weights to the sampler."""
    counts = token_versions(sampled)
    tokens = sum(counts.values())
    if not tokens:
        counts, tokens = {sampled.version: 1}, 1
    newer = sum(c for v, c in counts.items() if v > sampled.version)
    return {"staleness/max": sampled.step - min(counts),
            "staleness/mean": sum((sampled.step - v) * c for v, c in counts.items()) / tokens,
            "staleness/inflight_share": newer / tokens,
            "time/sampler_wait": waited, "time/sampler_busy": sampled.seconds,
            "time/weights_publish": publish_seconds}


@dataclasses.dataclass
class Sampled:
    step: int
    version: int
    chunks: list          # the loop's Scored rounds of this step
    seconds: float        # wall time the sampler spent on it


class AheadSampler:
    """A thread that samples steps start, start+1, ... < total, each with the weights of its
    version, up to max_staleness steps ahead of the learner.

    sample: (policy, step) -> the step's scored rounds (runs in the thread); with `inflight_kv`
    (rollout.inflight_kv: 'keep' or 'recompute') the policy is a sampling.LiveWeights, which
    takes newer published weights (<= the step's on-policy version) while the step decodes.
    in_flight: steps already sampled (a checkpoint's `in_flight`), taken first.
    wait_s: the deadline of each wait on the other thread (config.train.wait_timeout_s): the
    learner's for a step's rollouts (`take`, `settle`) raises WaitedTooLong past it; the
    thread's for the weights a step needs ends the process in one line (_stalled_learner).
    The learner calls `publish(version, policy)` with the weights after each update (the first
    with the starting weights), `take(step)` for each step's rollouts, and `settle()` before a
    checkpoint.
    """

    def __init__(self, sample: Callable[[Any, int], list], *, max_staleness: int, start: int,
                 total: int, in_flight: list[Sampled] = (), inflight_kv: str = '',
                 wait_s: float = 1800.0):
        self._sample = sample
        self._wait_s = wait_s
        self._stalled = False  # the learner gave up on the thread: close() does not wait for it
        self._evaluating = False  # the learner's own work, not a wait: no deadline runs
        self._heard = time.monotonic()  # the sampler's clock restarts when an evaluation ends
        self._inflight_kv = inflight_kv
        self.max_staleness = max_staleness
        self._total = total
        self._ready = {s.step: s for s in in_flight}
        self._start = start
        self._next = start + len(self._ready)  # the next step the thread samples
        self._policies: dict[int, Any] = {}
        self._working = False
        self._error: BaseException | None = None
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    # --- the learner's side -----------------------------------------------------------------

    def publish(self, version: int, policy) -> None:
        """The sampling weights of `version` (already copied off the learner's donated state);
        versions no step still needs are dropped."""
        with self._cond:
            self._policies[version] = policy
            needed = self._version(self._next)
            for old in [v for v in self._policies if v < needed]:
                del self._policies[old]
            self._cond.notify_all()

    def take(self, step: int) -> tuple[Sampled, float]:
        """(step's rollouts, seconds the learner waited for them)."""
        start = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: step in self._ready or self._error is not None,
                                       timeout=self._wait_s):
                raise self._too_long(f"step {step}'s rollouts")
            if step not in self._ready:
                raise self._failed()
            return self._ready.pop(step), time.perf_counter() - start

    def settle(self) -> list[Sampled]:
        """Waits until the sampler has sampled every step the published weights allow, and
        returns what it holds ahead of the learner (to checkpoint with the method's state,
        which it no longer changes until the next publish)."""
        # Up to max_staleness + 1 steps to sample, each within the deadline.
        deadline = self._wait_s * (self.max_staleness + 1)
        with self._cond:
            if not self._cond.wait_for(lambda: self._error is not None or (
                    not self._working and not self._can_sample()), timeout=deadline):
                raise self._too_long(f"the rollouts to checkpoint (steps through "
                                     f"{self._last_allowed()})", deadline)
            if self._error is not None:
                raise self._failed()
            return [self._ready[s] for s in sorted(self._ready)]

    def _failed(self) -> SamplerFailed:
        return SamplerFailed(f"the sampler stopped at step {self._next}: "
                             f"{type(self._error).__name__}: {self._error}")

    @contextlib.contextmanager
    def evaluating(self):
        """The learner evaluates (its own sampling, as in the synchronous loop, which has no
        deadline either): the sampler's wait for weights is not timed meanwhile, so a long
        held-out evaluation is not taken for a stuck learner."""
        with self._cond:
            self._evaluating = True
        try:
            yield
        finally:
            with self._cond:
                self._evaluating, self._heard = False, time.monotonic()
                self._cond.notify_all()

    def _too_long(self, what: str, waited: float | None = None) -> WaitedTooLong:
        self._stalled = True
        doing = f"sampling step {self._next}" if self._working else "not sampling"
        return WaitedTooLong(f"the learner waited {waited or self._wait_s:g} s for {what} from "
                             f"the sampler thread (still {doing}); raise {WAIT_FIELD} if a "
                             f"step's sampling takes longer")

    def _last_allowed(self) -> int:
        """The last step the published weights let the sampler sample."""
        newest = max(self._policies, default=self._start)
        return min(self._total, newest + self.max_staleness + 1) - 1

    def close(self) -> None:
        """Stops the thread after the step it is sampling, if any; waits for that step at most
        the deadline, and not at all once a wait for it timed out (a step stuck in an
        environment must not hold a run that already failed: the thread is a daemon, and the
        process ends without it)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(0 if self._stalled else self._wait_s)
        if self._thread.is_alive():
            logging.warning("the sampler thread is still sampling step %d after %g s; left "
                            "behind", self._next, self._wait_s)

    # --- the thread -------------------------------------------------------------------------

    def _version(self, step: int) -> int:
        return sampling_version(step, self.max_staleness, self._start)

    def _newer(self, step: int, current: int) -> tuple | None:
        """(the newest published version after `current`, its policy), at most `step` (the
        step's on-policy weights), or None."""
        with self._cond:
            later = [v for v in self._policies if current < v <= step]
            return (max(later), self._policies[max(later)]) if later else None

    def _can_sample(self) -> bool:
        return self._next < self._total and self._version(self._next) in self._policies

    def _waits_for_weights(self) -> bool:
        return not self._stop and self._next < self._total and not self._can_sample()

    def _run(self) -> None:
        while True:
            with self._cond:
                waited = time.monotonic()
                while self._waits_for_weights():
                    # The learner publishes a version per update: none within the deadline
                    # means the learner is stuck (a step with nothing to sample waits freely).
                    if self._evaluating:
                        self._cond.wait()
                        continue
                    left = self._wait_s - (time.monotonic() - max(waited, self._heard))
                    if left <= 0:
                        _stalled_learner(
                            f"the sampler thread waited {self._wait_s:g} s for the weights after "
                            f"{self._version(self._next)} updates (the learner's) to sample step "
                            f"{self._next}; raise "
                            f"{WAIT_FIELD} if the learner's steps (update, checkpoint) "
                            f"take longer")
                        return
                    self._cond.wait(left)
                self._cond.wait_for(lambda: self._stop or self._can_sample())
                if self._stop:
                    return
                step = self._next
                version = self._version(step)
                policy = self._policies[version]
                if self._inflight_kv:
                    policy = sampling.LiveWeights(version, policy,
                                                  functools.partial(self._newer, step),
                                                  kv=self._inflight_kv)
                self._working = True
            start = time.perf_counter()
            try:
                chunks = self._sample(policy, step)
            except BaseException as e:  # noqa: BLE001  (reported to the learner in one line)
                logging.exception("the sampler failed at step %d", step)
                with self._cond:
                    self._error, self._working = e, False
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[step] = Sampled(step, version, chunks, time.perf_counter() - start)
                self._next = step + 1
                self._working = False
                self._cond.notify_all()


def encode_in_flight(sampled: list) -> str:
    """The sampled steps ahead of the learner (or partial rollouts' carried groups) as
    checkpoint metadata (JSON holds text): their rollouts, requests and rewards, pickled. A
    checkpoint is the run's own trusted output."""
    return base64.b64encode(pickle.dumps(sampled, protocol=pickle.HIGHEST_PROTOCOL)).decode()


def decode_in_flight(text: str | None) -> list:
    return pickle.loads(base64.b64decode(text)) if text else []
