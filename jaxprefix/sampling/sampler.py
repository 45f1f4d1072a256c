"""generate(): n continuations of each context, with one jitted prefill and one jitted decode loop.

Shared contexts: the C contexts' KV is computed once ([C, S] prefill) and the B = C * n sample
rows attend to it as a read-only `KVSegment` (group-major rows), so neither the prefill compute
nor the context KV is multiplied by n. Each row owns only a `KVCache` of its new tokens. Contexts
given as `SharedContext(prompt, suffix)` prefill each distinct prompt once and the suffixes on
top of it; the samples then read both segments.

Shapes (contexts, context length, new tokens) are bucketed to powers of two (layout.py), the
cache is donated to the decode loop, and the loop exits as soon as every sample has stopped.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxprefix import distributed
from jaxprefix.models.attention import KVCache, KVSegment
from jaxprefix.models.sharding import constrain
from jaxprefix.sampling.layout import (MIN_NEW_TOKENS_BUCKET, Context, ContextLayout, bucket,
                                       layout_contexts)
from jaxprefix.sampling.rollouts import Rollouts
from jaxprefix.sampling.token_choice import SamplingSettings, choose_tokens, row_step_keys

# How often each jitted function was traced (compiled): tests check that it stays bounded.
TRACE_COUNTS: collections.Counter = collections.Counter()

_CACHE_KV = ('layers', 'batch', 'length', 'kv_heads', 'head_dim')


@flax.struct.dataclass
class DecodeState:
    """The decode loop's carry; B rows, T = the new-token bucket."""
    step: jax.Array          # int32 []   tokens decoded so far
    inputs: jax.Array        # int32 [B]  token fed at this step (the held-back context token first)
    positions: jax.Array     # int32 [B]  its position
    done: jax.Array          # bool [B]   stopped, truncated, or a padding row
    stopped: jax.Array       # bool [B]   ended on a stop id
    lengths: jax.Array       # int32 [B]
    completions: jax.Array   # int32 [B, T]
    logprobs: jax.Array      # f32 [B, T]
    cache: KVCache           # each row's own new tokens


def _take_groups(segment: KVSegment, index: jax.Array) -> KVSegment:
    return KVSegment(k=segment.k[:, index], v=segment.v[:, index], pos=segment.pos[index])


def _constrain_rows(x: jax.Array) -> jax.Array:
    return constrain(x, ('batch',) + (None,) * (x.ndim - 1))


@functools.partial(jax.jit, static_argnames=('graphdef', 'n', 'new_bucket', 'gather_prompts'))
def _prefill(graphdef, params, lay: dict, *, n: int, new_bucket: int, gather_prompts: bool):
    """Context KV segments and the initial decode state. Logits are not used: XLA drops them."""
    TRACE_COUNTS['prefill'] += 1
    model = nnx.merge(graphdef, params)
    _, prompt_kv = model.extend(lay['prompt_tokens'], lay['prompt_positions'])
    if gather_prompts:
        prompt_kv = _take_groups(prompt_kv, lay['prompt_index'])
    segments = (prompt_kv,)
    if lay['suffix_tokens'].shape[1]:
        _, suffix_kv = model.extend(lay['suffix_tokens'], lay['suffix_positions'], context=segments)
        segments += (suffix_kv,)

    num_rows = lay['valid'].shape[0] * n

    def rows(per_context):  # group-major: row c * n + j is sample j of context c
        return _constrain_rows(jnp.repeat(per_context, n, axis=0))

    cache = KVCache.empty(model.config, num_rows, new_bucket)
    cache = cache.replace(k=constrain(cache.k, _CACHE_KV), v=constrain(cache.v, _CACHE_KV),
                          pos=_constrain_rows(cache.pos))
    state = DecodeState(
        step=jnp.zeros((), jnp.int32), inputs=rows(lay['last_tokens']),
        positions=rows(lay['last_positions']), done=rows(~lay['valid']),
        stopped=_constrain_rows(jnp.zeros(num_rows, bool)),
        lengths=_constrain_rows(jnp.zeros(num_rows, jnp.int32)),
        completions=_constrain_rows(jnp.zeros((num_rows, new_bucket), jnp.int32)),
        logprobs=_constrain_rows(jnp.zeros((num_rows, new_bucket), jnp.float32)), cache=cache)
    return segments, state


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('state',))
def _decode(graphdef, params, segments, state: DecodeState, settings: SamplingSettings, seed_key,
            stop_ids, max_new_tokens) -> DecodeState:
    """Decodes until every row is done or max_new_tokens (a traced scalar) tokens are drawn."""
    TRACE_COUNTS['decode'] += 1
    row_ids = jnp.arange(state.inputs.shape[0], dtype=jnp.int32)

    def keep_going(s: DecodeState):
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def one_step(s: DecodeState) -> DecodeState:
        model = nnx.merge(graphdef, params)
        logits, cache = model.extend(s.inputs[:, None], s.positions[:, None], context=segments,
                                     cache=s.cache)
        keys = row_step_keys(seed_key, row_ids, s.step)
        tokens, logprobs = choose_tokens(logits[:, -1], keys, settings)
        active = ~s.done
        hit_stop = active & jnp.any(tokens[:, None] == stop_ids[None, :], axis=-1)
        return DecodeState(
            step=s.step + 1, inputs=tokens, positions=s.positions + 1,
            done=s.done | hit_stop | (s.step + 1 >= max_new_tokens), stopped=s.stopped | hit_stop,
            lengths=s.lengths + active.astype(jnp.int32),
            completions=s.completions.at[:, s.step].set(jnp.where(active, tokens, 0)),
            logprobs=s.logprobs.at[:, s.step].set(jnp.where(active, logprobs, 0.0)), cache=cache)

    return jax.lax.while_loop(keep_going, one_step, state)


