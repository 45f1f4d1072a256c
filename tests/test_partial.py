"""Partial rollouts (rollout.partial_tokens): rl/partial.py and the loop's use of it, on the tiny
policy of test_loop (its task, reward and method)."""
import numpy as np
import pytest
from flax import nnx

from jaxprefix import sampling
from jaxprefix.methods.prompting import TaskPrompts
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.rl import partial
from jaxprefix.rl.metrics import read_metrics
from jaxprefix.run_setup.learner_settings import loop_settings
from jaxprefix.sampling import SharedContext

from test_loop import (MODEL, PROBLEMS, TOKENIZER, params_of, resolved, run, run_settings,
                       without_timing)


def _request(n=4, contexts=4):
    prompts = TaskPrompts(TOKENIZER)
    problems = PROBLEMS[:contexts]
    ids = [prompts.question(p) for p in problems]
    # one context shared-prompt form, as POPE's guided copies are
    ids[1] = SharedContext(ids[1][:3], ids[1][3:])
    from jaxprefix.rl.scoring import RolloutRequest
    return RolloutRequest(ids, problems, {"guided": np.array([False, True, False, True])}, n)


def test_carried_rows_continue_as_the_weights_draw_after_their_prefix_and_all_end():
    """Rounds of 3 tokens up to 12: each batch holds only ended groups, a carried group ends in
    the step it is carried into, and every token's log-prob is the model's own teacher-forced
    one after the context and the row's earlier tokens (the continuation's context is right)."""
    model = Decoder(MODEL, rngs=nnx.Rngs(0))
    settings = loop_settings(run_settings())
    carry = partial.Carry(partial_tokens=3, max_new_tokens=12)

    def sample(contexts, n, seed):
        return sampling.generate(model, contexts, n=n, max_new_tokens=3, temperature=1.0,
                                 stop_ids=(TOKENIZER.eos_id,), seed=seed)

    carried_trained, left, rounds = 0, [], []
    for step in range(4):
        batch = carry.step(_request, sample=sample, tokenizer=TOKENIZER,
                           scoring=settings.rewards, version=step, seed=lambda r: 100 * step + r)
        r = batch.rollouts
        assert len(batch.request.contexts) == 4 and batch.rewards.shape == (4, 4)
        assert np.all(r.stopped | (r.lengths >= 12))
        assert all(g.carried == 0 for g in carry.groups)  # none carried twice
        assert sum(batch.versions.values()) == int(r.lengths.sum())
        carried_trained += batch.figures["partial/carried_groups_trained"]
        left.append(batch.figures["partial/groups_left"])
        rounds.append(batch.figures["partial/rounds"])
        real = np.arange(r.tokens.shape[1]) < (r.context_lengths + r.lengths)[:, None]
        forced = np.asarray(token_logprobs(model, r.tokens, real, positions=r.positions)[0])
        mask = r.completion_mask.astype(bool)
        np.testing.assert_allclose(r.logprobs[mask], forced[mask], atol=2e-5)
    assert max(rounds) > 2 and carried_trained > 0 and min(left) > 0


def test_a_partial_run_trains_full_batches_and_resumes_to_the_same_run(tmp_path):
    """Carried groups travel in the checkpoint: 2 steps then 2 more equal 4 straight."""
    def config(steps):
        c = run_settings(total_steps=steps)
        c.rollout.partial_tokens = 3
        return c
    straight = run(tmp_path / "straight", config(4))
    records = read_metrics(str(tmp_path / "straight"))
    assert sum(r["partial/carried_groups_trained"] for r in records) > 0
    assert all(r["partial/rounds"] >= 1 for r in records)
    run(tmp_path / "resumed", config(2))
    resumed = run(tmp_path / "resumed", config(4))
    for a, b in zip(params_of(straight), params_of(resumed)):
        np.testing.assert_array_equal(a, b)
    assert without_timing(read_metrics(str(tmp_path / "resumed"))) == without_timing(records)


def test_partial_rollouts_sample_ahead_of_the_learner_and_clash_in_one_line(tmp_path):
    c = run_settings(total_steps=3, max_staleness=1)
    c.rollout.partial_tokens = 3
    run(tmp_path, c)
    for r in read_metrics(str(tmp_path)):
        assert r["staleness/max"] <= 2  # one step off, and a carried group one step older
    clash = run_settings(total_steps=3, max_staleness=1)
    clash.rollout.update(partial_tokens=3, inflight_kv="keep")
    with pytest.raises(ValueError, match=r"config.rollout.partial_tokens=3: expected 0 with "
                                         r"rollout.inflight_kv"):
        resolved(clash)
    too_long = run_settings()
    too_long.rollout.partial_tokens = 8
    with pytest.raises(ValueError, match=r"config.rollout.partial_tokens=8: expected 0 \(off\) "
                                         r"or fewer than rollout.max_new_tokens=8"):
        resolved(too_long)
