"""The static decode: every row of a request in flight at once, one jitted prefill, one jitted loop.

Shared contexts: the C contexts' KV is computed once ([C, S] prefill) and the B = C * n sample
rows attend to it as a read-only `KVSegment` (group-major rows), so neither the prefill compute
nor the context KV is multiplied by n. Each row owns only a `KVCache` of its new tokens. Contexts
given as `SharedContext(prompt, suffix)` prefill each distinct prompt once and the suffixes on
top of it; the samples then read both segments.

The cache is donated to the decode loop, and the loop exits as soon as every sample has stopped
(rows that stopped early still ride along: continuous.py refills them instead). Every array the
two programs exchange is constrained by `row_names`, so its sharding is known without compiling
(sampler.abstract_programs).

Routing replay (a MoE, `record_routes`): the prefill also returns the experts of every context
token it computes, and the loop records, at each step, the experts of the token each row feeds
(its context's last token first, then its own tokens); a row's last token is never fed, so its
experts are never computed (-1).
"""
from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.sharding import constrain
from jaxprefix.sampling import routes as recorded_routes
from jaxprefix.sampling.prefill import TRACE_COUNTS, context_kv
from jaxprefix.sampling.token_choice import SamplingSettings, choose_tokens, row_step_keys

_CACHE_KV = ('layers', 'batch', 'length', 'kv_heads', 'head_dim')


def row_names(x) -> tuple:
    """Logical axes of an array the sampler programs exchange: KV [layers, rows, length, heads,
    head_dim], a scalar, or anything else with rows first."""
    if x.ndim == 5:
        return _CACHE_KV
    return ('batch',) + (None,) * (x.ndim - 1) if x.ndim else ()


@flax.struct.dataclass
class DecodeState:
    """The decode loop's carry; B rows, T = the new-token bucket."""
    step: jax.Array          # int32 []   tokens decoded so far
    inputs: jax.Array        # int32 [B]  token fed at this step (the held-back context token first)
    positions: jax.Array     # int32 [B]  its position
    done: jax.Array          # bool [B]   stopped, truncated, or a padding row
    streams: jax.Array       # int32 [B]  the row's PRNG stream (token_choice.row_step_keys)
    offsets: jax.Array       # int32 [B]  the stream's token index at step 0
    stopped: jax.Array       # bool [B]   ended on a stop id
    lengths: jax.Array       # int32 [B]
    completions: jax.Array   # int32 [B, T]
    logprobs: jax.Array      # f32 [B, T]
    cache: KVCache           # each row's own new tokens
    routes: jax.Array | None = None  # [B, T, sparse layers, k]: the experts of the token fed
                                     # at each step (record_routes), -1 where none was


def _prompts_of_contexts(segment: KVSegment, index: jax.Array) -> KVSegment:
    return KVSegment(k=segment.k[:, index], v=segment.v[:, index], pos=segment.pos[index])


@functools.partial(jax.jit, static_argnames=('graphdef', 'n', 'new_bucket', 'gather_prompts',
                                             'record_routes'))
