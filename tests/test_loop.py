"""The RL loop and its pieces: metrics files, dynamic sampling, validation, resume, preemption.

The loop runs for real on a tiny random decoder over the demo task's character vocabulary. Its
reward is a registered verifier of this file (share of '+' characters in the completion): a
random policy earns varied rewards with it, so the groups carry signal and updates move weights.
"""
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxprefix import rewards, run_config
from jaxprefix.checkpoints.train_state import TrainCheckpointer
from jaxprefix.data.tasks import carry_multiplication as task
from jaxprefix.methods.grpo import GrpoMethod
from jaxprefix.methods.prompting import TaskPrompts
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.sharding import make_mesh
from jaxprefix.rl import dynamic_sampling as ds
from jaxprefix.rl.eval_counts import EvalCountsWriter, read_eval_counts
from jaxprefix.rl.loop import train
from jaxprefix.rl.scoring import RolloutRequest
from jaxprefix.run_setup.learner_settings import loop_settings, validate
from jaxprefix.rl.compute_ledger import sampling_flops, update_flops
from jaxprefix.rl.metrics import MetricsWriter, count_params, read_metrics
from jaxprefix.sampling import Rollouts, RolloutSpec

TIMING = ("time/", "throughput/")


def plus_share(text, problem):
    """A toy reward: share of '+' in the completion (problems whose id ends in 7 always get 1)."""
    if problem.id.endswith("7"):
        return 1.0
    return text.count("+") / max(len(text), 1)


rewards.register("test_plus_share", plus_share, in_process=True)
TOKENIZER = task.tokenizer()
MODEL = ModelConfig(model_type="llama", vocab_size=TOKENIZER.vocab_size, hidden_size=32,
                    intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                    head_dim=8, tie_word_embeddings=True)
PROBLEMS = task.generate(16, digits=(1, 3), seed=0)


def run_settings(total_steps=3, **train):
    c = run_config.base_config()
    c.data.verifier = "test_plus_share"
    c.rollout.update(n=4, max_new_tokens=8)
    c.train.update(problems_per_step=4, total_steps=total_steps, learning_rate=1e-2, **train)
    c.eval.update(every=2, n=4, ks=(1, 4))
    c.checkpoint.update(every=1, keep=5)
    return c


class SignalAt(GrpoMethod):
    """GRPO that sends itself `signum` when asked for the batch of step `at` (a preemption)."""

    def __init__(self, *args, at=None, signum=signal.SIGTERM, **kw):
        super().__init__(*args, **kw)
        self.at, self.signum = at, signum

    def next_request(self, step):
        if step == self.at:
            os.kill(os.getpid(), self.signum)
        return super().next_request(step)


def resolved(config) -> dict:
    """What train takes of a GRPO config, resolved once (as run_settings.resolve does)."""
    return dict(learner_config=validate(config), rollout=RolloutSpec.from_config(config.rollout, training=True),
                contexts_per_step=config.train.problems_per_step)


def run(workdir, config, at=None, signum=signal.SIGTERM):
    method = SignalAt(TaskPrompts(TOKENIZER), PROBLEMS[:12], problems_per_step=4, n=4, seed=0,
                      eval_problems=PROBLEMS[12:], eval_n=4, at=at, signum=signum)
    return train(loop_settings(config), str(workdir), method=method,
                 model=Decoder(MODEL, rngs=nnx.Rngs(0)),
                 tokenizer=TOKENIZER, stop_ids=(TOKENIZER.eos_id,), progress=False,
                 **resolved(config))


def params_of(result):
    return [np.asarray(x) for x in jax.tree.leaves(result["state"].params)]


def without_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in records]


# --- metrics --------------------------------------------------------------------------------

def test_metrics_writer_jsonl_tensorboard_and_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(str(tmp_path), enabled=True)
    for step in (1, 2, 3):
        writer.write(step, {"loss": np.float32(step / 10), "reward/mean": step, "nan": float("nan")})
    writer.close()
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[1] == {"step": 2, "loss": pytest.approx(0.2), "reward/mean": 2, "nan": None}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("reward/mean")] == [1.0, 2.0, 3.0]
    # A run resumed from step 2 rewrites step 2 onward.
    MetricsWriter(str(tmp_path), resume_step=2, enabled=True).close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]


