"""What the sampler records for routing replay (a mixture of experts): each token's experts.

The learner of a MoE replays the experts the sampler chose (Decoder.hidden(routes=)), so that
its log-probs are those of the sampled computation even where the router's top-k is a near-tie
that rounding of another batch shape would flip. The sampler records, per token and sparse
layer, the top-k expert ids (moe.route_dtype: int8 up to 128 experts): the contexts' tokens at
prefill, then at each decode step the token each row feeds (its context's last token first, then
its own tokens; in turns, an appending pass's tokens too: each token's experts are those of the
forward that wrote its KV). A row's last token is never fed, so its experts are never computed:
-1, which the learner reads as "the router's own choice" (that token's output feeds no loss
term).
A dense model records nothing, and its programs are unchanged.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxprefix.models import moe


def recorded(experts: jax.Array, positions: jax.Array, num_experts: int) -> jax.Array:
    """The experts [..., sparse layers, k] of tokens at `positions` [...] as they are kept:
    moe.route_dtype, -1 where there is no token (position -1)."""
    real = (positions >= 0)[..., None, None]
    return jnp.where(real, experts, -1).astype(moe.route_dtype(num_experts))


def empty(config, rows: int, length: int) -> jax.Array:
    """[rows, length, sparse layers, k] of -1: nothing recorded yet."""
    shape = (rows, length, sum(config.sparse_layers), config.num_experts_per_tok)
    return jnp.full(shape, -1, moe.route_dtype(config.num_experts))


def of_contexts(layout, prompt: np.ndarray, suffix: np.ndarray | None) -> list[np.ndarray]:
    """Each context's recorded experts [its length - 1, sparse layers, k] (all its tokens but
    the held-back last one) from a prefill's: `prompt` [C, Sp, ...] (row c: context c's prompt)
    and `suffix` [C, Ss, ...] (None when no context has one), slots in `layout`'s order."""
    out = []
    for c in range(layout.num_contexts):
        parts = [prompt[c][layout.prompt_positions[layout.prompt_index[c]] >= 0]]
        if suffix is not None:
            parts.append(suffix[c][layout.suffix_positions[c] >= 0])
        out.append(np.concatenate(parts))
    return out
