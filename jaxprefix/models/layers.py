"""Pure building blocks of a decoder layer: RMSNorm, rotary embeddings, gated MLP, projections,
softcapping.

They take weights as arrays (the Decoder keeps them stacked over layers and scans), and match
transformers' numerics in f32: norms and rotary angles are computed in f32.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxprefix.models.config import Rope


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, plus_one: bool = False) -> jax.Array:
    """x / rms(x) * w (Llama/Qwen) or * (1 + w) (Gemma), over the last axis, in f32."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32)
    return (y * (1.0 + w if plus_one else w)).astype(x.dtype)


def inverse_frequencies(rope: Rope, head_dim: int) -> np.ndarray:
    """Per-pair rotation frequencies [head_dim // 2], with linear or Llama 3.1 scaling."""
    inv = 1.0 / (rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv = inv.astype(np.float32)
    if rope.kind == 'linear':
        return (inv / rope.factor).astype(np.float32)
    if rope.kind == 'llama3':
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate in between.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = ((rope.original_max_position / wavelen - rope.low_freq_factor)
                  / (rope.high_freq_factor - rope.low_freq_factor))
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim // 2] of each position."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates x [B, T, H, Dh] by position; halves convention (transformers' rotate_half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def activation_fn(name: str):
    if name == 'silu':
        return jax.nn.silu
    if name == 'gelu_tanh':
        return lambda x: jax.nn.gelu(x, approximate=True)
    raise ValueError(f"unknown activation {name!r}: expected 'silu' or 'gelu_tanh'")


def gated_mlp(x: jax.Array, project, activation: str) -> jax.Array:
    """down(act(gate(x)) * up(x)); `project(name, equation, x)` applies one weight [D, F] / [F, D]
    (the Decoder's, with its adapter when it has one)."""
    hidden = activation_fn(activation)(project('gate', 'btd,df->btf', x))
    return project('down', 'btf,fd->btd', hidden * project('up', 'btd,df->btf', x))


def output_major(weight: jax.Array, inputs: int) -> jax.Array:
    """`weight` with its `inputs` leading (contracted) axes moved last: [out..., in...]."""
    return jnp.moveaxis(weight, tuple(range(inputs)), tuple(range(-inputs, 0)))


def einsum_output_major(equation: str, x: jax.Array, weight: jax.Array,
                        preferred_element_type=None) -> jax.Array:
    """jnp.einsum(equation, x, W) for W given output-major (`output_major`): computed with the
    weight as the dot's left operand and its output axes leading the result, the layout in
    which XLA's CPU dot (YNNPACK) runs a decode step's few rows fastest (8 rows: 1.6x)."""
    operands, out = equation.split('->')
    x_axes, w_axes = operands.split(',')
    contracted = ''.join(a for a in w_axes if a in x_axes and a not in out)
    w_out = ''.join(a for a in w_axes if a not in contracted)
    x_out = ''.join(a for a in x_axes if a not in contracted)
    y = jnp.einsum(f'{w_out}{contracted},{x_axes}->{w_out}{x_out}', weight, x,
                   preferred_element_type=preferred_element_type)
    return jnp.einsum(f'{w_out}{x_out}->{out}', y)


def linear(equation: str, x: jax.Array, weight: jax.Array, output_major: bool = False,
           f32_result: bool = False) -> jax.Array:
    """jnp.einsum(equation, x, W) in x's dtype (a layer's projection), or in f32 with
    `f32_result` (the unembedding's logits). Below f32 its dots, forward and backward, take
    their inputs in x's dtype and accumulate into an f32 result: XLA's CPU dots run bf16 inputs
    fast (AMX, YNNPACK) only into an f32 result, and into a bf16 one, or against an f32 operand,
    slower than f32 dots (SmolLM2 with LoRA, 8 x 256 tokens: forward 2.99 -> 1.68 s, backward
    11.67 -> 8.48 s; bench/README.md). TPU's MXU accumulates in f32 either way. `output_major`:
    W laid out output-major (einsum_output_major; a decode on CPU, never differentiated)."""
    if output_major:
        y = einsum_output_major(equation, x, weight, preferred_element_type=jnp.float32)
        return y if f32_result else y.astype(x.dtype)
    if x.dtype == jnp.float32:
        return jnp.einsum(equation, x, weight)
    return _accumulated_in_f32(equation, f32_result, x, weight)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _accumulated_in_f32(equation: str, f32_result: bool, x: jax.Array,
                        weight: jax.Array) -> jax.Array:
    y = jnp.einsum(equation, x, weight, preferred_element_type=jnp.float32)
    return y if f32_result else y.astype(x.dtype)


def _accumulated_fwd(equation, f32_result, x, weight):
    return _accumulated_in_f32(equation, f32_result, x, weight), (x, weight)


def _accumulated_bwd(equation, f32_result, residuals, dy):
    """The two transposed dots with dy in x's dtype (an f32 result's cotangent rounded to it,
    as a bf16 autocast's backward takes it), each into f32. Autodiff's own would dot an f32
    cotangent against the bf16 operand: a mixed dot, the slow path again. The equation's axes
    each appear in two of its three operands (a projection)."""
    x, weight = residuals
    dy = dy.astype(x.dtype)
    operands, out = equation.split('->')
    x_axes, w_axes = operands.split(',')
    dx = jnp.einsum(f'{out},{w_axes}->{x_axes}', dy, weight, preferred_element_type=jnp.float32)
    dw = jnp.einsum(f'{x_axes},{out}->{w_axes}', x, dy, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_accumulated_in_f32.defvjp(_accumulated_fwd, _accumulated_bwd)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma's logit softcapping); identity when cap is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap
