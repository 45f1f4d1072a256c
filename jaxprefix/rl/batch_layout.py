"""How a step's rows are laid into micro-batches for the update: arranged [minibatches,
micro-batches, micro], sorted within each minibatch (rows with a signal first, then by length),
and each micro-batch computed at the shortest width that holds its rows, or not at all where no
row of it has a non-zero advantage. Each is a permutation or a cut of padding: the gradient of a
minibatch, a sum over its rows, is unchanged.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def arrange(x, num_minibatches: int, num_micro: int, micro: int):
    """[B, ...] -> [minibatches, micro-batches, micro, ...], rows strided over micro-batches so
    that a contiguous block of rows (one device's shard) feeds every micro-batch."""
    x = x.reshape((micro, num_minibatches, num_micro) + x.shape[1:])
    return jnp.moveaxis(x, 0, 2)


def trim_widths(width: int, steps: int) -> tuple[int, ...]:
    """The widths a micro-batch of a `width`-token batch may be cut to: `steps` equal steps of
    it, each a multiple of 8 tokens and at least 16 (a narrow batch gets fewer)."""
    step = max(16, -(-width // (steps * 8)) * 8)
    return tuple(range(step, width, step)) + (width,)


def _row_lengths(token_mask):
    """Tokens up to and including each row's last real one (rows are left-aligned)."""
    columns = jnp.arange(1, token_mask.shape[-1] + 1)
    return jnp.max(jnp.where(token_mask, columns, 0), axis=-1)


def _row_has_signal(rows) -> jax.Array:
    """Per row: whether any of its loss tokens has a non-zero advantage (advantages per row or
    per token)."""
    mask, advantages = rows["completion_mask"], rows["advantages"]
    advantages = advantages.reshape(advantages.shape + (1,) * (mask.ndim - advantages.ndim))
    return jnp.any((advantages != 0) & (mask > 0), axis=-1)


def has_signal(micro) -> jax.Array:
    """Whether any loss token of the micro-batch has a non-zero advantage."""
    return jnp.any(_row_has_signal(micro))


def sort_rows(arranged, *, by_length: bool, by_signal: bool):
    """Each minibatch's rows [micro-batches, micro, ...] sorted, rows with a non-zero advantage
    first (`by_signal`: the rest fill micro-batches that need not be computed), then by length
    (`by_length`: a micro-batch holds rows of like length and its padding can be cut)."""
    width = arranged["token_mask"].shape[-1]
    key = jnp.zeros(arranged["token_mask"].shape[:3], jnp.int32)
    if by_length:
        key = _row_lengths(arranged["token_mask"])          # [minibatches, micro-batches, micro]
    if by_signal:
        key = key + ~_row_has_signal(arranged) * (width + 1)   # after every row with a signal
    flat = lambda x: x.reshape((x.shape[0], -1) + x.shape[3:])
    order = jnp.argsort(flat(key), axis=1, stable=True)
    take = jax.vmap(lambda x, o: x[o])
    return jax.tree.map(lambda x: take(flat(x), order).reshape(x.shape), arranged)


def at_shortest_width(fn, widths, params, rest, micro, totals):
    """fn(params, rest, micro, totals) with `micro` cut to the shortest of `widths` that holds
    every row's last real token. What is cut is padding after each row: masked, never attended
    to (causal), and its log-probs are 0, so the result is fn's on the whole width."""
    full = micro["tokens"].shape[-1]
    if len(widths) == 1:
        return fn(params, rest, micro, totals)

    def at(width, params, rest, micro, totals):
        cut = {k: v[:, :width] if v.ndim >= 2 and v.shape[1] == full else v
               for k, v in micro.items()}
        return fn(params, rest, cut, totals)

    need = jnp.max(_row_lengths(micro["token_mask"]))
    branch = jnp.searchsorted(jnp.asarray(widths), need)   # the first width >= need
    return jax.lax.switch(branch, [functools.partial(at, w) for w in widths],
                          params, rest, micro, totals)
