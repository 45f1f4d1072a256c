"""Sampling ahead of the learner (train.max_staleness, rollout.devices): rl/overlap.py and the
loop's use of it, on the tiny policy of test_loop (its task, reward and method)."""
import signal
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from jaxprefix.models.decoder import Decoder
from jaxprefix.models.sharding import shard_model, split_meshes
from jaxprefix.rl import overlap
from jaxprefix.rl.loop import train
from jaxprefix.run_setup.learner_settings import loop_settings
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.rl.overlap import AheadSampler, SamplerFailed, sampling_version

from test_loop import (MODEL, PROBLEMS, TOKENIZER, SignalAt, params_of, resolved, run_settings,
                       without_timing)
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prompting import TaskPrompts


def test_each_step_is_sampled_with_its_version_never_more_than_k_ahead():
    published = []  # versions published so far, as the thread sees them
    seen = []

    def sample(policy, step):
        seen.append((step, policy, max(published)))
        return [f"rollouts of {step}"]

    sampler = AheadSampler(sample, max_staleness=2, start=0, total=6)
    try:
        for step in range(6):
            published.append(step)
            sampler.publish(step, policy=step)  # the weights of version `step` are `step`
            got, _ = sampler.take(step)
            assert (got.step, got.version, got.chunks) == (step, max(0, step - 2),
                                                           [f"rollouts of {step}"])
    finally:
        sampler.close()
    assert [(s, v) for s, v, _ in seen] == [(t, max(0, t - 2)) for t in range(6)]
    assert all(s - newest <= 2 for s, _, newest in seen)  # at most k ahead of the learner
    assert sampling_version(7, 2, start=6) == 6  # a resume without rollouts in flight


def test_settle_waits_for_what_the_weights_allow_and_a_resume_continues_from_it():
    release = threading.Event()

    def sample(policy, step):
        release.wait()
        return [step]

    sampler = AheadSampler(sample, max_staleness=2, start=0, total=10)
    sampler.publish(0, "v0")
    release.set()
    held = sampler.settle()  # steps 0, 1, 2 need version 0: all sampled before it returns
    sampler.close()
    assert [(s.step, s.version) for s in held] == [(0, 0), (1, 0), (2, 0)]
    again = AheadSampler(sample, max_staleness=2, start=1,  total=10,
                         in_flight=overlap.decode_in_flight(overlap.encode_in_flight(held[1:])))
    again.publish(1, "v1")
    try:
        assert again.take(1)[0].chunks == [1] and again.take(3)[0].version == 1
    finally:
        again.close()


def test_live_weights_take_newer_versions_up_to_the_steps_own():
    """rollout.inflight_kv='keep': the thread's policy is a LiveWeights that takes a version
    published while the step samples, never past the step's on-policy one."""
    published = threading.Event()
    seen = {}

    def sample(live, step):
        started = live.version
        if step == 1:
            published.wait()  # the learner publishes version 1 while step 1 is sampled
        took = live.refresh()
        seen[step] = (started, took, live.version, live.model, live.refresh())
        return [step]

    sampler = AheadSampler(sample, max_staleness=1, start=0, total=3, inflight_kv='keep')
    try:
        sampler.publish(0, "v0")
        sampler.take(0)
        sampler.publish(1, "v1")
        published.set()
        sampler.take(1)
        sampler.publish(2, "v2")
        assert sampler.take(2)[0].version == 1
    finally:
        sampler.close()
    assert seen[0] == (0, False, 0, "v0", False)
    assert seen[1] == (0, True, 1, "v1", False)  # version 1 taken mid-step, 2 is not yet due
    assert seen[2][0] == 1 and seen[2][2] <= 2


class _Round:
    def __init__(self, generated, versions=None):
        self.generated, self.versions = generated, versions


def test_staleness_is_per_token_when_newer_weights_took_over():
    sampled = overlap.Sampled(step=3, version=2, chunks=[_Round(20, {2: 30, 3: 10}), _Round(20)],
                              seconds=1.0)
    metrics = overlap.step_metrics(sampled, waited=0.5, publish_seconds=0.1)
    assert metrics["staleness/max"] == 1
    assert metrics["staleness/mean"] == pytest.approx(50 / 60)
    assert metrics["staleness/inflight_share"] == pytest.approx(10 / 60)
    plain = overlap.step_metrics(overlap.Sampled(3, 2, [_Round(8)], 1.0), 0.0, 0.0)
    assert (plain["staleness/max"], plain["staleness/mean"],
            plain["staleness/inflight_share"]) == (1, 1.0, 0.0)


def test_a_sampler_failure_stops_the_learner_in_one_line():
    def sample(policy, step):
        if step == 1:
            raise RuntimeError("out of pages")
        return [step]

    sampler = AheadSampler(sample, max_staleness=1, start=0, total=4)
    sampler.publish(0, "v0")
    try:
        sampler.take(0)
        with pytest.raises(SamplerFailed, match="the sampler stopped at step 1: RuntimeError: "
                                                "out of pages"):
            sampler.take(1)
    finally:
        sampler.close()


