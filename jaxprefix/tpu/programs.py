"""The programs one RL step runs, compiled for a mesh from shapes alone (no weights, no data).

The model is built abstractly (nnx.eval_shape) with its parameters sharded over the mesh by
their logical axes, the learner's state and batch are sharded jax.ShapeDtypeStructs, and each
program is lowered and compiled as the run would call it: the learner's update
(rl/train_step.py) and the sampler's programs as sampling.abstract_programs hands them (the static
prefill and decode, or the continuous decode when a row cap or KV budget binds).
"""
from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxprefix.models import lora, moe
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder
from jaxprefix.models.sharding import param_shardings
from jaxprefix.rl.dynamic_sampling import bucket as batch_width_bucket
from jaxprefix.rl.train_config import BATCH_AXES, TrainConfig
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling.rollout_spec import RolloutSpec


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What one RL step samples and trains on."""
    contexts: int              # contexts sampled per step (each n times)
    context_length: int        # longest context in tokens (prompt plus guidance or prefix)
    n: int
    rollout: RolloutSpec       # how they are sampled (rollout.*)
    routing_replay: bool = False  # a MoE's experts recorded by the sampler, replayed in training
    max_turns: int = 1         # a tool run's sampled turns an episode (rollout.max_turns)
    episode_token_budget: int = 0  # and its tokens an episode, context and observations included
    kv_kept: bool = True       # its episodes' rollout keeps the KV (tools.rollout='kv_kept')

    @property
    def max_new_tokens(self) -> int:
        return self.rollout.max_new_tokens

    @property
    def episodes(self) -> bool:
        return self.max_turns > 1

    @property
    def new_tokens_per_row(self) -> int:
        """The most tokens a row samples: max_new_tokens a turn, every turn."""
        return self.max_turns * self.max_new_tokens

    @property
    def sampled_context_length(self) -> int:
        """The longest context generate() prefills: the episode's last turn but its own tokens
        where the reference rollout re-prefills every turn."""
        if self.episodes and not self.kv_kept:
            return max(self.context_length, self.episode_token_budget - self.max_new_tokens)
        return self.context_length

    @property
    def rows(self) -> int:
        return self.contexts * self.n

    @property
    def learner_width(self) -> int:
        """The learner batch's width: the loop buckets the longest row to a power of two (an
        episode's: its token budget at most)."""
        if self.episodes:
            return batch_width_bucket(self.episode_token_budget)
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
    rare_branch_calls: int | None = None  # that loop's costly branch taken (admissions), in all
    rare_loop_trips: int | None = None  # a data-dependent loop in its body (appends): in all
    resident_bytes: float = 0.0    # per chip, live in HBM during the call but not an argument
    resident_note: str = ''
    shapes: str = ''
    # KV tokens a call of the paged kernel reads on average, by what its pages hold.
    paged_tokens_per_call: dict = dataclasses.field(default_factory=dict)
    rows_in_flight: int = 0        # a decode: the rows it decodes at once, over all devices


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


def abstract_model(config: ModelConfig, mesh, adapters: lora.LoraConfig | None = None
                   ) -> nnx.Module:
    """A Decoder (with LoRA `adapters` when given) whose parameters are sharded
    jax.ShapeDtypeStructs: nothing allocated."""
    def build():
        model = Decoder(config, rngs=nnx.Rngs(0))
        return model if adapters is None else lora.with_adapters(model, adapters)
    model = nnx.eval_shape(build)
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


