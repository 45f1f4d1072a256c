"""HF checkpoint directories (config.json + safetensors, single or sharded) <-> Decoder.

`load_hf_state` is the shared path: GGUF import converts to HF-named numpy tensors and calls it
too. The Decoder keeps layer weights stacked ([layers, ...]) with projections split per head,
so each HF tensor is transposed / reshaped and stacked here. Safetensors are read and written
by a small reader of the format (8-byte header size, JSON header, raw little-endian data), so
bf16 works through ml_dtypes and a truncated file is reported precisely. Directories may be local
or on gs:// (jaxprefix.storage): a remote safetensors file is read from a local copy in the cache
directory (memory-mapped), and every file is written whole, config.json last, so a directory whose
config.json exists is complete.
"""
from __future__ import annotations

import json
import math
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from jaxprefix import storage
from jaxprefix.checkpoints import gguf
from jaxprefix.models import sharding
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.decoder import Decoder, stacked_layers

_DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
           'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32, 'I16': np.int16,
           'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


# --- safetensors ---------------------------------------------------------------------------

def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as numpy arrays (memory-mapped; a remote file from its
    local copy in the cache directory)."""
    local = storage.local_copy(path)
    size = storage.size(local)
    with open(local, 'rb') as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f'{path}: truncated safetensors file ({size} bytes, no header)')
        (n,) = struct.unpack('<Q', head)
        if 8 + n > size:
            raise ValueError(f'{path}: truncated safetensors file: header of {n} bytes but the file '
                             f'has {size}')
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f'{path}: safetensors header is not valid JSON ({e})') from None
    header.pop('__metadata__', None)
    data = np.memmap(local, dtype=np.uint8, mode='r', offset=8 + n) if size > 8 + n else None
    out = {}
    for name, info in header.items():
        if info['dtype'] not in _DTYPES:
            raise ValueError(f'{path}: tensor {name!r} has unsupported dtype {info["dtype"]}')
        start, end = info['data_offsets']
        if 8 + n + end > size:
            raise ValueError(f'{path}: truncated safetensors file: tensor {name!r} ends at byte '
                             f'{8 + n + end} but the file has {size}')
        raw = data[start:end] if end > start else np.zeros(0, np.uint8)
        out[name] = raw.view(_DTYPES[info['dtype']]).reshape(info['shape'])
    return out


def write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """One .safetensors file (local or gs://), streamed tensor by tensor (no copy of the whole
    model in memory), replacing `path` as a whole: another process that reads or maps the old
    file meanwhile keeps it intact. A reader trusts it once config.json is written after it."""
    header, offset = {'__metadata__': {'format': 'pt'}}, 0
    arrays = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
    for name, a in arrays.items():
        header[name] = {'dtype': _NAMES[a.dtype], 'shape': list(a.shape),
                        'data_offsets': [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header).encode()
    blob += b' ' * (-len(blob) % 8)  # data starts 8-byte aligned
    with storage.open_atomic(path) as f:
        f.write(struct.pack('<Q', len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(a.reshape(-1).view(np.uint8).data if a.size else b'')


# --- name and layout mapping ---------------------------------------------------------------

def layer_table(config: ModelConfig) -> dict[str, tuple[str, int]]:
    """Decoder layer weight -> (HF name under model.layers.{i}., input axes of a linear or 0).

    A name with {j} is one tensor per expert j, stacked along the Decoder weight's expert axis."""
    gemma = config.sandwich_norms
    table = {
        'attn_norm': ('input_layernorm.weight', 0),
        'q': ('self_attn.q_proj.weight', 1), 'k': ('self_attn.k_proj.weight', 1),
        'v': ('self_attn.v_proj.weight', 1), 'o': ('self_attn.o_proj.weight', 2),
        'mlp_norm': ('pre_feedforward_layernorm.weight' if gemma
                     else 'post_attention_layernorm.weight', 0),
        'gate': ('mlp.gate_proj.weight', 1), 'up': ('mlp.up_proj.weight', 1),
        'down': ('mlp.down_proj.weight', 1),
        'q_bias': ('self_attn.q_proj.bias', 0), 'k_bias': ('self_attn.k_proj.bias', 0),
        'v_bias': ('self_attn.v_proj.bias', 0), 'o_bias': ('self_attn.o_proj.bias', 0),
        'q_norm': ('self_attn.q_norm.weight', 0), 'k_norm': ('self_attn.k_norm.weight', 0),
        'post_attn_norm': ('post_attention_layernorm.weight', 0),
        'post_mlp_norm': ('post_feedforward_layernorm.weight', 0),
        'router': ('mlp.gate.weight', 1),
        'expert_gate': ('mlp.experts.{j}.gate_proj.weight', 1),
        'expert_up': ('mlp.experts.{j}.up_proj.weight', 1),
        'expert_down': ('mlp.experts.{j}.down_proj.weight', 1),
        'shared_gate': ('mlp.shared_expert.gate_proj.weight', 1),
        'shared_up': ('mlp.shared_expert.up_proj.weight', 1),
        'shared_down': ('mlp.shared_expert.down_proj.weight', 1),
        'shared_expert_gate': ('mlp.shared_expert_gate.weight', 1),
    }
    return table