def test_split_meshes_give_the_sampler_the_last_devices_and_refuse_taking_all():
    devices = jax.devices()[:4]
    learner, sampler = split_meshes(1, devices=devices)
    assert list(learner.devices.flat) == devices[:3] and list(sampler.devices.flat) == devices[3:]
    assert split_meshes(0, devices=devices)[1] is None
    with pytest.raises(ValueError, match=r"rollout.devices=4: expected fewer than the 4 devices"):
        split_meshes(4, devices=devices)
    with pytest.raises(ValueError, match=r"rollout.devices=1 leaves the learner 3 devices"):
        split_meshes(1, devices=devices, data=2)


def run_split(workdir, config, at=None):
    """test_loop's run, the learner on device 0 and the sampler on device 1."""
    mesh, sampler_mesh = split_meshes(1, devices=jax.devices()[:2])
    method = SignalAt(TaskPrompts(TOKENIZER), PROBLEMS[:12], problems_per_step=4, n=4, seed=0,
                      eval_problems=PROBLEMS[12:], eval_n=4, at=at, signum=signal.SIGTERM)
    model = shard_model(Decoder(MODEL, rngs=nnx.Rngs(0)), mesh)
    return train(loop_settings(config), str(workdir), method=method, model=model,
                 tokenizer=TOKENIZER,
                 stop_ids=(TOKENIZER.eos_id,), progress=False, mesh=mesh,
                 sampler_mesh=sampler_mesh, **resolved(config))


@pytest.mark.slow  # three runs of the tiny policy (~2 min on 2 cores)
def test_one_step_off_on_its_own_device_resumes_after_sigterm_to_the_same_run(tmp_path):
    straight = run_split(tmp_path / "straight", run_settings(total_steps=4, max_staleness=1))
    records = read_metrics(str(tmp_path / "straight"))
    assert [r["staleness/max"] for r in records] == [0, 1, 1, 1]
    assert records[0]["ratio/first_max_abs_dev"] < 1e-3  # sampled with the weights it trains
    assert records[1]["ratio/first_max_abs_dev"] > 1e-3  # one update behind
    # SIGTERM while the sampler draws step 2's batch, ahead of the learner.
    stopped = run_split(tmp_path / "resumed", run_settings(total_steps=4, max_staleness=1), at=2)
    assert stopped["preempted"]
    resumed = run_split(tmp_path / "resumed", run_settings(total_steps=4, max_staleness=1))
    assert resumed["step"] == 4
    for a, b in zip(params_of(straight), params_of(resumed)):
        np.testing.assert_array_equal(a, b)
    assert (without_timing(read_metrics(str(tmp_path / "resumed")))
            == without_timing(records))


def test_the_synchronous_loop_states_staleness_zero(tmp_path):
    from test_loop import run
    run(tmp_path, run_settings(total_steps=2))
    assert [r["staleness/max"] for r in read_metrics(str(tmp_path))] == [0, 0]


def test_a_sampler_split_the_devices_cannot_hold_is_one_line_before_any_work(tmp_path):
    import os
    import subprocess
    import sys
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    done = subprocess.run([sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
                           f"--workdir={tmp_path}", "--config.train.max_staleness=1",
                           "--config.rollout.devices=1"], capture_output=True, text=True, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "error: config.rollout.devices=1: expected fewer than the 1 devices, the learner needs "
        "the rest (0: shared)")
    assert not (tmp_path / "base").exists()  # refused before the smoke's SFT base was trained


@pytest.mark.parametrize("inflight_kv", ["keep", "recompute"])
def test_weights_into_the_running_decode_state_per_token_staleness_within_the_bound(
        tmp_path, inflight_kv):
    from test_loop import run
    config = run_settings(total_steps=3, max_staleness=1)
    config.rollout.inflight_kv = inflight_kv
    run(tmp_path, config)
    records = read_metrics(str(tmp_path))
    assert records[0]["staleness/max"] == 0
    for r in records:
        assert 0 <= r["staleness/mean"] <= r["staleness/max"] <= 1
        assert 0 <= r["staleness/inflight_share"] <= 1
    synchronous = run_settings(total_steps=3)
    synchronous.rollout.inflight_kv = "keep"
    with pytest.raises(ValueError, match=r"config.rollout.inflight_kv='keep': expected '' with "
                                         r"train.max_staleness=0"):
        resolved(synchronous)


# --- the watchdog: no wait between the two threads is open-ended (issue 70) -----------------

def test_a_stalled_sampler_stops_the_learner_in_one_line_at_the_deadline():
    import contextlib
    import time

    from bounded import returns_within
    release = threading.Event()

    def sample(policy, step):
        if step == 1:
            release.wait(30)  # a step stuck in an environment, a verifier, a collective
        return [step]

    sampler = AheadSampler(sample, max_staleness=1, start=0, total=4, wait_s=0.5)
    try:
        with contextlib.closing(sampler):
            sampler.publish(0, "v0")
            returns_within(10, sampler.take, 0)
            start = time.monotonic()
            with pytest.raises(overlap.WaitedTooLong, match=(
                    r"^the learner waited 0.5 s for step 1's rollouts from the sampler thread "
                    r"\(still sampling step 1\); raise config.train.wait_timeout_s if a step's "
                    r"sampling takes longer$")):
                returns_within(10, sampler.take, 1)
            # settle (a checkpoint) waits for up to max_staleness + 1 steps' sampling
            with pytest.raises(overlap.WaitedTooLong, match=r"waited 1 s for the rollouts to "
                                                            r"checkpoint \(steps through 1\)"):
                returns_within(10, sampler.settle)
        assert time.monotonic() - start < 5  # close() waited the deadline at most, not 30 s
    finally:
        release.set()


