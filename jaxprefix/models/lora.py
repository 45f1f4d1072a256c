"""Low-rank adapters (LoRA) on the Decoder's stacked projection weights.

A target projection W (q, k, v, o, gate, up, down; laid out [layers, in..., out...]) becomes
W + (alpha / rank) * A B with A [layers, in..., rank] and B [layers, rank, out...], applied
per token inside the Decoder's layer scan: y = x W + s (dropout(x) A) B. B starts at zero, so an
adapted model computes exactly what its base does until it is trained.

Adapters are `LoraParam` variables (not `nnx.Param`) in a `model.adapters` submodule, so
`nnx.split(model, LoraParam, ...)` takes only them: the learner trains and checkpoints adapters
and leaves the base frozen in the rest of the graph. `merged(model)` folds them into the base
(W + s A B, in the base's dtype): the export's full HF directory, and the sampler's model.

Why not qwix (Tunix's LoRA): qwix intercepts einsums inside an NNX module and finds the weight
each one reads by identity, by tracing back through unary ops, or by shape. Our layers run
under lax.scan over weights stacked on a leading layer axis, so an einsum sees a per-layer slice
of a scan argument: neither the module's parameter nor traceable to it, and of another shape.
qwix would also create its adapter params lazily inside the scan's trace. Hence this module.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxprefix.models import layers
from jaxprefix.models.sharding import variable_axes

TARGETS = ('q', 'k', 'v', 'o', 'gate', 'up', 'down')
# How many axes of each weight (after the layer axis) are its inputs: o is [heads, head_dim, embed].
INPUT_AXES = {'q': 1, 'k': 1, 'v': 1, 'o': 2, 'gate': 1, 'up': 1, 'down': 1}
# Adapters are trained in f32 (Adam's master weights) whatever the base's dtype; the forward
# casts them to the compute dtype.
ADAPTER_DTYPE = jnp.float32


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (scale = alpha / r, as PEFT), dropout on the adapter's input, target
    projections; merged_sampling: the sampler runs the base with the adapters folded in
    (faster; costs a copy of the targeted weights while it samples) or applies them per token."""
    rank: int
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    merged_sampling: bool = True

    def __post_init__(self):
        object.__setattr__(self, 'targets', tuple(self.targets))
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f'LoraConfig.rank={self.rank!r}: expected an integer >= 1')
        if not self.alpha > 0:
            raise ValueError(f'LoraConfig.alpha={self.alpha!r}: expected > 0')
        if not 0 <= self.dropout < 1:
            raise ValueError(f'LoraConfig.dropout={self.dropout!r}: expected in [0, 1)')
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f'LoraConfig.targets={self.targets!r}: expected distinct names '
                             f'among {TARGETS}')

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoraParam(nnx.Variable):
    """A trainable adapter factor (A or B); the base's nnx.Params stay frozen beside it."""


class LoraDropoutKey(nnx.Variable):
    """The PRNG key of adapter dropout, set only inside the learner's loss (set_dropout_key)."""


class Adapters(nnx.Module):
    """A and B of each target projection of a Decoder, stacked over its layers like the weights."""

    def __init__(self, model: nnx.Module, config: LoraConfig, rngs: nnx.Rngs):
        self.config = config
        for name in config.targets:
            weight = getattr(model, name)
            axes = variable_axes(weight) or (None,) * weight.ndim
            n_in = INPUT_AXES[name]
            layers, ins, outs = weight.shape[0], weight.shape[1:1 + n_in], weight.shape[1 + n_in:]
            # PEFT's initialisation: A uniform within 1/sqrt(fan-in), B = 0.
            bound = 1.0 / math.sqrt(math.prod(ins))
            a = jax.random.uniform(rngs.params(), (layers, *ins, config.rank), ADAPTER_DTYPE,
                                   -bound, bound)
            b = jnp.zeros((layers, config.rank, *outs), ADAPTER_DTYPE)
            a_axes, b_axes = (axes[0], *axes[1:1 + n_in], None), (axes[0], None, *axes[1 + n_in:])
            setattr(self, f'{name}_a', LoraParam(a, out_sharding=a_axes, eager_sharding=False))
            setattr(self, f'{name}_b', LoraParam(b, out_sharding=b_axes, eager_sharding=False))

    def factors(self) -> dict[str, tuple[jax.Array, jax.Array]]:
        """target -> (A, B), each stacked over layers."""
        return {name: (getattr(self, f'{name}_a')[...], getattr(self, f'{name}_b')[...])
                for name in self.config.targets}

    def scan_inputs(self, num_layers: int) -> dict:
        """What the Decoder's layer scan slices per layer: the factors, and a dropout key each."""
        xs = {'factors': self.factors()}
        if hasattr(self, 'dropout_key'):
            xs['dropout_keys'] = jax.random.split(self.dropout_key[...], num_layers)
        return xs


