"""Trained LoRA adapters in HF PEFT's format, which `peft.PeftModel.from_pretrained` loads onto
the transformers base model: adapter_config.json + adapter_model.safetensors.

PEFT keeps, per adapted linear, `lora_A.weight` [r, in] and `lora_B.weight` [out, r] and adds
(lora_alpha / r) * B A x, so our A [layers, in..., r] and B [layers, r, out...] are flattened per
layer (inputs and outputs in the order the HF weights flatten them, see checkpoints/hf.py) and
transposed. Names are those `PeftModel.save_pretrained` writes:
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxprefix import storage
from jaxprefix.checkpoints.hf import layer_table, read_safetensors, write_safetensors
from jaxprefix.models import lora

ADAPTER_CONFIG = 'adapter_config.json'
ADAPTER_WEIGHTS = 'adapter_model.safetensors'


def peft_module_names(model) -> dict[str, str]:
    """Our target name -> the HF module path under a layer (q -> self_attn.q_proj)."""
    table = layer_table(model.config)
    return {name: table[name][0].removesuffix('.weight') for name in model.adapters.config.targets}


def peft_tensors(model) -> dict[str, np.ndarray]:
    """The adapters of `model` under PEFT's names and layouts (numpy, f32)."""
    if not lora.has_adapters(model):
        raise ValueError('peft_tensors: the model has no adapters (train.lora_rank is 0)')
    rank = model.adapters.config.rank
    modules = peft_module_names(model)
    out = {}
    for name, (a, b) in model.adapters.factors().items():
        a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
        for i in range(a.shape[0]):
            prefix = f'base_model.model.model.layers.{i}.{modules[name]}'
            out[f'{prefix}.lora_A.weight'] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
            out[f'{prefix}.lora_B.weight'] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
    return out


def adapter_config(model, base_model_name_or_path: str = '') -> dict:
    """PEFT's LoraConfig of `model`'s adapters (plain LoRA: no rsLoRA, DoRA or biases)."""
    c = model.adapters.config
    return {
        'peft_type': 'LORA', 'task_type': 'CAUSAL_LM',
        'base_model_name_or_path': base_model_name_or_path or None,
        'r': c.rank, 'lora_alpha': c.alpha, 'lora_dropout': c.dropout,
        'target_modules': sorted(m.split('.')[-1] for m in peft_module_names(model).values()),
        'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
        'init_lora_weights': True, 'modules_to_save': None, 'inference_mode': True,
    }


def save_peft_adapter(model, path, base_model_name_or_path: str = '', dtype=None) -> str:
    """Writes `model`'s adapters as a PEFT adapter directory at `path` (local or gs://; the
    config last, so a cut-off write has none), in `dtype` (None: f32); returns the path."""
    tensors = peft_tensors(model)
    if dtype is not None:
        tensors = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in tensors.items()}
    write_safetensors(storage.join(path, ADAPTER_WEIGHTS), tensors)
    storage.write_json(storage.join(path, ADAPTER_CONFIG),
                       adapter_config(model, base_model_name_or_path), indent=2)
    return str(path)


def load_peft_adapter(model, path):
    """A copy of `model` (sharing its weights) carrying the PEFT adapter at `path`: the inverse
    of save_peft_adapter, for adapters of the targets and layouts it writes (plain LoRA)."""
    config = storage.read_json(storage.join(path, ADAPTER_CONFIG))
    if config.get('peft_type') != 'LORA' or config.get('use_dora') or config.get('use_rslora'):
        raise ValueError(f'{path}: a plain LoRA adapter expected (peft_type LORA, no DoRA or '
                         f'rsLoRA), got {config.get("peft_type")!r}')
    table = layer_table(model.config)
    by_module = {table[name][0].removesuffix('.weight').split('.')[-1]: name
                 for name in lora.TARGETS if name in table}
    unknown = sorted(set(config['target_modules']) - set(by_module))
    if unknown:
        raise ValueError(f'{path}: target_modules {unknown}: expected among {sorted(by_module)}')
    targets = tuple(by_module[m] for m in config['target_modules'])
    adapted = lora.with_adapters(model, lora.LoraConfig(
        int(config['r']), alpha=float(config['lora_alpha']), targets=targets))
    tensors = read_safetensors(storage.join(path, ADAPTER_WEIGHTS))
    modules = peft_module_names(adapted)
    for name, (a, b) in adapted.adapters.factors().items():
        layers = [f'base_model.model.model.layers.{i}.{modules[name]}' for i in range(a.shape[0])]
        new_a = np.stack([tensors[f'{p}.lora_A.weight'].T.reshape(a.shape[1:]) for p in layers])
        new_b = np.stack([tensors[f'{p}.lora_B.weight'].T.reshape(b.shape[1:]) for p in layers])
        getattr(adapted.adapters, f'{name}_a').set_value(jnp.asarray(new_a, a.dtype))
        getattr(adapted.adapters, f'{name}_b').set_value(jnp.asarray(new_b, b.dtype))
    return adapted