def test_a_learner_that_raises_stops_the_sampler_waiting_for_its_weights():
    import contextlib

    sampler = AheadSampler(lambda policy, step: [step], max_staleness=1, start=0, total=8,
                           wait_s=30)
    with pytest.raises(RuntimeError, match="the update failed"):
        with contextlib.closing(sampler):
            sampler.publish(0, "v0")
            sampler.take(0)
            sampler.settle()  # steps 0, 1 sampled; the thread now waits for version 1
            raise RuntimeError("the update failed")
    assert not sampler._thread.is_alive()


def test_a_sampler_waiting_past_its_deadline_for_weights_ends_the_process_in_one_line():
    """The learner never publishes the weights step 3 needs (stuck where no exception reaches
    it): the sampler thread ends the process, exit 1, one `error:` line naming the wait and the
    field. An evaluation longer than the deadline before it is the learner's work, not a stall."""
    import os
    import subprocess
    import sys
    import time

    script = ("import time\n"
              "from jaxprefix.rl.overlap import AheadSampler\n"
              "s = AheadSampler(lambda p, t: [t], max_staleness=1, start=0, total=4, wait_s=1)\n"
              "s.publish(0, 'v0'); s.take(0); s.take(1)\n"
              "with s.evaluating():\n"
              "    time.sleep(2.5)\n"
              "s.publish(1, 'v1'); s.take(2); print('evaluated', flush=True)\n"
              "time.sleep(60)\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert time.monotonic() - start < 30
    assert done.returncode == 1 and done.stdout == "evaluated\n"
    assert done.stderr.strip().splitlines()[-1] == (
        "error: the sampler thread waited 1 s for the weights after 2 updates (the learner's) "
        "to sample step 3; raise config.train.wait_timeout_s if the learner's steps (update, "
        "checkpoint) take longer")


class _FailsOrStallsAt(GrpoMethod):
    """GRPO whose request for step `at` (drawn in the sampler thread) raises, or stalls."""

    def __init__(self, *args, at, stall=False, **kw):
        super().__init__(*args, **kw)
        self.at, self.stall, self.released = at, stall, threading.Event()

    def next_request(self, step):
        if step == self.at:
            if not self.stall:
                raise RuntimeError("the method's data source is gone")
            self.released.wait(60)
        return super().next_request(step)


def _overlapped_run(workdir, method, wait_timeout_s=1800.0):
    from bounded import returns_within
    config = run_settings(total_steps=4, max_staleness=1, wait_timeout_s=wait_timeout_s)
    return returns_within(120, train, loop_settings(config), str(workdir), method=method,
                          model=Decoder(MODEL, rngs=nnx.Rngs(0)), tokenizer=TOKENIZER,
                          stop_ids=(TOKENIZER.eos_id,), progress=False, **resolved(config))


def _committed(workdir):
    from jaxprefix.checkpoints.train_state import TrainCheckpointer
    ckpt = TrainCheckpointer(f"{workdir}/checkpoints")
    try:
        return ckpt.all_steps()
    finally:
        ckpt.close()


def test_a_sampler_thread_that_raises_ends_the_run_with_its_error_and_keeps_its_checkpoint(
        tmp_path):
    method = _FailsOrStallsAt(TaskPrompts(TOKENIZER), PROBLEMS[:12], problems_per_step=4, n=4,
                              seed=0, eval_problems=PROBLEMS[12:], eval_n=4, at=2)
    with pytest.raises(SamplerFailed, match=r"^the sampler stopped at step 2: RuntimeError: the "
                                            r"method's data source is gone$"):
        _overlapped_run(tmp_path, method)
    # Step 1's checkpoint (saved before the sampler reached step 2's request) is the resume point.
    assert max(_committed(tmp_path)) == 1


def test_a_stalled_sampler_ends_the_run_at_train_wait_timeout_s(tmp_path):
    import time

    method = _FailsOrStallsAt(TaskPrompts(TOKENIZER), PROBLEMS[:12], problems_per_step=4, n=4,
                              seed=0, eval_problems=PROBLEMS[12:], eval_n=4, at=2, stall=True)
    try:
        start = time.monotonic()
        # 8 s: step 0's sampling compiles its programs, within the deadline like any step's.
        with pytest.raises(overlap.WaitedTooLong, match=r"^the learner waited 16 s for the "
                                                        r"rollouts to checkpoint .*; raise "
                                                        r"config.train.wait_timeout_s"):
            _overlapped_run(tmp_path, method, wait_timeout_s=8.0)
        assert time.monotonic() - start < 90
        assert max(_committed(tmp_path)) == 1
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    finally:
        method.released.set()
