"""The weights' layout for decoding: tensor parallel over the chips that train with FSDP.

The learner shards the model dimension over 'fsdp' (and rows over 'data'): every decode step
under that layout all-gathers every layer's weights, so sampling would read (and move over ICI)
the whole model per token. Decode reads each weight once per step and is bandwidth-bound, so
the sampler lays the same devices out as ('data', 1, 'tensor'): heads, KV heads, MLP and
vocabulary split over 'tensor' (sharding.RULES), rows over 'data'. Each chip then reads 1 /
tensor of the weights and of every row's KV (its own KV heads) per step, and a layer's only
traffic is two all-reduces of the rows' activations. The reshard is one jitted program per
call of generate (once per RL step), compiled and costed like the others.
"""
from __future__ import annotations

import math

import jax
import numpy as np

from jaxprefix.models import backend
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.sharding import make_mesh, param_shardings


def auto_tensor_parallel(config: ModelConfig, devices: int) -> int:
    """The widest tensor parallelism that splits the KV heads and query heads evenly."""
    return max(t for t in range(1, devices + 1)
               if devices % t == 0 and config.num_kv_heads % t == 0 and config.num_heads % t == 0)


def decode_mesh(mesh: jax.sharding.Mesh, config: ModelConfig, tensor: int,
                platform: str) -> jax.sharding.Mesh:
    """The mesh the sampler decodes on: `tensor` devices of `mesh` split the heads (0: the
    widest that divides them on TPU, the learner's own layout elsewhere), the rest hold rows."""
    devices = mesh.devices.size
    if tensor == 0:
        if not backend.tensor_parallel_by_default(platform):
            return mesh
        tensor = auto_tensor_parallel(config, devices)
    if devices % tensor or config.num_kv_heads % tensor or config.num_heads % tensor:
        raise ValueError(f'rollout.tensor_parallel={tensor}: expected a divisor of the '
                         f'{devices} devices and of the model\'s {config.num_kv_heads} KV heads '
                         f'and {config.num_heads} query heads (0: automatic)')
    shape = dict(mesh.shape)
    if shape.get('tensor') == tensor and math.prod(shape.values()) // tensor == shape.get('data'):
        return mesh
    # Same devices, same order: the reshard moves only what the new layout needs elsewhere.
    return make_mesh(data=devices // tensor, fsdp=1, tensor=tensor,
                     devices=list(np.asarray(mesh.devices).reshape(-1)))


def decode_layout(mesh: jax.sharding.Mesh, config: ModelConfig, tensor: int) -> jax.sharding.Mesh:
    """decode_mesh for a run's mesh on its own devices' platform (rollout.tensor_parallel)."""
    return decode_mesh(mesh, config, tensor, mesh.devices.flat[0].platform)


def reshard(model, mesh: jax.sharding.Mesh):
    """The jitted program that lays `model`'s parameters (nnx.split's state) out for `mesh`."""
    return jax.jit(lambda params: params, out_shardings=param_shardings(model, mesh))