def _params_mesh(params) -> jax.sharding.Mesh | None:
    """The mesh the parameters live on, when they are sharded over one."""
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, 'sharding', None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def _rows_per_device(mesh) -> int:
    """How many devices the sample rows are split over ('data' x 'fsdp'), 1 without a mesh."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape.get(axis, 1) for axis in ('data', 'fsdp'))


def generate(model, contexts: Sequence[Context], *, n: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             stop_ids: Sequence[int] = (), seed: int = 0) -> Rollouts:
    """Samples n continuations of each context (a token-id list or a `SharedContext`).

    Rows i*n .. i*n+n-1 of the result continue contexts[i]. temperature 0 decodes greedily. A
    sample ends after a stop id (kept in its completion) or after max_new_tokens tokens. Sample j
    of context i draws from the PRNG stream (seed, i*n + j, step): same seed, same rollouts.
    """
    if int(n) != n or n < 1:
        raise ValueError(f'n (samples per context) must be a positive integer, got {n!r}')
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f'max_new_tokens must be a positive integer, got {max_new_tokens!r}')
    settings = SamplingSettings.make(float(temperature), float(top_p), top_k)
    vocab_size = model.config.vocab_size
    stop_ids = tuple(int(t) for t in stop_ids)
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise ValueError(f'stop_ids must be token ids in [0, {vocab_size}), got {stop_ids}')

    graphdef, params = nnx.split(model)
    mesh = _params_mesh(params)
    rows_split = _rows_per_device(mesh)
    lay: ContextLayout = layout_contexts(
        contexts, vocab_size, context_multiple=rows_split // math.gcd(n, rows_split))
    arrays = {name: getattr(lay, name) for name in (
        'prompt_tokens', 'prompt_positions', 'prompt_index', 'suffix_tokens', 'suffix_positions',
        'last_tokens', 'last_positions', 'valid')}
    # Stop ids padded to a bucket with -1 (never sampled), so their count does not recompile.
    stop_array = np.full(bucket(len(stop_ids), 4), -1, np.int32)
    stop_array[:len(stop_ids)] = stop_ids
    new_bucket = bucket(max_new_tokens, MIN_NEW_TOKENS_BUCKET)

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        segments, state = _prefill(graphdef, params, arrays, n=n, new_bucket=new_bucket,
                                   gather_prompts=not lay.prompts_are_contexts)
        state = _decode(graphdef, params, segments, state, settings, jax.random.key(seed),
                        jnp.asarray(stop_array), jnp.int32(max_new_tokens))
    num_rows = lay.num_contexts * n
    # to_host, not device_get: on several hosts the rows live on other processes' devices too.
    completions, logprobs, lengths, stopped = distributed.to_host(
        (state.completions, state.logprobs, state.lengths, state.stopped))
    return Rollouts.from_parts(lay.full_contexts, completions[:num_rows], logprobs[:num_rows],
                               lengths[:num_rows], stopped[:num_rows], n)