def learner_programs(learner: Learner, state, train: TrainConfig, step: StepShape
                     ) -> list[Program]:
    """[the update over one step's batch (rows x learner width), compiled] for the abstract
    TrainState `state` of `learner` (Learner.abstract_state)."""
    mesh = learner.mesh
    rows, width = step.rows, step.learner_width
    sharding = NamedSharding(mesh, P(BATCH_AXES))
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    batch = {'tokens': spec((rows, width), jnp.int32), 'positions': spec((rows, width), jnp.int32),
             'token_mask': spec((rows, width), jnp.bool_),
             'completion_mask': spec((rows, width), jnp.float32),
             'old_logprobs': spec((rows, width), jnp.float32),
             'advantages': spec((rows,), jnp.float32)}
    resident, note = 0.0, ''
    if step.routing_replay:  # a MoE's experts as the sampler recorded them
        c = learner.model(state).config
        batch['routes'] = spec((rows, width, sum(c.sparse_layers), c.num_experts_per_tok),
                               moe.route_dtype(c.num_experts))
    if train.kl_coef > 0:
        batch['ref_logprobs'] = spec((rows, width), jnp.float32)
        resident, note = bytes_per_chip(state.params), 'the frozen KL reference parameters'
    micro = train.micro_batch_size or rows // train.num_minibatches
    shapes = (f'{rows} rows x {width} tokens, {train.num_minibatches} minibatches x '
              f'{rows // train.num_minibatches // micro} micro-batches of {micro} rows, '
              f'remat {train.remat}, log-prob chunk {train.logprob_chunk}')
    return [compile_program('learner update', learner.lower_update(state, batch),
                            resident_bytes=resident, resident_note=note, shapes=shapes)]


def sampling_model(learner: Learner, state, decode_mesh=None
                   ) -> tuple[nnx.Module, float, str, Program | None]:
    """Learner.sampling_model for an abstract state: (the model the sampler runs, the bytes per
    chip that copy adds beside the training state and base, what they are, the compiled program
    that makes it when it is a program of its own).

    Full fine-tuning: the weights in the compute dtype, sharded like the master weights, or cast
    and laid out for `decode_mesh` in one program (`sampler reshard`). LoRA: the base with the
    adapters folded in (lora.merged: a new copy of each targeted weight), or the adapted model
    itself (merged_sampling=False); generate() lays those out for the decode itself."""
    compute = learner.compute_dtype
    model = learner.model(state)
    if lora.has_adapters(model):
        if not model.adapters.config.merged_sampling:
            return model, 0.0, '', None
        merged, targeted = _merged_copy(model)
        return merged, bytes_per_chip(targeted), \
            'the base weights the merged sampler copy replaces', None
    if decode_mesh is not None and decode_mesh != learner.mesh:
        params, rest = learner._sampling_copy(decode_mesh).eval_shape(state.params, learner.rest)
        program = compile_program(
            'sampler reshard', learner.lower_sampling_copy(state, decode_mesh),
            resident_bytes=bytes_per_chip(state), resident_note='the training state',
            shapes="the master weights cast to the compute dtype and laid out for the decode "
                   "mesh's (heads over 'tensor')")
        return nnx.merge(learner.graphdef, params, rest), 0.0, '', program
    return (nnx.merge(learner.graphdef, _cast(state.params, compute), learner.rest), 0.0,
            '', None)


def sampler_weights(config: ModelConfig, mesh, adapters: lora.LoraConfig | None = None
                    ) -> tuple[nnx.Module, float]:
    """A sampler on chips of its own (rollout.devices): (the model it holds, laid out on its
    decode `mesh`; the bytes per chip of it that each update replaces, which the learner sends).
    Full fine-tuning: every trained weight, in the compute dtype. LoRA: the base (already in the
    compute dtype) with the adapters folded in, the merged targeted weights sent; or the base
    and the adapters, applied per token, the adapters sent (merged_sampling=False)."""
    model = abstract_model(config, mesh, adapters)
    if adapters is None:
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = _cast(params, jnp.dtype(config.dtype))
        return nnx.merge(graphdef, params, rest), bytes_per_chip(params)
    if not adapters.merged_sampling:
        return model, bytes_per_chip(nnx.state(model, lora.trainable(model)))
    merged, targeted = _merged_copy(model)
    return merged, bytes_per_chip(targeted)


