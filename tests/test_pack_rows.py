"""Packed rows (train.pack_rows, rl/batch_layout.pack): several rows one after another in a row
of the batch width, kept apart by their positions, take the step of the unpacked update."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxprefix.models import attention, backend, blockwise_attention
from jaxprefix.models.attention import packed_positions
from jaxprefix.models.config import FULL, SLIDING
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.scoring import token_logprobs
from jaxprefix.rl import batch_layout
from jaxprefix.rl.train_config import TrainConfig
from jaxprefix.rl.train_step import Learner
from test_long_attention import compare, qkv
from test_train_step import (CONFIG, ONE_MINIBATCH, ROWS, assert_same_step, params_of,
                             ragged_batch, tiny_model, with_old_logprobs)


def packed_row_positions(lengths, width):
    """One row's positions: sequences of `lengths` one after another, then padding (-1)."""
    within = np.concatenate([np.arange(n) for n in lengths])
    sequence = np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])
    pad = width - len(within)
    return packed_positions(jnp.asarray(np.r_[within, np.full(pad, -1)], jnp.int32),
                            jnp.asarray(np.r_[sequence, np.zeros(pad, int)], jnp.int32))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_packed_row_scores_each_sequence_as_alone(family):
    """Two sequences in one row, the second at positions 0.. of its own, carrying its index in
    the positions' high bits: each token's log-prob is the one it has alone in a row (no token
    sees the other sequence; RoPE reads the position within the sequence; Gemma 3's sliding
    window counts within it)."""
    config = CONFIG if family == "llama" else dataclasses.replace(
        CONFIG, model_type="gemma3_text", sliding_window=4, layer_types=(SLIDING, FULL),
        tie_word_embeddings=True)
    model = Decoder(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    a, b = (rng.integers(1, CONFIG.vocab_size, n).astype(np.int32) for n in (7, 5))
    alone = [np.asarray(token_logprobs(model, x[None], np.ones((1, len(x)), bool))[0])[0]
             for x in (a, b)]
    tokens = np.concatenate([a, b, [0, 0]])[None]
    mask = tokens > 0
    mask[0, :12] = True
    positions = packed_row_positions([7, 5], 14)[None]
    packed = np.asarray(token_logprobs(model, tokens, mask, positions=positions)[0])[0]
    np.testing.assert_allclose(packed[1:7], alone[0][1:], atol=1e-5)
    np.testing.assert_allclose(packed[8:12], alone[1][1:], atol=1e-5)


@pytest.mark.parametrize("kernel", ["blockwise", "splash"])
def test_attention_keeps_packed_sequences_apart(kernel):
    """The no-cache attention kernels (blockwise here, the TPU splash kernel in interpret mode,
    whose segment ids come from the sequences) see what the position masks see on packed rows,
    forward and gradient: rows of 3, 2 and 1 sequences and padding."""
    t, h, hkv, dh = 256, 4, 2, 128
    q_pos = jnp.stack([packed_row_positions(n, t) for n in ([100, 120, 30], [200, 40], [180])]
                      + [packed_row_positions([256], t)])
    q, k, v = qkv(np.random.default_rng(4), jnp.float32, t=t, h=h, hkv=hkv, dh=dh)
    kw = dict(scale=dh ** -0.5, logit_cap=None)
    ref = lambda q, k, v: attention.attend(q, q_pos, [(k, v, q_pos)], **kw)
    if kernel == "splash":
        new = lambda q, k, v: backend.splash_attend(q, k, v, q_pos, interpret=True, **kw)
    else:
        new = lambda q, k, v: blockwise_attention.attend(q, q_pos, [(k, v, q_pos)], block_q=64,
                                                         block_k=64, **kw)
    compare(ref, new, (q, k, v), q_pos, jnp.float32)


def test_pack_moves_rows_whole_first_fit_and_leaves_the_rest_empty():
    batch = ragged_batch(width=64)
    batch["advantages"][[0, 5]] = 0.0
    arranged = jax.tree.map(lambda x: batch_layout.arrange(jnp.asarray(x), 1, 4, 4), batch)
    for signal_only in (False, True):
        packed = jax.vmap(lambda m: batch_layout.pack(m, signal_only=signal_only))(arranged)
        rows = jax.tree.map(lambda x: np.asarray(x).reshape((ROWS,) + x.shape[3:]), packed)
        kept = [r for r in range(ROWS) if not (signal_only and r in (0, 5))]
        # every kept row's tokens, log-probs and advantage appear once, in one piece, in order
        assert rows["token_mask"].sum() == batch["token_mask"][kept].sum()
        sequences = rows["positions"] >> 20
        found = 0
        for r in kept:
            length = batch["token_mask"][r].sum()
            hits = [(i, j) for i in range(ROWS) for j in range(64 - length + 1)
                    if rows["token_mask"][i, j] and (rows["positions"][i, j] & 0xFFFFF) == 0
                    and np.array_equal(rows["tokens"][i, j:j + length],
                                       batch["tokens"][r, :length])
                    and np.all(rows["advantages"][i, j:j + length] == batch["advantages"][r])]
            assert hits, r
            i, j = hits[0]
            assert np.all(sequences[i, j:j + length] == sequences[i, j])
            found += 1
        assert found == len(kept)
        filled = rows["token_mask"].any(-1)
        assert filled.sum() < ROWS and not filled[filled.argmin():].any()  # filled rows first


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize("skip", [True, False])
def test_packed_rows_take_the_same_step(aggregation, skip):
    """Packing (and leaving out the rows without a signal) changes no loss, gradient or weight:
    over two minibatches of ragged rows, some with advantage 0; fewer micro-batches computed.
    The ratio diagnostics are the same where every row is packed (rows left out leave them)."""
    config = dataclasses.replace(ONE_MINIBATCH, aggregation=aggregation, num_minibatches=2,
                                 micro_batch_size=2, skip_zero_advantage=skip)
    packed, plain = (Learner(tiny_model(), dataclasses.replace(config, pack_rows=on))
                     for on in (True, False))
    state = plain.init_state()
    batch = ragged_batch()
    batch["advantages"][[0, 2, 9]] = 0.0
    batch = with_old_logprobs(batch, plain, state, noise=0.1)
    plain_state, expected = plain.update(state, batch)
    packed_state, metrics = packed.update(packed.init_state(), batch)
    assert_same_step(packed_state, metrics, plain_state, expected,
                     ("loss", "grad_norm") + (() if skip else ("ratio/first_max_abs_dev",
                                                                "entropy")))
    assert float(metrics["update/computed_share"]) < float(expected["update/computed_share"])


def test_packing_refuses_losses_that_weigh_rows():
    with pytest.raises(ValueError, match="pack_rows=True: expected False with ratio='sequence'"):
        TrainConfig(pack_rows=True, ratio="sequence")
    with pytest.raises(ValueError, match="pack_rows=True: expected False with aggregation="):
        TrainConfig(pack_rows=True, aggregation="seq_mean_token_mean")
    with pytest.raises(ValueError, match="a minibatch of 2048 rows; expected fewer than 2048"):
        TrainConfig(pack_rows=True).check_batch(2048)


def test_a_packed_update_leaves_the_weights_alone_when_no_row_has_a_signal():
    learner = Learner(tiny_model(), dataclasses.replace(ONE_MINIBATCH, pack_rows=True))
    batch = ragged_batch()
    batch["advantages"][:] = 0.0
    state = learner.init_state()
    before = params_of(state)
    state, metrics = learner.update(state, with_old_logprobs(batch, learner, state))
    assert float(metrics["update/computed_share"]) == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(params_of(state), before))
