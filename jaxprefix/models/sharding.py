"""Logical axis names -> mesh axes ('data', 'fsdp', 'tensor').

There is no expert axis of its own: a MoE's experts split over every axis (RULES), which are
'rows', 'model dimension' and 'heads' to the rest of the model (moe.dispatch explains why).

Every parameter carries its logical axis names in the nnx metadata key `out_sharding` (the
flax 0.12.8 name; it was `sharding` and then `sharding_names` earlier in 2026). One RULES table
maps names to mesh axes; a mesh axis that does not divide a dimension (3 KV heads over
tensor=4) is dropped for that array, which then stays replicated along it.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

METADATA_KEY = 'out_sharding'
MESH_AXES = ('data', 'fsdp', 'tensor')

# Parameters: FSDP shards the model dimension, tensor parallelism heads / MLP / vocabulary.
# Activations: batch over data and fsdp.
RULES: dict[str, tuple[str, ...]] = {
    'vocab': ('tensor',),
    'embed': ('fsdp',),
    'mlp': ('tensor',),
    # A MoE's experts: expert parallel over every axis (moe.dispatch), whole experts on each
    # chip. The decode ('data' rows, 'tensor' heads) then reads each expert on one chip; the
    # learner's FSDP ('fsdp') exchanges tokens instead of gathering every layer's experts
    # (128 of them, 1.2 GB in bf16, gathered again in the backward). Where the experts do not
    # split over 'fsdp', it shards their model dimension ('embed') as every weight's.
    'expert': ('data', 'fsdp', 'tensor'),
    'heads': ('tensor',),
    'kv_heads': ('tensor',),
    'head_dim': (),
    'layers': (),
    'norm': (),
    'batch': ('data', 'fsdp'),
    'length': (),
    'act_embed': (),
    'act_heads': ('tensor',),
    'act_mlp': ('tensor',),
    'act_vocab': ('tensor',),
}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh; one size may be -1 to take the remaining devices.

    On several slices (devices with distinct `slice_index`: a multi-slice TPU job), the sizes
    are those of one slice and 'data' also spans the slices, over the data-centre network
    (as jax.experimental.mesh_utils.create_hybrid_device_mesh lays it out): data parallelism is
    the one axis whose traffic (a gradient all-reduce per update) DCN bandwidth can carry.
    """
    devices = list(jax.devices() if devices is None else devices)
    slices = len({getattr(d, 'slice_index', 0) for d in devices})
    per_slice = len(devices) // slices
    count = f'{per_slice} devices' + (f' in each of {slices} slices' if slices > 1 else '')
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f'make_mesh: at most one axis may be -1, got data={data} fsdp={fsdp} '
                         f'tensor={tensor}')
    known = math.prod(s for s in sizes if s != -1)
    if any(s == 0 or s < -1 for s in sizes) or per_slice % known:
        raise ValueError(f'make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} does not divide '
                         f'the {count}')
    sizes = [per_slice // known if s == -1 else s for s in sizes]
    if math.prod(sizes) != per_slice:
        raise ValueError(f'make_mesh: data x fsdp x tensor = {math.prod(sizes)} but there are '
                         f'{count}')
    if slices == 1:
        return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)
    grid = mesh_utils.create_hybrid_device_mesh(sizes, (slices, 1, 1), devices)
    return Mesh(grid, MESH_AXES)


def split_meshes(sampler_devices: int, devices=None, **axes) -> tuple[Mesh, Mesh | None]:
    """(the learner's mesh, the sampler's) when the sampler holds the last `sampler_devices`
    devices (rollout.devices; 0: none of its own, it shares the learner's): the learner's axes
    (`axes`, config.mesh) lay out the devices left, the sampler's hold rows ('data')."""
    devices = list(jax.devices() if devices is None else devices)
    if not sampler_devices:
        return make_mesh(**axes, devices=devices), None
    if not 0 < sampler_devices < len(devices):
        raise ValueError(f'rollout.devices={sampler_devices}: expected fewer than the '
                         f'{len(devices)} devices, the learner needs the rest (0: shared)')
    learner = devices[:len(devices) - sampler_devices]
    try:
        return (make_mesh(**axes, devices=learner),
                make_mesh(data=-1, devices=devices[len(learner):]))
    except ValueError as e:
        raise ValueError(f'rollout.devices={sampler_devices} leaves the learner '
                         f'{len(learner)} devices: {e}') from None


def logical_spec(names: Sequence[str | None], shape: Sequence[int] | None = None,
                 mesh_shape: dict[str, int] | None = None) -> PartitionSpec:
    """PartitionSpec of an array with these logical axis names under RULES.

    Given `shape` and `mesh_shape`, mesh axes absent from the mesh, already used, or not
    dividing their dimension are dropped.
    """
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        if name is not None and name not in RULES:
            raise ValueError(f'logical axis {name!r} has no entry in sharding.RULES')
        axes = []
        size = 1
        for axis in RULES.get(name, ()) if name else ():
            if axis in used:
                continue
            if mesh_shape is not None:
                n = mesh_shape.get(axis)
                if n is None or (shape is not None and shape[i] % (size * n)):
                    continue
                size *= n
            axes.append(axis)
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*spec)


def variable_axes(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    return variable.get_metadata().get(METADATA_KEY)


def param_shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """NamedSharding of every variable of `model`, from its logical axis names."""
    return state_shardings(nnx.state(model), mesh)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
    """NamedSharding of every variable of an nnx State (a part of a model's), by logical axes."""
    mesh_shape = dict(mesh.shape)

    def one(variable):
        axes = variable_axes(variable) or (None,) * len(variable.shape)
        return NamedSharding(mesh, logical_spec(axes, variable.shape, mesh_shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Places every parameter of `model` on `mesh` by its logical axes (in place; returns it)."""
    is_variable = lambda x: isinstance(x, nnx.Variable)
    placed = jax.tree.map(lambda v, s: v.replace(jax.device_put(v[...], s)),
                          nnx.state(model), param_shardings(model, mesh), is_leaf=is_variable)
    nnx.update(model, placed)
    return model


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Sharding constraint by logical names under the mesh set with jax.set_mesh; else a no-op."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return x
    spec = logical_spec(names, x.shape, dict(mesh.shape))
    return jax.lax.with_sharding_constraint(x, spec)


def constrain_params(tree):
    """Sharding constraint on the nnx Variables of a tree (parameters, their gradients, an optax
    state, whose moments are Variables too) by their logical axes, under the mesh set with
    jax.set_mesh; other leaves and everything without a mesh are left alone. Arrays computed
    from no sharded input (zeros of Adam's moments, a gradient accumulator) would otherwise be
    whole on every device: Qwen3-4B's f32 moments alone are 32 GiB."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not set(MESH_AXES) <= set(mesh.axis_names):
        return tree
    mesh_shape = dict(mesh.shape)

    def one(variable):
        if not isinstance(variable, nnx.Variable):
            return variable
        axes = variable_axes(variable) or (None,) * variable.ndim
        spec = logical_spec(axes, variable.shape, mesh_shape)
        return variable.replace(jax.lax.with_sharding_constraint(variable[...], spec))
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