def _merged_copy(model) -> tuple[nnx.Module, list]:
    """lora.merged for an abstract adapted model (same shapes, no adapters), and its targeted
    weights: the new copies merging makes."""
    merged = nnx.merge(*nnx.split(model), copy=True)
    targets = merged.adapters.config.targets
    del merged.adapters
    return merged, [getattr(merged, name).get_value() for name in targets]


def _cast(tree, dtype):
    """Abstract floating leaves in `dtype`, their shardings kept."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype,
        sharding=x.sharding), tree)


def sampler_programs(model, mesh, step: StepShape, *, kv_budget_bytes: int | None,
                     resident_bytes: float, resident_note: str) -> list[Program]:
    """The programs generate() runs for one step's rollouts (sampling.abstract_programs),
    compiled: the reshard of the weights for a tensor-parallel decode, then the static prefill
    and decode of every row, or the continuous decode when rollout.max_rows_in_flight or the KV
    budget binds. A tool run's episodes with their KV kept: the chunk program sample_turns
    runs instead (turns.abstract_turn_programs); with the reference rollout, generate's at the
    longest context it re-prefills. The training state stays in HBM while sampling:
    `resident_bytes` per chip is added to each program, and the learner-layout weights the
    reshard reads stay too.
    """
    from jaxprefix.sampling import sampler, turns

    keywords = step.rollout.sampler_keywords()
    del keywords['memory_headroom']  # the budget is given: the slice's chips report no memory
    keywords |= dict(num_contexts=step.contexts, n=step.n, record_routes=step.routing_replay,
                     kv_budget_bytes=kv_budget_bytes)
    if step.episodes and step.kv_kept:
        found = turns.abstract_turn_programs(
            model, context_length=step.context_length, max_turns=step.max_turns,
            episode_token_budget=step.episode_token_budget, **keywords)
    else:
        found = sampler.abstract_programs(model, context_length=step.sampled_context_length,
                                          **keywords)
    common = dict(resident_bytes=resident_bytes, resident_note=resident_note)
    out = []
    if 'reshard' in found:
        out.append(compile_program('sampler reshard', found['reshard'].lower(),
                                   shapes='the weights from the learner\'s layout to the decode '
                                   'mesh\'s (heads over \'tensor\')', **common))
        common = dict(resident_bytes=resident_bytes + bytes_per_chip(nnx.state(model)),
                      resident_note=resident_note + ', the learner-layout sampler weights')
    with jax.set_mesh(_decode_mesh(found, mesh)):
        if 'turns' in found:
            return out + [_turns(found['turns'], step, common)]
        if 'continuous' in found:
            return out + [_continuous(found['continuous'], step, common)]
        prefill, decode = found['prefill'], found['decode']
        lay = prefill.args[2]
        rows = lay['last_tokens'].shape[0] * step.n
        shapes = (f"{lay['last_tokens'].shape[0]} contexts x {lay['prompt_tokens'].shape[1]} "
                  f"tokens, n={step.n}: {rows} rows x {prefill.kwargs['new_bucket']} new tokens")
        compiled = compile_program('sampler prefill', prefill.lower(), shapes=shapes, **common)
        if compiled.compiled is None:  # decode's inputs are the prefill's outputs
            return out + [compiled, Program('sampler decode', None, error='not compiled: its '
                                            'inputs come from the prefill, which does not fit',
                                            shapes=shapes, **common)]
        return out + [compiled, compile_program('sampler decode', decode.lower(),
                                                unknown_trip_count=step.max_new_tokens,
                                                rows_in_flight=rows, shapes=shapes, **common)]


def decode_copy_bytes(model, step: StepShape) -> float:
    """Bytes per chip of the weights' tensor-parallel copy that generate() makes for the decode
    (0: none, e.g. weights the learner already laid out for it)."""
    from jaxprefix.sampling import decode_mesh

    mesh = next(leaf.sharding.mesh for leaf in jax.tree.leaves(nnx.state(model))
                if isinstance(leaf.sharding, NamedSharding))
    layout = decode_mesh.decode_layout(mesh, model.config, step.rollout.tensor_parallel)
    if layout is mesh:
        return 0.0
    return bytes_per_chip(decode_mesh.reshard(model, layout).eval_shape(nnx.state(model)))


def _decode_mesh(found: dict, mesh):
    """The mesh the sampler's programs run on: their weights' (the decode mesh after a reshard)."""
    program = found.get('turns') or found.get('continuous') or found['prefill']
    for leaf in jax.tree.leaves(program.args[1]):  # (graphdef, params, ...)
        if isinstance(getattr(leaf, 'sharding', None), NamedSharding):
            return leaf.sharding.mesh
    return mesh


def _continuous(program, step: StepShape, common: dict) -> Program:
    # The loop runs until every row stopped: at most max_new_tokens steps per generation of rows
    # through a block's active slots (the worst case: every row runs to max_new_tokens).
    loop = _paged_loop(program, step, step.max_new_tokens)
    return compile_program('sampler continuous', program.lower(),
                           shapes=f"continuous: {loop.pop('shapes')}", **loop, **common)


def _turns(program, step: StepShape, common: dict) -> Program:
    """The chunk program, costed as if one chunk ran the whole rollout: every row its max_turns
    turns of max_new_tokens steps, and a row's observation fed in one appending pass (one of
    up to APPEND_TOKENS tokens) after each turn but its last."""
    loop = _paged_loop(program, step, step.new_tokens_per_row)
    shapes = (f"turns: {step.max_turns} of up to {step.max_new_tokens} tokens, "
              f"{step.episode_token_budget} tokens an episode; {loop.pop('shapes')}")
    return compile_program('sampler turns', program.lower(), shapes=shapes,
                           rare_loop_trips=_contexts_per_block(program) * step.n
                           * (step.max_turns - 1), **loop, **common)


def _contexts_per_block(program) -> int:
    """The contexts each row-device block of the continuous decode's program samples."""
    return program.args[2]['prompt_tokens'].shape[0] // program.kwargs['shape'].layout.blocks


