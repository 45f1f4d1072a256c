"""Per-token log-probabilities and entropies without materialising [B, T, V] logits.

The unembedding runs over time chunks under lax.map with jax.checkpoint, so forward and
backward hold one [B, chunk, V] slice at a time (full SmolLM2 logits at B=8, T=640 took 21 GiB).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprefix.models.decoder import Decoder, unembed


def token_logprobs(model: Decoder, tokens, mask, *, positions=None, chunk_size: int = 128,
                   temperature: float = 1.0, routes=None, router_load: bool = False) -> tuple:
    """(logprobs [B, T], entropy [B, T]) of tokens[:, t] given tokens[:, :t].

    Column 0, and any column whose token or predecessor is masked out, gets 0. Both are of the
    tempered distribution softmax(logits / temperature): the one a sampler at that temperature
    draws from. Differentiable with respect to model. `routes` (a MoE) replays recorded
    experts (Decoder.hidden); `router_load` (a MoE) appends the sparse layers' router load
    [sparse layers, 2, E] (moe.router_load) for the load-balancing loss.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    mask = jnp.asarray(mask, bool)
    b, t = tokens.shape
    h = model.hidden(tokens, positions, mask, routes, router_load=router_load)
    h, load = h if router_load else (h, None)
    # Hidden state at t-1 predicts token t.
    h, targets = h[:, :-1], tokens[:, 1:]
    valid = mask[:, 1:] & mask[:, :-1]
    n = t - 1
    chunk = max(1, min(chunk_size, n))
    chunks = -(-n // chunk)
    pad = chunks * chunk - n
    h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    h = h.reshape(b, chunks, chunk, -1).swapaxes(0, 1)
    targets = targets.reshape(b, chunks, chunk).swapaxes(0, 1)
    w = model.unembedding()

    @jax.checkpoint
    def score(w, h, y):
        logits = unembed(h, w, model.config) / temperature
        logz = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0] - logz
        p = jax.nn.softmax(logits, axis=-1)
        entropy = logz - jnp.sum(p * logits, axis=-1)
        return logp, entropy

    logp, entropy = jax.lax.map(lambda xs: score(w, *xs), (h, targets))
    logp = logp.swapaxes(0, 1).reshape(b, -1)[:, :n]
    entropy = entropy.swapaxes(0, 1).reshape(b, -1)[:, :n]
    zero = jnp.zeros((b, 1), jnp.float32)
    logp = jnp.concatenate([zero, jnp.where(valid, logp, 0.0)], axis=1)
    entropy = jnp.concatenate([zero, jnp.where(valid, entropy, 0.0)], axis=1)
    return (logp, entropy, load) if router_load else (logp, entropy)
