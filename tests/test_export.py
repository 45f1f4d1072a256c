"""The export job: a trained workdir's policy -> an HF directory that from_pretrained,
tokenizers.load and transformers read back (weights, tokenizer, chat template, stop tokens)."""
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tiny_checkpoints
from jaxprefix.checkpoints.hf import from_pretrained
from jaxprefix import run_config, storage, tokenizers
from jaxprefix.checkpoints.gguf import bundled_smollm2_path
from jaxprefix.checkpoints.hf import read_safetensors
from jaxprefix.checkpoints.train_state import TrainCheckpointer
from jaxprefix.jobs.export import run_export
from jaxprefix.run_setup.learner_settings import train_config
from jaxprefix.rl.train_step import Learner

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's real vocabulary and chat template (from its bundled GGUF)."""
    return tokenizers.load(bundled_smollm2_path())


@pytest.fixture(scope="module")
def base(tokenizer, tmp_path_factory):
    """A tiny random llama over SmolLM2's vocabulary, saved with its tokenizer."""
    return tiny_checkpoints.save_llama_over(tokenizer, tmp_path_factory.mktemp("base") / "base")


def export_config(base: str, dtype: str = ""):
    c = run_config.base_config()
    c.job = "export"
    c.model.update(source="hf", path=base)
    c.export.dtype = dtype
    return c


def trained_workdir(config, workdir: str) -> dict:
    """A workdir whose checkpoint holds weights moved away from the base; returns them."""
    model, _ = from_pretrained(config.model.path)
    learner = Learner(model, train_config(config))
    state = learner.init_state()
    state = state.replace(params=jax.tree.map(lambda x: x + 0.01 * jnp.sign(x), state.params))
    ckpt = TrainCheckpointer(storage.join(workdir, "checkpoints"))
    ckpt.save(3, {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}, {})
    ckpt.close()
    return {"/".join(str(k) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(state.params)}


def flat_params(model) -> dict:
    return {"/".join(str(k) for k in path): np.asarray(v)
            for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("where", ["local", "gs"])
def test_export_round_trips_through_from_pretrained_and_tokenizers_load(
        where, base, tokenizer, tmp_path, request):
    if where == "gs":
        request.getfixturevalue("gcs")
        workdir = f"gs://bucket/export-{os.getpid()}"
    else:
        workdir = str(tmp_path / "run")
    config = export_config(base)
    trained = trained_workdir(config, workdir)
    path = run_export(config, workdir)
    assert path == storage.join(workdir, "export")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= set(storage.listdir(path))
    model, _ = from_pretrained(path)
    exported = flat_params(model)
    assert exported.keys() == trained.keys()
    for name, value in trained.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    again = tokenizers.load(path)
    text = "Solve 12 * 7. <think>Let me see</think> The answer is \\boxed{84}."
    assert again.encode(text) == tokenizer.encode(text)
    assert (again.eos_id, again.bos_id, again.pad_id) == (tokenizer.eos_id, tokenizer.bos_id,
                                                         tokenizer.pad_id)
    assert again.apply_chat_template(MESSAGES, tokenize=True) == \
        tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    assert storage.read_json(storage.join(path, "generation_config.json"))["eos_token_id"] == \
        tokenizer.eos_id


def test_transformers_loads_the_export_with_our_logits(base, tokenizer, tmp_path):
    import torch
    import transformers

    workdir = str(tmp_path / "run")
    config = export_config(base)
    trained_workdir(config, workdir)
    path = run_export(config, workdir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True)
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits.numpy()
    ours, _ = from_pretrained(path)
    np.testing.assert_allclose(np.asarray(ours(np.asarray([ids], np.int32))), expected,
                               atol=1e-4, rtol=1e-4)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    assert hf_tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                            add_generation_prompt=True) == tokenizer.decode(ids)
    assert hf_tokenizer.eos_token_id == tokenizer.eos_id
    assert theirs.generation_config.eos_token_id == tokenizer.eos_id


def test_export_writes_the_dtype_asked_for(base, tmp_path):
    workdir = str(tmp_path / "run")
    config = export_config(base, dtype="bfloat16")
    trained = trained_workdir(config, workdir)
    path = run_export(config, workdir)
    tensors = read_safetensors(os.path.join(path, "model.safetensors"))
    assert {str(t.dtype) for t in tensors.values()} == {"bfloat16"}
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["torch_dtype"] == "bfloat16"
    model, _ = from_pretrained(path)  # read back into f32 weights
    for name, value in flat_params(model).items():
        np.testing.assert_array_equal(value, trained[name].astype(jnp.bfloat16).astype(np.float32))
    with pytest.raises(ValueError, match=r"config.export.dtype='int4': expected"):
        run_export(export_config(base, dtype="int4"), workdir)
