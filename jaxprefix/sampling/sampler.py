"""generate(): n continuations of each context, decoded in-graph, and the programs it runs.

A request is laid out on the host (layout.py), then sampled either
  - statically (static.py): every row in flight, one prefill of every context, one decode loop
    until the longest row stops; what generate does when no row cap or KV budget binds, or
  - continuously (continuous.py): a bounded number of rows in flight, refilled inside one jitted
    loop as rows stop, contexts prefilled in waves as their slots free up; chosen by
    `max_rows_in_flight` or `kv_budget_bytes` (budget.py).
Both give the same rollouts for the same seed. `abstract_programs` hands the same programs, with
abstract arguments, to whoever compiles them ahead of time for another machine (jobs/compile).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from jaxprefix import distributed
from jaxprefix.models import backend
from jaxprefix.models.paged_attention import PageLayout
from jaxprefix.models.sharding import logical_spec
from jaxprefix.sampling import budget, continuous, decode_mesh, routes, static
from jaxprefix.sampling.continuous_state import Shape
from jaxprefix.sampling.prefill import TRACE_COUNTS
from jaxprefix.sampling.layout import (MIN_NEW_TOKENS_BUCKET, Context, ContextLayout,
                                       SharedContext, bucket, layout_contexts)
from jaxprefix.sampling.rollouts import Rollouts
from jaxprefix.sampling.token_choice import SamplingSettings

__all__ = ['KV_DTYPES', 'TRACE_COUNTS', 'Program', 'abstract_programs', 'generate']

KV_DTYPES = ('float32', 'bfloat16', 'int8')


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted program of a request and the arguments of its call: `fn(*args, **kwargs)` runs
    it, `lower()` lowers it (abstract arguments: for another machine's compiler)."""
    fn: Callable
    args: tuple
    kwargs: dict

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)

    def lower(self):
        return self.fn.lower(*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class _Request:
    """Everything generate() decides on the host before any device work."""
    graphdef: object
    params: object
    mesh: jax.sharding.Mesh | None
    layout: ContextLayout
    plan: budget.ContinuousPlan | None  # None: the static decode
    n: int
    new_bucket: int
    settings: SamplingSettings
    stop_ids: np.ndarray
    max_new_tokens: int
    seed: int
    hoist_layers: bool  # the decode runs on CPU (see Decoder.extend's layer_weights)
    pages: PageLayout | None  # the continuous decode's pages for the rows' own tokens
    record_routes: bool  # a MoE's experts recorded for routing replay (routes.py)
    reshard: Program | None = None  # lays the weights out for `mesh` (tensor-parallel decode)


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


def prepare_request(model, contexts, *, n, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
             stop_ids=(), seed=0, max_rows_in_flight=None, kv_budget_bytes=None,
             memory_headroom=None, page_size=budget.DEFAULT_PAGE_SIZE, kv_dtype=None,
             reserve_fraction=1.0, tensor_parallel=None, streams=None, paged=False,
             record_routes=False) -> _Request:
    if int(n) != n or n < 1:
        raise ValueError(f'n (samples per context) must be a positive integer, got {n!r}')
    if int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f'max_new_tokens must be a positive integer, got {max_new_tokens!r}')
    if max_rows_in_flight is not None and (int(max_rows_in_flight) != max_rows_in_flight or
                                           max_rows_in_flight < 1):
        raise ValueError(f'max_rows_in_flight must be a positive integer or None (every row), '
                         f'got {max_rows_in_flight!r}')
    settings = SamplingSettings.make(float(temperature), float(top_p), top_k)
    config = model.config
    if record_routes and not any(config.sparse_layers):
        raise ValueError('record_routes: the model has no sparse (mixture-of-experts) layers')
    stop_ids = tuple(int(t) for t in stop_ids)
    if any(not 0 <= t < config.vocab_size for t in stop_ids):
        raise ValueError(f'stop_ids must be token ids in [0, {config.vocab_size}), got {stop_ids}')
    # Stop ids padded to a bucket with -1 (never sampled), so their count does not recompile.
    stop_array = np.full(bucket(len(stop_ids), 4), -1, np.int32)
    stop_array[:len(stop_ids)] = stop_ids
    new_bucket = bucket(max_new_tokens, MIN_NEW_TOKENS_BUCKET)

    kv_dtype = str(np.dtype(kv_dtype or config.dtype))
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f'kv_dtype must be one of {KV_DTYPES} (None: the compute dtype), got '
                         f'{kv_dtype!r}')
    graphdef, params = nnx.split(model)
    mesh = _params_mesh(params)
    platform = backend.platform_of(params)
    reshard = None
    if mesh is not None and tensor_parallel is not None:
        layout = decode_mesh.decode_mesh(mesh, config, tensor_parallel, platform)
        if layout is not mesh:
            mesh = layout
            reshard = Program(decode_mesh.reshard(model, mesh), (params,), {})
    if kv_budget_bytes is None and memory_headroom is not None:
        devices = None if mesh is None else list(mesh.devices.flat)
        kv_budget_bytes = budget.free_device_memory(devices, memory_headroom)
        if kv_budget_bytes is not None and reshard is not None:  # the copy the reshard makes
            kv_budget_bytes -= _bytes_per_device(params, reshard.fn) * mesh.devices.size
        kv_budget_bytes = None if kv_budget_bytes is None else max(0, kv_budget_bytes)
    shards = _rows_per_device(mesh)
    # Static rows (C * n) must divide over the row devices; continuous contexts themselves must.
    lay = layout_contexts(contexts, config.vocab_size, shards // math.gcd(n, shards), streams)
    plan = budget.plan(
        num_contexts=math.lcm(lay.valid.shape[0], shards), n=n,
        context_length=lay.prompt_tokens.shape[1] + lay.suffix_tokens.shape[1],
        new_bucket=new_bucket, shards=shards, bytes_per_token=budget.kv_bytes_per_token(config),
        page_bytes=budget.page_bytes_per_token(config, kv_dtype), page_size=page_size,
        reserve_fraction=reserve_fraction, max_rows_in_flight=max_rows_in_flight,
        kv_budget_bytes=kv_budget_bytes, paged=paged)
    if plan is not None and lay.valid.shape[0] % shards:
        lay = layout_contexts(contexts, config.vocab_size, shards, streams)
    hoist_layers = backend.unrolls_layers(platform)  # and then one page pool per layer
    pages = None if plan is None else PageLayout(
        kv_heads=config.num_kv_heads, head_dim=config.head_dim, layers=config.num_layers,
        blocks=plan.shards, pages=plan.pages, page_size=plan.page_size, dtype=kv_dtype,
        per_layer=hoist_layers)
    return _Request(graphdef, params, mesh, lay, plan, int(n), new_bucket, settings,
                    stop_array, int(max_new_tokens), int(seed), hoist_layers, pages,
                    bool(record_routes), reshard)


def _bytes_per_device(params, reshard) -> int:
    """Bytes one device holds of `params` laid out by the jitted `reshard`."""
    total = 0
    for leaf in jax.tree.leaves(reshard.eval_shape(params)):
        total += math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return total


def layout_arrays(lay: ContextLayout, per_context: bool) -> dict:
    """The layout as the programs take it; per_context: one prompt row per context (the
    continuous decode prefills contexts a few at a time, so it does not share prompt rows)."""
    arrays = {name: getattr(lay, name) for name in (
        'prompt_tokens', 'prompt_positions', 'prompt_index', 'suffix_tokens', 'suffix_positions',
        'last_tokens', 'last_positions', 'valid', 'stream_index', 'stream_offset')}
    if per_context:
        for name in ('prompt_tokens', 'prompt_positions'):
            arrays[name] = arrays[name][lay.prompt_index]
        del arrays['prompt_index']
    return arrays


def prefill_program(req: _Request) -> Program:
    return Program(static.prefill, (req.graphdef, req.params, layout_arrays(req.layout, False)),
                   dict(n=req.n, new_bucket=req.new_bucket,
                        gather_prompts=not req.layout.prompts_are_contexts,
                        record_routes=req.record_routes))


def sampler_args(req: _Request) -> tuple:
    if isinstance(jax.tree.leaves(req.params)[0], jax.ShapeDtypeStruct):
        # abstract_programs may target devices this host lacks: the key's shape, replicated.
        key = _abstract(jax.eval_shape(jax.random.key, req.seed), req.mesh)
    else:
        key = jax.random.key(req.seed)
    return (req.settings, key, req.stop_ids, np.int32(req.max_new_tokens))


def _decode_program(req: _Request, segments, state) -> Program:
    return Program(static.decode, (req.graphdef, req.params, segments, state,
                                   *sampler_args(req)), dict(hoist_layers=req.hoist_layers))


def continuous_shape(req: _Request) -> Shape:
    s = req.plan
    return Shape(n=req.n, new_bucket=req.new_bucket, row_slots=s.row_slots,
                            context_slots=s.context_slots, admit=s.admit, reserve=s.reserve,
                            layout=req.pages, record_routes=req.record_routes)


def _continuous_program(req: _Request) -> Program:
    return Program(continuous.sample_continuous,
                   (req.graphdef, req.params, layout_arrays(req.layout, True),
                    *sampler_args(req)),
                   dict(shape=continuous_shape(req)))


def mesh_scope(mesh):
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def generate(model, contexts: Sequence[Context], *, n: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             stop_ids: Sequence[int] = (), seed: int = 0, max_rows_in_flight: int | None = None,
             kv_budget_bytes: int | None = None, memory_headroom: float | None = None,
             page_size: int = budget.DEFAULT_PAGE_SIZE, kv_dtype: str | None = None,
             reserve_fraction: float = 1.0, tensor_parallel: int | None = None,
             streams: Sequence[tuple[int, int]] | None = None,
             record_routes: bool = False) -> Rollouts:
    """Samples n continuations of each context (a token-id list or a `SharedContext`).

    Rows i*n .. i*n+n-1 of the result continue contexts[i]. temperature 0 decodes greedily. A
    sample ends after a stop id (kept in its completion) or after max_new_tokens tokens. Sample j
    of context i draws from the PRNG stream (seed, i*n + j, its token index): same seed, same
    rollouts, whatever the rows in flight or the devices. streams: for each context, (k, o):
    its sample j draws from (seed, k*n + j, o + its token index) instead, as if it were context
    k with o tokens drawn (a multi-turn conversation continued: tools/episodes.py).

    max_rows_in_flight: at most this many rows decode at once (rounded down to a multiple of the
    row devices, at least one each); None: every row. kv_budget_bytes: the KV cache (contexts and
    new tokens, all devices together) stays within this many bytes; None: unbounded, or, given
    memory_headroom, what the devices hold beyond that share of their memory (none on CPU). Either
    switches to the continuous decode when it binds, which keeps the rows' own tokens in KV
    pages of `page_size` tokens (in `kv_dtype`: the compute dtype, or int8 with per-token
    scales), promising each active row `reserve_fraction` of a whole row's pages.
    tensor_parallel: decode with the weights split over that many of the parameters' devices
    (0: the widest that divides the heads on TPU, the parameters' own layout elsewhere; None:
    always their own layout); the weights are resharded once per call.
    record_routes (a mixture of experts): Rollouts.routes holds each token's experts in each
    sparse layer as the sampler computed them, for the learner to replay (routes.py).
    """
    req = prepare_request(model, contexts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, top_k=top_k, stop_ids=stop_ids, seed=seed,
                   max_rows_in_flight=max_rows_in_flight, kv_budget_bytes=kv_budget_bytes,
                   memory_headroom=memory_headroom, page_size=page_size, kv_dtype=kv_dtype,
                   reserve_fraction=reserve_fraction, tensor_parallel=tensor_parallel,
                   streams=streams, record_routes=record_routes)
    if req.reshard is not None:
        req = dataclasses.replace(req, params=req.reshard())
    lay = req.layout
    with mesh_scope(req.mesh):
        if req.plan is None:
            segments, state, recorded = prefill_program(req)()
            state = _decode_program(req, segments, state)()
            outputs = (state.completions, state.logprobs, state.lengths, state.stopped)
            recorded = None if recorded is None else (*recorded, state.routes)
        else:
            *outputs, recorded = _continuous_program(req)()
    # to_host, not device_get: on several hosts the rows live on other processes' devices too.
    *outputs, recorded = distributed.to_host((*outputs, recorded))
    if recorded is not None and req.plan is None:
        # The static prefill's prompt rows are the distinct prompts: each context's own.
        recorded = (recorded[0][lay.prompt_index], *recorded[1:])
    return laid_out(req, *outputs, recorded)


def laid_out(req: _Request, completions, logprobs, lengths, stopped, recorded) -> Rollouts:
    """The request's Rollouts from its outputs on the host (rows past its own dropped);
    `recorded`: None, or the experts (prompts [C, Sp, ...] a row per context, suffixes or None,
    rows [>= C * n, T, ...]) as routes.of_contexts and Rollouts.from_parts take them."""
    lay, num_rows = req.layout, req.layout.num_contexts * req.n
    context_routes = row_routes = None
    if recorded is not None:
        prompt, suffix, row_routes = recorded
        context_routes, row_routes = routes.of_contexts(lay, prompt, suffix), row_routes[:num_rows]
    return Rollouts.from_parts(lay.full_contexts, completions[:num_rows], logprobs[:num_rows],
                               lengths[:num_rows], stopped[:num_rows], req.n,
                               context_routes=context_routes, row_routes=row_routes)


def _abstract(tree, mesh):
    """ShapeDtypeStructs of tree's arrays; with a mesh, sharded as the programs exchange them
    (mesh axes of size 1 left out, as XLA leaves them out of the shardings it returns)."""
    sizes = {} if mesh is None else {a: s for a, s in mesh.shape.items() if s > 1}

    def one(x):
        sharding = None
        if mesh is not None:
            spec = logical_spec(static.row_names(x), x.shape, sizes)
            sharding = jax.sharding.NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, tree)