def _paged_loop(program, step: StepShape, new_tokens: int) -> dict:
    """compile_program's figures for the continuous decode's loop, each row sampling up to
    `new_tokens` tokens: its assumed trips, admissions, the paged kernel's reads and rows in
    flight, and a line on its shapes."""
    s = program.kwargs['shape']
    pages = s.layout
    shards, contexts = pages.blocks, program.args[2]['prompt_tokens'].shape[0]
    per_block = _contexts_per_block(program)
    rows_per_block = per_block * step.n
    trips = -(-rows_per_block // s.row_slots) * new_tokens
    # The paged kernel reads only the pages a group needs. Over the run each row's t-th step reads
    # t of its own tokens, and each context is read at each of the steps its rows run, once for
    # all of them; so per call (one layer, one step), per device, on average:
    t = new_tokens
    lay = program.args[2]
    tokens_per_call = {'own': rows_per_block * t * (t - 1) / 2 / trips}
    for name in ('prompt', 'suffix'):
        real = (lay[f'{name}_positions'] >= 0).sum(axis=1)[:per_block].mean() if \
            lay[f'{name}_positions'].shape[1] else 0.0
        tokens_per_call[name] = float(per_block * t * real / trips)
    shapes = (f"{contexts} contexts x {step.n} over {shards} block(s) of "
              f"{s.row_slots} active rows, {s.context_slots} group slots of {step.n} rows "
              f"(admitting {s.admit}), {pages.pages} pages of {pages.page_size} tokens "
              f"({pages.dtype}), {s.reserve} promised a row")
    return dict(unknown_trip_count=trips, rare_branch_calls=-(-per_block // s.admit),
                paged_tokens_per_call=tokens_per_call, rows_in_flight=shards * s.row_slots,
                shapes=shapes)