def project(name: str, equation: str, x: jax.Array, weight: jax.Array, lora: dict,
            config: LoraConfig | None, output_major: bool = False) -> jax.Array:
    """x W for one layer's projection `name`, plus the adapter's s (dropout(x) A) B when it has one.

    `lora` is one layer's slice of `Adapters.scan_inputs` ({} without adapters); `output_major`:
    the weight is laid out output axes first (layers.output_major; a decode on CPU)."""
    y = layers.linear(equation, x, weight, output_major)
    if name not in lora.get('factors', {}):
        return y
    a, b = lora['factors'][name]
    if 'dropout_keys' in lora:
        key = jax.random.fold_in(lora['dropout_keys'], TARGETS.index(name))
        keep = jax.random.bernoulli(key, 1.0 - config.dropout, x.shape)
        x = jnp.where(keep, x / (1.0 - config.dropout), 0).astype(x.dtype)
    u = jnp.tensordot(x, a.astype(x.dtype), axes=INPUT_AXES[name])  # [..., rank]
    u = u * jnp.asarray(config.scale, x.dtype)
    return y + _up(u, b.astype(x.dtype)).astype(y.dtype)


@jax.custom_vjp
def _up(u: jax.Array, b: jax.Array) -> jax.Array:
    """u B: the adapter's up-projection of u [..., rank] by B [rank, out...]."""
    return jnp.tensordot(u, b, axes=1)


def _up_fwd(u, b):
    return _up(u, b), (u, b)


def _up_bwd(residuals, dy):
    """B's gradient u^T dy with u^T laid out [rank, tokens] first, behind an optimization
    barrier. Autodiff's own dot (u contracted on its token axis) let XLA's CPU backend lay the
    large dy [tokens, out] out transposed instead, a strided copy fused into the op that makes
    dy, in every adapted layer: SmolLM2's LoRA backward took 1.7x as long (bench/README.md)."""
    u, b = residuals
    batch = tuple(range(u.ndim - 1))
    du = jnp.tensordot(dy, b, axes=(tuple(range(u.ndim - 1, dy.ndim)), tuple(range(1, b.ndim))))
    ut = jax.lax.optimization_barrier(jnp.moveaxis(u, -1, 0))       # [rank, batch...]
    db = jnp.tensordot(ut, dy, axes=(tuple(range(1, u.ndim)), batch))  # [rank, out...]
    return du, db


_up.defvjp(_up_fwd, _up_bwd)


# --- attaching, finding, merging -------------------------------------------------------------

def with_adapters(model: nnx.Module, config: LoraConfig, seed: int = 0) -> nnx.Module:
    """A copy of `model` (sharing its weights) with fresh adapters on `config.targets`.

    The base is held in the compute dtype (bf16 on TPU): it is never updated, so it needs no
    f32 master copy. `model` itself is left as it was.
    """
    if has_adapters(model):
        raise ValueError('with_adapters: the model already has adapters')
    mlp = [t for t in config.targets if t in ('gate', 'up', 'down')]
    if mlp and any(model.config.sparse_layers):
        raise ValueError(f'LoraConfig.targets={config.targets!r}: {", ".join(mlp)} are not '
                         f'adaptable on a mixture of experts; expected attention projections '
                         f"only, e.g. ('q', 'k', 'v', 'o')")
    adapted = nnx.merge(*nnx.split(model), copy=True)  # new Variables over the same arrays
    c = adapted.config
    if c.param_dtype != c.dtype:
        compute = jnp.dtype(c.dtype)
        for variable in jax.tree.leaves(nnx.state(adapted, nnx.Param),
                                        is_leaf=lambda x: isinstance(x, nnx.Variable)):
            variable.set_value(variable[...].astype(compute))
        adapted.config = c.replace(param_dtype=c.dtype)
    adapted.adapters = Adapters(adapted, config, nnx.Rngs(params=seed))
    return adapted


def has_adapters(model: nnx.Module) -> bool:
    return isinstance(getattr(model, 'adapters', None), Adapters)


def trainable(model: nnx.Module):
    """The nnx filter of what the learner trains: the adapters when there are, else every Param."""
    return LoraParam if has_adapters(model) else nnx.Param


def set_dropout_key(model: nnx.Module, key: jax.Array) -> None:
    """Turns adapter dropout on for this (traced) model's forward passes, with `key`; sampling
    and scoring models have no key and so no dropout."""
    if has_adapters(model) and model.adapters.config.dropout > 0:
        model.adapters.dropout_key = LoraDropoutKey(key)  # a new Variable: this trace's own


def merged(model: nnx.Module) -> nnx.Module:
    """A copy of an adapted `model` without adapters, each target weight W + s A B (base dtype).

    The copy shares every untargeted weight with `model`; each merged weight is a new array."""
    copy = nnx.merge(*nnx.split(model), copy=True)  # new Variables over the same arrays
    adapters = copy.adapters
    del copy.adapters
    weights = {name: getattr(copy, name)[...] for name in adapters.config.targets}
    for name, w in _merged_weights(weights, adapters.factors(), adapters.config.scale).items():
        getattr(copy, name).set_value(w)
    return copy


@jax.jit
def _merged_weights(weights: dict, factors: dict, scale: float) -> dict:
    def one(w, a, b):
        delta = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(a, b)  # per layer: A B
        return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
    return {name: one(w, *factors[name]) for name, w in weights.items()}