def test_a_resumed_run_shows_each_step_once_in_tensorboard(tmp_path):
    """A process killed after logging steps 2 and 3 but before their checkpoint: the resumed
    run logs them again, and TensorBoard keeps only the new ones (not two points a step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(str(tmp_path), enabled=True)
    for step in (1, 2, 3):
        writer.write(step, {"reward/mean": step})
    writer.close()
    resumed = MetricsWriter(str(tmp_path), resume_step=2, enabled=True)
    for step in (2, 3, 4):
        resumed.write(step, {"reward/mean": 10 * step})
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [
        (1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]


def test_metrics_segments_bound_each_flush_and_read_back_whole(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    workdir = str(tmp_path)
    writer = MetricsWriter(workdir, enabled=True, segment_rows=3)
    for step in range(1, 11):
        writer.write(step, {"loss": step / 10})
        # A flush rewrites at most 3 rows, however many steps came before.
        assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) <= 3
    writer.close()
    assert sorted(os.listdir(tmp_path / "metrics")) == [
        "000000001.jsonl", "000000004.jsonl", "000000007.jsonl"]
    assert [r["step"] for r in read_metrics(workdir)] == list(range(1, 11))
    events = sorted(os.listdir(tmp_path / "tensorboard"))
    assert len(events) == 4  # 3 + 3 + 3 + 1 events
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("loss")] == list(range(1, 11))

    # Resumed from step 5: the segment of steps 4-6 and the ones after it go, 1-4 stay readable.
    MetricsWriter(workdir, resume_step=5, enabled=True, segment_rows=3).close()
    assert [r["step"] for r in read_metrics(workdir)] == [1, 2, 3, 4]
    assert os.listdir(tmp_path / "metrics") == ["000000001.jsonl"]
    resumed = MetricsWriter(workdir, resume_step=5, enabled=True, segment_rows=3)
    for step in range(5, 9):
        resumed.write(step, {"loss": -step})
    resumed.close()
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows[-1]["loss"] == -8


def test_metrics_of_a_workdir_from_before_segments_stay_readable_and_resume(tmp_path):
    lines = [json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("".join(lines))  # one file of all rows
    assert [r["step"] for r in read_metrics(str(tmp_path))] == list(range(1, 8))
    writer = MetricsWriter(str(tmp_path), resume_step=6, enabled=True, segment_rows=3)
    writer.write(6, {"loss": 60})
    writer.write(7, {"loss": 70})
    writer.close()
    assert [r["loss"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4, 5, 60, 70]
    assert os.listdir(tmp_path / "metrics") == ["000000001.jsonl"]  # the 5 old rows, sealed


def test_eval_counts_are_sealed_like_metrics_and_resume_per_request(tmp_path):
    workdir = str(tmp_path)
    writer = EvalCountsWriter(workdir, segment_rows=4)
    for step in range(1, 6):  # two requests a step: a flush rewrites at most 4 + 2 rows
        writer.write(step, {"eval": (4, [step, 0]), "hard": (4, [0, step])})
        assert len((tmp_path / "eval_counts.jsonl").read_text().splitlines()) <= 6
    assert sorted(os.listdir(tmp_path / "eval_counts")) == ["000000001.jsonl", "000000003.jsonl"]
    rows = read_eval_counts(workdir)
    assert [(r["step"], r["name"]) for r in rows] == [
        (s, name) for s in range(1, 6) for name in ("eval", "hard")]
    # Resumed at step 4: rows of steps 1-3 stay, the segment of 3-4 goes once they are rewritten.
    resumed = EvalCountsWriter(workdir, segment_rows=4, resume_step=4)
    resumed.write(4, {"eval": (4, [9, 9])})
    assert [(r["step"], r["name"]) for r in read_eval_counts(workdir)] == [
        (1, "eval"), (1, "hard"), (2, "eval"), (2, "hard"), (3, "eval"), (3, "hard"), (4, "eval")]
    assert read_eval_counts(workdir)[-1]["correct_counts"] == [9, 9]
    assert os.listdir(tmp_path / "eval_counts") == ["000000001.jsonl"]


def test_flops_formulas():
    assert sampling_flops(1000, 7) == 14_000  # 2 N D
    assert update_flops(1000, 7) == 42_000    # 6 N D
    assert count_params({"w": np.zeros((3, 4)), "b": [np.zeros(5)]}) == 17


# --- dynamic sampling ----------------------------------------------------------------------

def rollouts(contexts, completions, n=2):
    lengths = np.array([len(c) for c in completions])
    width = max(lengths)
    comp = np.array([c + [0] * (width - len(c)) for c in completions], np.int32)
    logp = -np.arange(1, comp.size + 1, dtype=np.float32).reshape(comp.shape) / 10
    return Rollouts.from_parts(contexts, comp, logp, lengths, lengths < 3, n)


def test_select_groups_prefers_informative_groups():
    first = np.array([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    second = np.array([[0.5, 0.0], [1.0, 1.0]])
    assert ds.needs_refill([first], 2, 0, max_refills=1)
    assert not ds.needs_refill([first], 2, 1, max_refills=1)      # cap reached
    assert not ds.needs_refill([first, second], 2, 1, max_refills=3)  # full
    sel = ds.select_groups([first, second], 3)
    assert sel.picks == [(0, 1), (1, 0), (0, 0)]  # two informative, then a filler
    np.testing.assert_array_equal(sel.trainable, [True, True, False])
    assert sel.zero_variance_fraction == pytest.approx(3 / 5)
    kept = ds.select_groups([first], 3, drop_zero_variance=False)
    assert kept.picks == [(0, 0), (0, 1), (0, 2)] and kept.trainable.all()


def test_build_batch_layout_and_masks():
    # Context 0 = [5, 6]: samples [7, 8, 9] (truncated: length 3) and [7] (stopped).
    # Context 1 = [4]: samples [3, 3] and [2] (both stopped).
    chunk = rollouts([[5, 6], [4]], [[7, 8, 9], [7], [3, 3], [2]])
    advantages = np.array([[1.0, -1.0], [0.5, -0.5]])
    sel = ds.GroupSelection(picks=[(0, 1), (0, 0)], trainable=np.array([True, False]),
                            zero_variance_fraction=0.0)
    batch = ds.build_batch([chunk], [advantages], sel, mask_truncated=True)
    assert batch["tokens"].shape == (4, 16)  # width bucketed to the 16 minimum
    np.testing.assert_array_equal(batch["tokens"][0, :4], [4, 3, 3, 0])
    np.testing.assert_array_equal(batch["tokens"][2, :6], [5, 6, 7, 8, 9, 0])
    np.testing.assert_array_equal(batch["completion_mask"][0, :4], [0, 1, 1, 0])
    np.testing.assert_array_equal(batch["completion_mask"][2:].sum(), 0)  # filler group
    np.testing.assert_array_equal(batch["token_mask"][1, :3], [True, True, False])
    np.testing.assert_array_equal(batch["positions"][2, :6], [0, 1, 2, 3, 4, 0])
    np.testing.assert_allclose(batch["advantages"], [0.5, -0.5, 1.0, -1.0])
    np.testing.assert_allclose(batch["old_logprobs"][1, 1], chunk.logprobs[3, 1])
    # Truncated completions lose their loss only when asked to.
    both = ds.GroupSelection(picks=[(0, 0)], trainable=np.array([True]), zero_variance_fraction=0)
    assert ds.build_batch([chunk], [advantages], both, mask_truncated=True)[
        "completion_mask"][0].sum() == 0
    assert ds.build_batch([chunk], [advantages], both)["completion_mask"][0].sum() == 3


# --- validation ----------------------------------------------------------------------------

def test_invalid_settings_fail_naming_the_field():
    c = run_settings()
    c.rollout.n = 1
    with pytest.raises(ValueError, match="config.rollout.n=1"):
        validate(c)
    c = run_settings(eps_high=-0.1)
    with pytest.raises(ValueError, match="config.train.eps_high"):
        validate(c)
    c = run_settings(advantage="ppo")
    with pytest.raises(ValueError, match="config.train.advantage"):
        validate(c)
    c = run_settings()
    c.train.problems_per_step = 3  # 3 x 4 rows over 8 batch devices
    with pytest.raises(ValueError, match="problems_per_step=3.*mesh"):
        validate(c, make_mesh(data=8))
    validate(run_settings(), make_mesh(data=8))  # 4 x 4 rows: fine
    with pytest.raises(ValueError, match="config.train.tis_cap=2.0: expected 0 unless"):
        validate(run_settings(tis_cap=2.0))  # TIS against the sampler's own log-probs is a no-op
    with pytest.raises(ValueError, match=r"config.train.ratio_mask=0.5: expected 0 \(off\) or > 1"):
        validate(run_settings(old_logprobs="learner", ratio_mask=0.5))


def test_request_checks_lengths():
    with pytest.raises(ValueError, match="tag 'guided'"):
        RolloutRequest(contexts=[[1], [2]], problems=PROBLEMS[:2],
                       tags={"guided": np.zeros(3, bool)}, n=2)


# --- the loop end to end -------------------------------------------------------------------

def test_resumed_run_equals_uninterrupted_run(tmp_path):
    straight = run(tmp_path / "straight", run_settings(total_steps=3))
    first = run(tmp_path / "resumed", run_settings(total_steps=2))
    assert first["step"] == 2
    resumed = run(tmp_path / "resumed", run_settings(total_steps=3))
    assert resumed["step"] == 3 and not resumed["preempted"]
    for a, b in zip(params_of(straight), params_of(resumed)):
        np.testing.assert_array_equal(a, b)
    records = read_metrics(str(tmp_path / "straight"))
    assert without_timing(read_metrics(str(tmp_path / "resumed"))) == without_timing(records)
    assert [r["step"] for r in records] == [1, 2, 3]
    for key in ("reward/mean", "reward/unguided", "loss", "grad_norm", "entropy", "lr",
                "clip_frac/low", "ratio/mean", "dynamic/zero_variance_fraction", "flops/total",
                "time/sampling", "time/reward", "time/update", "throughput/tokens_per_s",
                "time/compile", "time/compiled_programs", "time/cached_programs"):
        assert key in records[0], key
    assert records[0]["time/compiled_programs"] > 0  # the first step compiles the update
    assert "eval/pass@1" in records[1] and "eval/pass@4" in records[2]  # every 2 and at the end
    assert records[0]["ratio/first_max_abs_dev"] < 1e-3  # sampler and learner agree
    assert records[2]["updates"] == 3
    assert any(np.abs(a - b).max() > 0 for a, b in
               zip(params_of(straight), [np.asarray(x) for x in
                                         jax.tree.leaves(nnx.state(Decoder(MODEL), nnx.Param))]))
    assert os.listdir(tmp_path / "straight" / "tensorboard")
    assert TrainCheckpointer(str(tmp_path / "straight" / "checkpoints")).all_steps() == [1, 2, 3]


def test_evaluation_before_the_first_step_and_greedy_is_step_0_and_kept_on_resume(tmp_path):
    config = run_settings(total_steps=2)
    config.eval.update(before_train=True, greedy=True)
    run(tmp_path, config)
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [0, 1, 2]
    assert "reward/mean" not in records[0]  # no step was trained
    for record in (records[0], records[2]):  # before the first step and at the end
        assert 0 <= record["eval/pass@1"] <= 1 and 0 <= record["eval_greedy/accuracy"] <= 1
        assert {"eval/full_reward", "eval_greedy/full_reward", "eval_greedy/reward_mean"} <= set(record)
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")  # drawn at each eval
    counts = [(r["step"], r["name"], r["n"]) for r in read_eval_counts(str(tmp_path))]
    assert counts[:2] == [(0, "eval", 4), (0, "eval_greedy", 1)]
    config.train.total_steps = 3  # resumed at step 2: step 0 stays once
    run(tmp_path, config)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]


def test_sigterm_saves_a_restorable_checkpoint_and_returns(tmp_path):
    result = run(tmp_path, run_settings(total_steps=5), at=1)
    assert result["preempted"] and result["step"] == 2  # step 1 finishes, then saves
    assert TrainCheckpointer(str(tmp_path / "checkpoints")).latest_step() == 2
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    resumed = run(tmp_path, run_settings(total_steps=3))
    assert resumed["step"] == 3 and [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def _truncate_an_array_file(checkpoint_dir) -> str:
    """Cuts one array data file of a checkpoint to 10 bytes (a disk error, a copy cut short)."""
    data = sorted(os.path.join(d, f) for d, _, files in os.walk(checkpoint_dir / "arrays")
                  for f in files if os.sep + "d" + os.sep in os.path.join(d, f) + os.sep
                  or os.path.basename(d) == "d")
    os.truncate(data[0], 10)
    return data[0]


def test_truncated_latest_checkpoint_falls_back_to_the_one_before_and_ends_the_same(tmp_path):
    straight = run(tmp_path / "straight", run_settings(total_steps=4))
    run(tmp_path / "resumed", run_settings(total_steps=3))
    _truncate_an_array_file(tmp_path / "resumed" / "checkpoints" / "3")
    resumed = run(tmp_path / "resumed", run_settings(total_steps=4))  # used to fail every time
    for a, b in zip(params_of(straight), params_of(resumed)):
        np.testing.assert_array_equal(a, b)
    assert (without_timing(read_metrics(str(tmp_path / "resumed")))
            == without_timing(read_metrics(str(tmp_path / "straight"))))
    aside = os.listdir(tmp_path / "resumed" / "checkpoints.unrestorable")
    assert len(aside) == 1 and aside[0].startswith("3-")  # moved, not deleted
    assert TrainCheckpointer(str(tmp_path / "resumed" / "checkpoints")).all_steps() == [1, 2, 3, 4]


def test_no_restorable_checkpoint_stops_with_one_message(tmp_path):
    from jaxprefix.errors import CheckpointError

    run(tmp_path, run_settings(total_steps=2))
    for step in ("1", "2"):
        _truncate_an_array_file(tmp_path / "checkpoints" / step)
    with pytest.raises(CheckpointError, match=r"no checkpoint under .* restores: step 2 .*; step 1 "):
        run(tmp_path, run_settings(total_steps=3))
    assert sorted(os.listdir(tmp_path / "checkpoints.unrestorable"))[0].startswith("1-")


def test_checkpoint_of_another_model_is_refused_by_shape_and_left_in_place(tmp_path):
    from jaxprefix.errors import CheckpointError

    run(tmp_path, run_settings(total_steps=1))
    method = GrpoMethod(TaskPrompts(TOKENIZER), PROBLEMS[:12], problems_per_step=4, n=4, seed=0,
                        eval_problems=PROBLEMS[12:], eval_n=4)
    wider = MODEL.replace(hidden_size=64, head_dim=16)
    with pytest.raises(CheckpointError, match=r"checkpoints/1: array .* was saved with shape "
                                              r".*32.*, this run's model has .*64"):
        config = run_settings(total_steps=2)
        train(loop_settings(config), str(tmp_path), method=method,
              model=Decoder(wider, rngs=nnx.Rngs(0)),
              tokenizer=TOKENIZER, progress=False, **resolved(config))
    assert TrainCheckpointer(str(tmp_path / "checkpoints")).all_steps() == [1]


def test_learner_old_logprobs_log_the_mismatch_and_cost_a_forward(tmp_path):
    run(tmp_path, run_settings(total_steps=1, old_logprobs="learner", tis_cap=2.0))
    [record] = read_metrics(str(tmp_path))
    # An f32 sampler and learner at the same weights: the gap is rounding, and TIS weighs ~1.
    assert 0 <= record["rollout/logprob_mismatch_mean"] <= record["rollout/logprob_mismatch_max"]
    assert record["rollout/logprob_mismatch_max"] < 1e-3
    assert abs(record["tis/weight_mean"] - 1) < 1e-3 and record["tis/capped_fraction"] == 0
    # The update is a forward and a backward (6 N per token) plus the recompute's forward (2 N).
    per_token = record["flops/update"] / record["tokens/trained"]
    assert per_token == pytest.approx(8 * count_params(nnx.state(Decoder(MODEL), nnx.Param)))


def test_dynamic_sampling_refills_zero_variance_groups(tmp_path):
    # Problems whose id ends in 7 always score 1: their groups carry no signal.
    config = run_settings(total_steps=1, dynamic_sampling=True, max_refill_rounds=2)
    run(tmp_path, config)
    [record] = read_metrics(str(tmp_path))
    constant = sum(p.id.endswith("7") for p in PROBLEMS[:12])
    assert constant > 0
    assert record["dynamic/zero_variance_fraction"] > 0
    assert record["dynamic/refill_rounds"] >= 1
    assert record["dynamic/trainable_groups"] == 4


# --- SIGKILL mid-run (subprocess) -----------------------------------------------------------

@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_same_params_and_metrics(tmp_path):
    def launch(workdir, steps, kill_at=-1):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root}
        return subprocess.run([sys.executable, __file__, str(workdir), str(steps), str(kill_at)],
                              cwd=root, env=env, timeout=600).returncode

    assert launch(tmp_path / "straight", 4) == 0
    # The run SIGKILLs itself when asked for step 3's batch, possibly mid-way through writing
    # step 3's checkpoint: no handler runs, nothing is flushed.
    assert launch(tmp_path / "killed", 4, kill_at=3) == -signal.SIGKILL
    assert TrainCheckpointer(str(tmp_path / "killed" / "checkpoints")).latest_step() in (2, 3)
    assert launch(tmp_path / "killed", 4) == 0
    straight = np.load(tmp_path / "straight" / "params.npz")
    resumed = np.load(tmp_path / "killed" / "params.npz")
    for key in straight:
        np.testing.assert_array_equal(straight[key], resumed[key])
    assert (without_timing(read_metrics(str(tmp_path / "killed")))
            == without_timing(read_metrics(str(tmp_path / "straight"))))


if __name__ == "__main__":  # the SIGKILL test's subprocess: test_loop.py WORKDIR STEPS KILL_AT
    workdir, steps, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = run(workdir, run_settings(total_steps=steps), at=kill_at, signum=signal.SIGKILL)
    np.savez(os.path.join(workdir, "params.npz"),
             **{str(i): x for i, x in enumerate(params_of(out))})