def _abstract_params(params):
    def one(x):
        sharding = getattr(x, 'sharding', None)
        if not isinstance(sharding, jax.sharding.NamedSharding):
            sharding = None
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.tree.map(one, params)


def abstract_request(req: _Request) -> tuple[dict, _Request]:
    """({'reshard': ...} when the decode lays the weights out first, else {}; the request with
    abstract weights, as the decode's programs take them)."""
    programs = {}
    params = _abstract_params(req.params)
    if req.reshard is not None:
        programs['reshard'] = dataclasses.replace(req.reshard, args=(params,))
        params = _abstract_params(req.reshard.fn.eval_shape(params))
    return programs, dataclasses.replace(req, params=params, reshard=None)


def distinct_contexts(num_contexts: int, length: int, vocab_size: int) -> list[list[int]]:
    """Contexts of `length` tokens, each different from the others (an abstract request's)."""
    return [_distinct_tokens(i, length, vocab_size) for i in range(num_contexts)]


def _distinct_tokens(index: int, length: int, vocab_size: int) -> list[int]:
    """`length` token ids that differ from those of every other index (its digits in base V)."""
    digits = []
    while index or not digits:
        index, digit = divmod(index, vocab_size)
        digits.append(digit)
    return (digits + [1] * length)[:length]


