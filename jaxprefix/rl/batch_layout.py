"""How a step's rows are laid into micro-batches for the update: arranged [minibatches,
micro-batches, micro], then either packed (several rows one after another in a row of the batch
width, train.pack_rows) or sorted within each minibatch (rows with a signal first, then by
length); each micro-batch computed at the shortest width that holds its rows, or not at all
where no row of it has a non-zero advantage (or, packed, no token). Each is a permutation, a
cut of padding or a move of rows into padding: the gradient of a minibatch, a sum over its
rows, is unchanged.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxprefix.models.attention import packed_positions


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


def has_tokens(micro) -> jax.Array:
    """Whether the micro-batch holds any token (a packed minibatch's last rows may hold none)."""
    return jnp.any(micro["token_mask"])


def pack(minibatch, *, signal_only: bool):
    """A minibatch's rows [micro-batches, micro, W, ...] packed: each row moved, whole, into the
    first row of the minibatch with room for it after the rows already there (first-fit, longest
    rows first), so that its tokens fill what was padding. The result has the same shape, its
    filled rows first and the rest empty (has_tokens: False). Each token keeps its own values;
    per-row advantages become per-token ones; positions carry each row's sequence in its packed
    row (attention.packed_positions), so no row attends to another. `signal_only`: rows without
    a non-zero advantage (no gradient when nothing but the advantage weighs a token) are left
    out. What the loss normalises by is the minibatch's before packing (the caller's totals)."""
    lead = minibatch["token_mask"].shape[:2]
    flat = {k: v.reshape((-1,) + v.shape[2:]) for k, v in minibatch.items()}
    rows, width = flat["token_mask"].shape
    lengths = _row_lengths(flat["token_mask"])
    if signal_only:
        lengths = jnp.where(_row_has_signal(flat), lengths, 0)
    order = jnp.argsort(-lengths, stable=True)

    def place(state, row):  # first-fit: the first packed row with room for this one
        fill, count = state
        length = lengths[row]
        target = jnp.argmax(fill + length <= width)
        placed = (target, fill[target], count[target])
        used = length > 0
        return (fill.at[target].add(jnp.where(used, length, 0)),
                count.at[target].add(used.astype(jnp.int32))), placed

    start = (jnp.zeros(rows, jnp.int32), jnp.zeros(rows, jnp.int32))
    _, (target, offset, sequence) = jax.lax.scan(place, start, order)
    unsort = jnp.argsort(order)
    target, offset, sequence = target[unsort], offset[unsort], sequence[unsort]
    columns = jnp.arange(width)[None, :]
    kept = columns < lengths[:, None]
    # Flat destination of every token; tokens not kept go to one slot past the end, dropped.
    to = jnp.where(kept, target[:, None] * width + offset[:, None] + columns, rows * width)

    def move(x):
        out = jnp.zeros((rows * width + 1,) + x.shape[2:], x.dtype)
        out = out.at[to.reshape(-1)].set(x.reshape((rows * width,) + x.shape[2:]))
        return out[:-1].reshape((rows, width) + x.shape[2:])

    if flat["advantages"].ndim == 1:
        flat["advantages"] = jnp.broadcast_to(flat["advantages"][:, None], (rows, width))
    flat["positions"] = packed_positions(jnp.where(flat["token_mask"], flat["positions"], -1),
                                         jnp.broadcast_to(sequence[:, None], (rows, width)))
    packed = {k: move(v) for k, v in flat.items()}
    packed["positions"] = jnp.where(packed["token_mask"], packed["positions"], 0)
    return jax.tree.map(lambda x: x.reshape(lead + x.shape[1:]), packed)


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