def _top_table(config: ModelConfig) -> dict[str, str]:
    table = {'embed': 'model.embed_tokens.weight', 'final_norm': 'model.norm.weight'}
    if not config.tie_word_embeddings:
        table['lm_head'] = 'lm_head.weight'
    return table


def _from_hf_layout(w: np.ndarray, in_axes: int, shape: tuple[int, ...]) -> np.ndarray:
    # HF linears are [out, in]; the Decoder keeps [in..., out...] split per head.
    return (w.T if in_axes else w).reshape(shape)


def _to_hf_layout(w: np.ndarray, in_axes: int) -> np.ndarray:
    if not in_axes:
        return w.reshape(-1)
    return w.reshape(math.prod(w.shape[:in_axes]), -1).T


# --- loading -------------------------------------------------------------------------------

def _place(array: np.ndarray, variable: nnx.Variable, mesh) -> jax.Array:
    """Device array of `variable`'s dtype; sharded by its logical axes when a mesh is given,
    so each device receives only its shard."""
    array = np.asarray(array).astype(variable.dtype, copy=False)
    if mesh is None:
        return jnp.asarray(array)
    axes = sharding.variable_axes(variable) or (None,) * array.ndim
    spec = sharding.logical_spec(axes, array.shape, dict(mesh.shape))
    target = jax.sharding.NamedSharding(mesh, spec)
    # Each device (on every host) copies only its own slice of the host array.
    return jax.make_array_from_callback(array.shape, target, lambda index: array[index])


def load_hf_state(hf_config: dict, tensors: dict[str, np.ndarray], dtype=jnp.float32, *,
                  param_dtype=None, mesh=None,
                  source: str = 'checkpoint') -> tuple[Decoder, ModelConfig]:
    """A Decoder holding HF-named weights `tensors` ({name: array}) of an HF config dict.

    `dtype` is the compute dtype; `param_dtype` the dtype the weights are stored (and trained)
    in, by default `dtype`. With `mesh` (or under jax.set_mesh), every parameter is placed with
    its target sharding. Errors name `source` and the tensor.
    """
    config = ModelConfig.from_hf(hf_config, param_dtype=param_dtype or dtype, dtype=dtype)
    if mesh is None:
        active = jax.sharding.get_mesh()
        mesh = None if active.empty else active
    # Shapes only; flax would read the logical names as mesh axes under an active mesh.
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        model = nnx.eval_shape(lambda: Decoder(config, nnx.Rngs(0)))

    def take(name: str, shape: tuple[int, ...], in_axes: int | None) -> np.ndarray:
        """HF tensor `name` in the Decoder layout `shape`; in_axes None means same layout."""
        if name not in tensors:
            raise ValueError(f'{source}: missing tensor {name!r}')
        w = np.asarray(tensors[name])
        if in_axes is None:
            expected = shape
        elif in_axes:
            expected = (math.prod(shape[in_axes:]), math.prod(shape[:in_axes]))
        else:
            expected = (math.prod(shape),)
        if tuple(w.shape) != expected:
            raise ValueError(f'{source}: tensor {name!r} has shape {tuple(w.shape)}, expected '
                             f'{expected}')
        return w if in_axes is None else _from_hf_layout(w, in_axes, shape)

    for ours, hf_name in _top_table(config).items():
        variable = getattr(model, ours)
        variable.set_value(_place(take(hf_name, tuple(variable.shape), None), variable, mesh))
    table = layer_table(config)
    def layer(i: int, hf_name: str, shape: tuple[int, ...], in_axes: int) -> np.ndarray:
        if '{j}' not in hf_name:
            return take(f'model.layers.{i}.{hf_name}', shape, in_axes)
        return np.stack([take(f'model.layers.{i}.{hf_name.format(j=j)}', shape[1:], in_axes)
                         for j in range(shape[0])])

    for ours in model.layer_names:
        hf_name, in_axes = table[ours]
        variable = getattr(model, ours)
        shape = tuple(variable.shape[1:])
        stacked = np.stack([layer(i, hf_name, shape, in_axes)
                            for i in stacked_layers(config, ours)])
        variable.set_value(_place(stacked, variable, mesh))
    return model, config


def _read_json(path: str, what: str) -> dict:
    if not storage.isfile(path):
        raise FileNotFoundError(f'{path}: missing {what}')
    return storage.read_json(path)