def prefill(graphdef, params, lay: dict, *, n: int, new_bucket: int, gather_prompts: bool,
            record_routes: bool = False):
    """(context KV segments, the initial decode state, the context routes): the last are None,
    or with `record_routes` the experts of the prompts' tokens [P, Sp, sparse layers, k] (one
    row per distinct prompt) and of the contexts' suffixes [C, Ss, ...]. Logits are not used:
    XLA drops them."""
    TRACE_COUNTS['prefill'] += 1
    model = nnx.merge(graphdef, params)
    prompt_kv, prompt_routes = context_kv(model, lay['prompt_tokens'], lay['prompt_positions'],
                                          record_routes=record_routes)
    if gather_prompts:
        prompt_kv = _prompts_of_contexts(prompt_kv, lay['prompt_index'])
    segments = (prompt_kv,)
    suffix_routes = None
    if lay['suffix_tokens'].shape[1]:
        suffix_kv, suffix_routes = context_kv(model, lay['suffix_tokens'],
                                              lay['suffix_positions'], segments,
                                              record_routes=record_routes)
        segments += (suffix_kv,)

    num_rows = lay['valid'].shape[0] * n

    def rows(per_context):  # group-major: row c * n + j is sample j of context c
        return jnp.repeat(per_context, n, axis=0)

    sample = jnp.tile(jnp.arange(n, dtype=jnp.int32), lay['valid'].shape[0])
    state = DecodeState(
        step=jnp.zeros((), jnp.int32), inputs=rows(lay['last_tokens']),
        positions=rows(lay['last_positions']), done=rows(~lay['valid']),
        streams=rows(lay['stream_index']) * n + sample, offsets=rows(lay['stream_offset']),
        stopped=jnp.zeros(num_rows, bool), lengths=jnp.zeros(num_rows, jnp.int32),
        completions=jnp.zeros((num_rows, new_bucket), jnp.int32),
        logprobs=jnp.zeros((num_rows, new_bucket), jnp.float32),
        cache=KVCache.empty(model.config, num_rows, new_bucket),
        routes=recorded_routes.empty(model.config, num_rows, new_bucket) if record_routes else None)
    segments, state = jax.tree.map(lambda x: constrain(x, row_names(x)), (segments, state))
    return segments, state, (prompt_routes, suffix_routes) if record_routes else None


@functools.partial(jax.jit, static_argnames=('graphdef', 'hoist_layers'),
                   donate_argnames=('state',))
def decode(graphdef, params, segments, state: DecodeState, settings: SamplingSettings, seed_key,
           stop_ids, max_new_tokens, *, hoist_layers: bool = False, until=None) -> DecodeState:
    """Decodes until every row is done or max_new_tokens (a traced scalar) tokens are drawn.

    hoist_layers: slice each layer's weights once, before the loop (Decoder.layer_weights), and
    keep the KV head-major inside it (KVSegment.head_major): the CPU decode.
    until (a traced scalar): stop sooner, after that many steps in all, the rows not done, so
    that the next call goes on from the returned state (sampling/chunked.py: the same steps,
    handed out in chunks); None: max_new_tokens.
    """
    TRACE_COUNTS['decode'] += 1
    layer_weights = nnx.merge(graphdef, params).layer_weights() if hoist_layers else None
    if hoist_layers:
        segments = tuple(s.in_head_major() for s in segments)
        state = state.replace(cache=state.cache.in_head_major())

    def keep_going(s: DecodeState):
        return (s.step < (max_new_tokens if until is None else until)) & ~jnp.all(s.done)

    def one_step(s: DecodeState) -> DecodeState:
        model = nnx.merge(graphdef, params)
        logits, cache, experts = model.extend(s.inputs[:, None], s.positions[:, None],
                                              context=segments, cache=s.cache,
                                              layer_weights=layer_weights, with_routes=True)
        keys = row_step_keys(seed_key, s.streams, s.step + s.offsets)
        tokens, logprobs = choose_tokens(logits[:, -1], keys, settings)
        active = ~s.done
        hit_stop = active & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        return s.replace(
            step=s.step + 1, inputs=tokens, positions=s.positions + 1,
            done=s.done | hit_stop | (s.step + 1 >= max_new_tokens), stopped=s.stopped | hit_stop,
            lengths=s.lengths + active.astype(jnp.int32),
            completions=s.completions.at[:, s.step].set(jnp.where(active, tokens, 0)),
            logprobs=s.logprobs.at[:, s.step].set(jnp.where(active, logprobs, 0.0)), cache=cache,
            routes=None if s.routes is None else s.routes.at[:, s.step].set(recorded_routes.recorded(
                experts[:, 0], jnp.where(active, s.positions, -1), model.config.num_experts)))

    state = jax.lax.while_loop(keep_going, one_step, state)
    return state.replace(cache=state.cache.in_token_major())
