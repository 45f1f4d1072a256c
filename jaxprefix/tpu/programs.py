"""The programs one RL step runs, compiled for a mesh from shapes alone (no weights, no data).

The model is built abstractly (nnx.eval_shape) with its parameters sharded over the mesh by
their logical axes, the learner's state and batch are sharded jax.ShapeDtypeStructs, and each
program is lowered and compiled as the run would call it: the sampler's prefill and decode
(sampling/sampler.py) and the learner's update (rl/train_step.py).
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.sharding import param_shardings
from jaxprefix.rl.dynamic_sampling import bucket as batch_width_bucket
from jaxprefix.rl.train_step import BATCH_AXES, Learner, TrainConfig


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one RL step samples and trains on."""
    contexts: int              # contexts sampled per step (each n times)
    context_length: int        # longest context in tokens (prompt plus guidance or prefix)
    n: int
    max_new_tokens: int
    max_rows_in_flight: int = 0  # sampler rows decoded at once; 0 = every row of the step
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @property
    def rows(self) -> int:
        return self.contexts * self.n

    @property
    def learner_width(self) -> int:
        """The learner batch's width: the loop buckets the longest row to a power of two."""
        return batch_width_bucket(self.context_length + self.max_new_tokens)


@dataclasses.dataclass
class Program:
    """One compiled program of the step and how it is used. A program the compiler refused for
    lack of HBM has no `compiled`, its `error` and the `required_bytes` XLA reported."""
    name: str
    compiled: jax.stages.Compiled | None
    error: str = ''
    required_bytes: float = 0.0
    calls_per_step: int = 1
    unknown_trip_count: int = 1    # iterations of a data-dependent loop (decode: max_new_tokens)
    resident_bytes: float = 0.0    # per chip, live in HBM during the call but not an argument
    resident_note: str = ''
    shapes: str = ''


_OUT_OF_MEMORY = re.compile(r'RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT]?)\)')


def compile_program(name: str, lowered: jax.stages.Lowered, **fields) -> Program:
    """Compiles `lowered`; an out-of-HBM refusal becomes a Program with the bytes XLA needed."""
    try:
        return Program(name, lowered.compile(), **fields)
    except jax.errors.JaxRuntimeError as e:
        needed = _OUT_OF_MEMORY.search(str(e))
        if not needed:
            raise
        scale = 1024 ** ' KMGT'.index(needed.group(2) or ' ')
        return Program(name, None, error=str(e).splitlines()[0][:300],
                       required_bytes=float(needed.group(1)) * scale, **fields)


def abstract_model(config: ModelConfig, mesh) -> nnx.Module:
    """A Decoder whose parameters are sharded jax.ShapeDtypeStructs: nothing allocated."""
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    is_variable = lambda x: isinstance(x, nnx.Variable)
    placed = jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)),
        nnx.state(model), param_shardings(model, mesh), is_leaf=is_variable)
    nnx.update(model, placed)
    return model


def bytes_per_chip(tree) -> float:
    """Bytes one device holds of a tree of sharded jax.ShapeDtypeStructs (or arrays)."""
    total = 0.0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def learner_programs(model, train: TrainConfig, mesh, step: StepShape):
    """([the update over one step's batch (rows x learner width), compiled], the Learner, the
    abstract TrainState it updates)."""
    learner = Learner(model, train, mesh)
    state = learner.abstract_state()
    rows, width = step.rows, step.learner_width
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    batch = {'tokens': spec((rows, width), jnp.int32), 'positions': spec((rows, width), jnp.int32),
             'token_mask': spec((rows, width), jnp.bool_),
             'completion_mask': spec((rows, width), jnp.float32),
             'old_logprobs': spec((rows, width), jnp.float32),
             'advantages': spec((rows,), jnp.float32)}
    resident, note = 0.0, ''
    if train.kl_coef > 0:
        batch['ref_logprobs'] = spec((rows, width), jnp.float32)
        resident, note = bytes_per_chip(state.params), 'the frozen KL reference parameters'
    micro = train.micro_batch_size or rows // train.num_minibatches
    shapes = (f'{rows} rows x {width} tokens, {train.num_minibatches} minibatches x '
              f'{rows // train.num_minibatches // micro} micro-batches of {micro} rows, '
              f'remat {train.remat}, log-prob chunk {train.logprob_chunk}')
    return [compile_program('learner update', learner.lower_update(state, batch),
                            resident_bytes=resident, resident_note=note, shapes=shapes)], learner, state