def read_hf_tensors(path) -> dict[str, np.ndarray]:
    """Every tensor of an HF directory: model.safetensors, or the shards its index names."""
    path = str(path)
    index = storage.join(path, 'model.safetensors.index.json')
    if storage.isfile(index):
        weight_map = _read_json(index, 'safetensors index').get('weight_map')
        if not isinstance(weight_map, dict):
            raise ValueError(f'{index}: expected a "weight_map" object of tensor name -> file')
        tensors = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = storage.join(path, shard)
            if not storage.isfile(shard_path):
                raise FileNotFoundError(f'{shard_path}: missing shard named in '
                                        f'model.safetensors.index.json')
            tensors.update(read_safetensors(shard_path))
        return tensors
    files = storage.glob(path, '*.safetensors')
    if not files:
        raise FileNotFoundError(f'{path}: no model.safetensors, *.safetensors or '
                                f'model.safetensors.index.json')
    tensors = {}
    for f in files:
        tensors.update(read_safetensors(f))
    return tensors


def from_pretrained(path, dtype=jnp.float32, *, param_dtype=None,
                    mesh=None) -> tuple[Decoder, ModelConfig]:
    """(model, config) from an HF directory (config.json + safetensors, local or gs://); see
    load_hf_state for the dtypes."""
    path = str(path)
    if not storage.isdir(path):
        raise FileNotFoundError(f'{path}: not a checkpoint directory (or it is empty)')
    hf_config = _read_json(storage.join(path, 'config.json'), 'config.json')
    return load_hf_state(hf_config, read_hf_tensors(path), dtype, param_dtype=param_dtype,
                         mesh=mesh, source=path)


# --- export --------------------------------------------------------------------------------

def hf_tensors(model: Decoder, dtype=None) -> dict[str, np.ndarray]:
    """The model's weights under HF names and layouts (numpy, in `dtype`, default the
    parameter dtype)."""
    config = model.config

    def host(variable) -> np.ndarray:
        array = np.asarray(jax.device_get(variable[...]))
        return array if dtype is None else array.astype(jnp.dtype(dtype))
    out = {}
    for ours, hf_name in _top_table(config).items():
        out[hf_name] = host(getattr(model, ours))
    table = layer_table(config)
    for ours in model.layer_names:
        hf_name, in_axes = table[ours]
        stacked = host(getattr(model, ours))
        for w, i in zip(stacked, stacked_layers(config, ours)):
            if '{j}' not in hf_name:
                out[f'model.layers.{i}.{hf_name}'] = _to_hf_layout(w, in_axes)
                continue
            for j, expert in enumerate(w):
                out[f'model.layers.{i}.{hf_name.format(j=j)}'] = _to_hf_layout(expert, in_axes)
    return out


def generation_config(config: ModelConfig) -> dict:
    """generation_config.json: the stop tokens (and pad) that generate() of transformers and
    vLLM read; sampling settings are left to them."""
    eos = list(config.eos_token_ids)
    out = {}
    if eos:
        out['eos_token_id'] = eos[0] if len(eos) == 1 else eos
    if config.bos_token_id is not None:
        out['bos_token_id'] = config.bos_token_id
    if config.pad_token_id is not None:
        out['pad_token_id'] = config.pad_token_id
    return out


def from_gguf(path, dtype=None, *, param_dtype=None, mesh=None):
    """(model, config) from a llama-architecture GGUF file, read as HF-named tensors
    (checkpoints/gguf.py) and loaded as load_hf_state loads them; dtype defaults to float32, and
    with `mesh` every parameter is placed with its target sharding."""
    hf_config, tensors = gguf.read_gguf(path)
    return load_hf_state(hf_config, tensors, jnp.float32 if dtype is None else dtype,
                         param_dtype=param_dtype, mesh=mesh, source=str(path))


def save_pretrained(model: Decoder, config: ModelConfig | None, path, *, dtype=None,
                    tokenizer=None) -> str:
    """Writes an HF directory (local or gs://) that from_pretrained, tokenizers.load and
    transformers read back with the same logits: model.safetensors in `dtype` (default the
    parameter dtype), the tokenizer's files (when given), generation_config.json, and
    config.json last, so a directory holding config.json is complete."""
    config = config or model.config
    if dtype is not None:
        config = config.replace(param_dtype=jnp.dtype(dtype).name)
    path = str(path)
    storage.makedirs(path)
    write_safetensors(storage.join(path, 'model.safetensors'), hf_tensors(model, dtype))
    if tokenizer is not None:
        tokenizer.save(path)
    storage.write_json(storage.join(path, 'generation_config.json'), generation_config(config),
                       indent=2)
    storage.write_json(storage.join(path, 'config.json'), config.to_hf(), indent=2)
    return path