def abstract_programs(model, *, num_contexts: int, context_length: int, n: int,
                      max_new_tokens: int, prompt_length: int = 0, contexts_per_prompt: int = 1,
                      max_rows_in_flight: int | None = None, kv_budget_bytes: int | None = None,
                      temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                      num_stop_ids: int = 1, page_size: int = budget.DEFAULT_PAGE_SIZE,
                      kv_dtype: str | None = None, reserve_fraction: float = 1.0,
                      tensor_parallel: int | None = None,
                      record_routes: bool = False) -> dict[str, Program]:
    """The programs generate() runs for a request of this shape, with abstract arguments.

    `model` may be abstract (nnx.eval_shape; parameters ShapeDtypeStructs, sharded over a mesh
    when they carry NamedShardings). Contexts are `context_length` distinct tokens; with
    prompt_length > 0 each is a `SharedContext` whose prompt of that many tokens is shared by
    `contexts_per_prompt` contexts (PrefixRL's prefixes of one problem).
    Returns {'prefill': ..., 'decode': ...} for the static decode, or {'continuous': ...} when
    the row cap or KV budget binds, after {'reshard': ...} when the weights are laid out for a
    tensor-parallel decode; under the mesh, `program.lower().compile()` compiles exactly what
    generate() would run for that shape (memory_analysis() then reads its footprint).
    `record_routes` (a MoE): the programs that also record each token's experts, as the RL loop
    runs them under routing replay.
    """
    if not 0 <= prompt_length < context_length:
        raise ValueError(f'prompt_length must be in [0, context_length={context_length}), got '
                         f'{prompt_length}')
    vocab_size = model.config.vocab_size
    contexts = distinct_contexts(num_contexts, context_length, vocab_size)
    if prompt_length:
        contexts = [SharedContext(_distinct_tokens(i // contexts_per_prompt, prompt_length,
                                                   vocab_size), c[prompt_length:])
                    for i, c in enumerate(contexts)]
    req = prepare_request(model, contexts, n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_p=top_p, top_k=top_k, stop_ids=range(num_stop_ids), seed=0,
                   max_rows_in_flight=max_rows_in_flight, kv_budget_bytes=kv_budget_bytes,
                   page_size=page_size, kv_dtype=kv_dtype, reserve_fraction=reserve_fraction,
                   tensor_parallel=tensor_parallel, record_routes=record_routes)
    programs, req = abstract_request(req)
    with mesh_scope(req.mesh):
        if req.plan is not None:
            return programs | {'continuous': _continuous_program(req)}
        prefill = prefill_program(req)
        segments, state, _ = prefill.fn.eval_shape(*prefill.args, **prefill.kwargs)
        segments, state = _abstract((segments, state), req.mesh)
        return programs | {'prefill': prefill, 'decode': _decode_program(req, segments, state)}
