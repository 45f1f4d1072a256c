"""The export job: a trained workdir's policy as an ordinary HF model directory.

    python -m jaxprefix.main --config=configs/pope.py:paper --config.job=export \
        --workdir=gs://BUCKET/pope [--config.export.dtype=bfloat16]

Loads the policy the run started from (config.model), puts the workdir's latest RL checkpoint
into it (the base itself when there is none), and writes <workdir>/export/ (local or gs://):
model.safetensors in `export.dtype` (default the parameter dtype), config.json, the tokenizer's
files and chat template, and generation_config.json, as transformers writes them, so vLLM,
lm-eval and the Hub take it as it is. config.json is written last: an export that was cut off
has none and is not mistaken for a model. A LoRA run (train.lora_rank > 0) exports the base with
its adapters folded in there, and the adapters alone to <workdir>/export/adapter/ in PEFT's
format (`peft.PeftModel.from_pretrained(base, path)`).
"""
from __future__ import annotations

import jax
from absl import logging
from flax import nnx

from jaxprefix.checkpoints.hf import save_pretrained
from jaxprefix import distributed, models, storage
from jaxprefix.errors import CheckpointError
from jaxprefix.models import lora

EXPORT_DIR = "export"
ADAPTER_DIR = "adapter"


def export_dir(workdir: str) -> str:
    return storage.join(workdir, EXPORT_DIR)


def run_export(config, workdir: str) -> str:
    """Writes the workdir's trained policy (its latest checkpoint, or export.step's) to
    <workdir>/export/; returns that path."""
    from jaxprefix.checkpoints.peft import save_peft_adapter
    from jaxprefix.run_setup.policy import FLOAT_DTYPES, load_policy
    from jaxprefix.rl.loop import load_trained, restore_trained
    from jaxprefix.run_setup.learner_settings import lora_config, train_config

    dtype = config.export.dtype or None
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ValueError(f"config.export.dtype={dtype!r}: expected '' (the parameter dtype) or "
                         f"one of {FLOAT_DTYPES}")
    policy = load_policy(config, workdir)
    mesh = models.make_mesh(**config.mesh)
    models.shard_model(policy.model, mesh)
    try:
        step, trained = restore_trained(policy.model, workdir, train_config(config),
                                        lora_config(config), mesh,
                                        step=config.export.step or None)
    except CheckpointError as e:
        raise CheckpointError(f"config.export.step={config.export.step}: {e}") from None
    if step is not None:
        load_trained(policy.model, trained)
    adapters = trained.adapters if lora.has_adapters(trained) else None
    if jax.process_count() > 1:  # every host gathers the shards it lacks; process 0 writes
        from jax.experimental import multihost_utils

        for module in (policy.model, adapters):
            if module is not None:
                nnx.update(module, jax.tree.map(
                    lambda x: multihost_utils.process_allgather(x, tiled=True), nnx.state(module)))
    path = export_dir(workdir)
    if distributed.is_primary():
        if adapters is not None:
            save_peft_adapter(trained, storage.join(path, ADAPTER_DIR),
                              base_model_name_or_path=config.model.path)
        save_pretrained(policy.model, None, path, dtype=dtype, tokenizer=policy.tokenizer)
    logging.info("exported %s (step %s) to %s", "the base policy" if step is None else "the policy",
                 step, path)
    return path