def sampling_model(learner: Learner, state) -> nnx.Module:
    """Learner.sampling_model for an abstract state: the weights in the compute dtype, sharded
    like the master weights (a new copy when the two dtypes differ)."""
    compute = learner.compute_dtype
    cast = lambda x: jax.ShapeDtypeStruct(
        x.shape, compute if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
        sharding=x.sharding)
    return nnx.merge(learner.graphdef, jax.tree.map(cast, state.params), learner.rest)


def sampler_programs(model, mesh, step: StepShape, *, resident_bytes: float,
                     resident_note: str) -> list[Program]:
    """The sampler's prefill and decode for one wave of rows, compiled.

    Adapter for today's sampler (sampling/sampler.py: _prefill, then _decode over every row of
    the call): a wave holds max_rows_in_flight rows, i.e. max_rows_in_flight / n contexts, and a
    step runs ceil(contexts / wave) waves. The training state stays in HBM while sampling:
    `resident_bytes` per chip is added to both programs.
    """
    from jaxprefix.sampling import layout, sampler
    from jaxprefix.sampling.token_choice import SamplingSettings

    rows_in_flight = step.max_rows_in_flight or step.rows
    if rows_in_flight < step.n:
        raise ValueError(f'rollout.max_rows_in_flight={step.max_rows_in_flight}: expected at '
                         f'least rollout.n={step.n} (a context\'s samples decode together)')
    contexts = min(step.contexts, rows_in_flight // step.n)
    waves = -(-step.contexts // contexts)
    shards = math.prod(mesh.shape[a] for a in BATCH_AXES)
    multiple = shards // math.gcd(step.n, shards)
    padded = layout.bucket(contexts)
    padded = padded * multiple // math.gcd(padded, multiple)
    length = layout.bucket(step.context_length, layout.MIN_CONTEXT_BUCKET)
    new_bucket = layout.bucket(step.max_new_tokens, layout.MIN_NEW_TOKENS_BUCKET)
    replicated = NamedSharding(mesh, P())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    lay = {'prompt_tokens': spec((padded, length), jnp.int32),
           'prompt_positions': spec((padded, length), jnp.int32),
           'prompt_index': spec((padded,), jnp.int32),
           'suffix_tokens': spec((padded, 0), jnp.int32),
           'suffix_positions': spec((padded, 0), jnp.int32),
           'last_tokens': spec((padded,), jnp.int32), 'last_positions': spec((padded,), jnp.int32),
           'valid': spec((padded,), jnp.bool_)}
    graphdef, params = nnx.split(model)
    settings = SamplingSettings.make(step.temperature, step.top_p, step.top_k)
    settings = jax.tree.map(lambda x: spec(np.shape(x), np.asarray(x).dtype), settings)
    key = jax.eval_shape(lambda: jax.random.key(0))
    shapes = (f'{padded} contexts x {length} tokens, n={step.n}: {padded * step.n} rows x '
              f'{new_bucket} new tokens; {waves} wave(s) per step')
    common = dict(calls_per_step=waves, resident_bytes=resident_bytes,
                  resident_note=resident_note, shapes=shapes)
    with jax.set_mesh(mesh):
        prefill = compile_program('sampler prefill', sampler._prefill.lower(
            graphdef, params, lay, n=step.n, new_bucket=new_bucket, gather_prompts=False),
            **common)
        if prefill.compiled is None:  # decode's inputs are the prefill's outputs
            return [prefill, Program('sampler decode', None, error='not compiled: its inputs '
                                     'come from the prefill, which does not fit', **common)]
        segments, state = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            jax.eval_shape(lambda p, l: sampler._prefill(graphdef, p, l, n=step.n,
                                                         new_bucket=new_bucket,
                                                         gather_prompts=False), params, lay),
            prefill.compiled.output_shardings)
        decode = compile_program('sampler decode', sampler._decode.lower(
            graphdef, params, segments, state, settings,
            jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated),
            spec((4,), jnp.int32), spec((), jnp.int32)),
            unknown_trip_count=step.max_new_tokens, **common)
    return [prefill, decode]
