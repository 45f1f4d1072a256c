"""Per-token log-probabilities and entropies without materialising [B, T, V] logits.

The unembedding runs over time chunks under lax.map with jax.checkpoint, so forward and
backward hold one [B, chunk, V] slice at a time (full SmolLM2 logits at B=8, T=640 took 21 GiB).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprefix.models.decoder import Decoder, unembed


def token_logprobs(model: Decoder, tokens, mask, *, positions=None, chunk_size: int = 128,
                   temperature: float = 1.0, routes=None, router_load: bool = False,
                   wanted=None) -> tuple:
    """(logprobs [B, T], entropy [B, T]) of tokens[:, t] given tokens[:, :t].

    Column 0, and any column whose token or predecessor is masked out, gets 0. Both are of the
    tempered distribution softmax(logits / temperature): the one a sampler at that temperature
    draws from. Differentiable with respect to model. `routes` (a MoE) replays recorded
    experts (Decoder.hidden); `router_load` (a MoE) appends the sparse layers' router load
    [sparse layers, 2, E] (moe.router_load) for the load-balancing loss. `wanted` (bool
    [B, T]): only those columns are computed, the rest get 0 (`_wanted_only`).
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    mask = jnp.asarray(mask, bool)
    b, t = tokens.shape
    h = model.hidden(tokens, positions, mask, routes, router_load=router_load)
    h, load = h if router_load else (h, None)
    # Hidden state at t-1 predicts token t.
    h, targets = h[:, :-1], tokens[:, 1:]
    valid = mask[:, 1:] & mask[:, :-1]
    if wanted is not None:
        logp, entropy = _wanted_only(model, h, targets, valid & jnp.asarray(wanted, bool)[:, 1:],
                                     chunk_size, temperature)
        return (logp, entropy, load) if router_load else (logp, entropy)
    n = t - 1
    chunk = max(1, min(chunk_size, n))
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(b, chunks, chunk, -1).swapaxes(0, 1)
    targets = targets.reshape(b, chunks, chunk).swapaxes(0, 1)
    w, score = model.unembedding(), _scorer(model, temperature)
    logp, entropy = jax.lax.map(lambda xs: score(w, *xs), (h, targets))
    logp = logp.swapaxes(0, 1).reshape(b, -1)[:, :n]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    logp = jnp.concatenate([zero, jnp.where(valid, logp, 0.0)], axis=1)
    entropy = jnp.concatenate([zero, jnp.where(valid, entropy, 0.0)], axis=1)
    return (logp, entropy, load) if router_load else (logp, entropy)


def _scorer(model: Decoder, temperature: float):
    """(logp, entropy) of targets y from hidden states h (any leading shape) through the
    unembedding w, rematerialised: a backward holds one chunk's [..., V] logits at a time."""
    @jax.checkpoint
    def score(w, h, y):
        logits = unembed(h, w, model.config) / temperature
        logz = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0] - logz
        entropy = logz - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
        return logp, entropy
    return score


def _wanted_only(model: Decoder, h, targets, wanted, chunk_size: int, temperature: float):
    """token_logprobs' (logprobs, entropy) [B, T] at the `wanted` columns alone [B, T - 1]
    (shifted: column t predicts token t + 1), 0 elsewhere. The unembedding is a quarter of a
    small model's per-token cost (SmolLM2: 28M of its 135M weights), and a learner needs it only
    at the loss tokens, a third of a batch's columns or fewer (prompts, padding): the wanted
    columns are gathered to the front, scored chunk by chunk, and the chunks past the last
    wanted one are not computed (lax.cond)."""
    b, n, d = h.shape
    flat = wanted.reshape(-1)
    order = jnp.argsort(~flat, stable=True)          # the wanted columns first
    count = flat.sum()
    chunk = max(1, min(chunk_size, b * n))
    chunks = -(-(b * n) // chunk)
    pad = chunks * chunk - b * n
    order = jnp.pad(order, (0, pad))                  # padding re-reads column 0, never kept
    hs = h.reshape(b * n, d)[order].reshape(chunks, chunk, d)
    ys = targets.reshape(-1)[order].reshape(chunks, chunk)
    w, score = model.unembedding(), _scorer(model, temperature)

    # Rematerialised as a whole: a cond's residuals are its outputs, so without this the
    # unembedding w would be kept once per chunk for the backward (the paper variant's update
    # then needed 20 GiB more a chip); as checkpoint inputs, w is one loop-invariant residual.
    @jax.checkpoint
    def one(xs):
        i, h, y = xs
        zeros = jnp.zeros((chunk,), jnp.float32)
        return jax.lax.cond(i * chunk < count, lambda: score(w, h, y), lambda: (zeros, zeros))

    logp, entropy = jax.lax.map(one, (jnp.arange(chunks), hs, ys))
    kept = (jnp.arange(chunks * chunk) < count)
    put = lambda x: jnp.zeros(b * n + 1, jnp.float32).at[jnp.where(kept, order, b * n)].set(
        x.reshape(-1))[:-1].reshape(b, n)
    zero = jnp.zeros((b, 1), jnp.float32)
    return (jnp.concatenate([zero, put(logp)], axis=1),
            jnp.concatenate([zero, put(entropy)], axis=1))
