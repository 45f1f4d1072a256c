"""HF directory import/export: round trips through transformers, sharded index, precise errors."""
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx

import tiny_checkpoints as tc
from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix.checkpoints import hf as hf_io

forward = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope='module')
def llama_dir(tmp_path_factory):
    path, model = tc.save_checkpoint('llama', tmp_path_factory.mktemp('llama'))
    return path, model


@pytest.mark.parametrize('family', ['llama', 'llama3_rope', 'qwen2', 'qwen3', 'gemma3'])
def test_export_round_trip_through_transformers(tmp_path, family):
    src, _ = tc.save_checkpoint(family, tmp_path / 'src')
    model, _ = from_pretrained(src)
    out = save_pretrained(model, model.config, tmp_path / 'out')
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        out, torch_dtype='float32', attn_implementation='eager').eval()
    tokens = tc.random_tokens(2, 9, seed=3)
    np.testing.assert_allclose(tc.hf_logits(reloaded, tokens), np.asarray(forward(model, tokens)),
                               atol=1e-4, rtol=0)
    # And our own reader gets back bit-identical weights.
    again, _ = from_pretrained(out)
    for a, b in zip(jax_leaves(model), jax_leaves(again)):
        np.testing.assert_array_equal(a, b)


def jax_leaves(model):
    return [np.asarray(v[...]) for _, v in sorted(nnx.iter_graph(model), key=lambda kv: str(kv[0]))
            if isinstance(v, nnx.Param)]


def test_sharded_index_checkpoint(tmp_path):
    path, hf = tc.save_checkpoint('llama_untied', tmp_path, max_shard_size='40KB')
    assert (path / 'model.safetensors.index.json').is_file()
    assert len(list(path.glob('*.safetensors'))) > 1
    tokens = tc.random_tokens(1, 7)
    np.testing.assert_allclose(np.asarray(forward(from_pretrained(path)[0], tokens)),
                               tc.hf_logits(hf, tokens), atol=1e-4, rtol=0)


def test_bfloat16_load(llama_dir):
    path, hf = llama_dir
    model, _ = from_pretrained(path, dtype=jnp.bfloat16)
    assert model.q[...].dtype == jnp.bfloat16 and model.config.dtype == 'bfloat16'
    tokens = tc.random_tokens(1, 7)
    np.testing.assert_allclose(np.asarray(forward(model, tokens)), tc.hf_logits(hf, tokens),
                               atol=0.1, rtol=0)


def test_safetensors_reader_matches_writer(tmp_path):
    arrays = {'a': np.arange(6, dtype=np.float32).reshape(2, 3),
              'b': np.ones((3,), jnp.bfloat16), 'c': np.array([1, 2], np.int64)}
    hf_io.write_safetensors(tmp_path / 'x.safetensors', arrays)
    from safetensors.numpy import load_file
    reference = load_file(tmp_path / 'x.safetensors')  # the official reader agrees on a, c
    np.testing.assert_array_equal(reference['a'], arrays['a'])
    np.testing.assert_array_equal(reference['c'], arrays['c'])
    back = hf_io.read_safetensors(tmp_path / 'x.safetensors')
    for k, v in arrays.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)


# --- bad input -----------------------------------------------------------------------------

@pytest.fixture
def broken(llama_dir, tmp_path):
    """A writable copy of the tiny llama checkpoint."""
    dst = tmp_path / 'ckpt'
    shutil.copytree(llama_dir[0], dst)
    return dst


def test_missing_directory_and_files(tmp_path, broken):
    with pytest.raises(FileNotFoundError, match='not a checkpoint directory'):
        from_pretrained(tmp_path / 'nope')
    (broken / 'model.safetensors').unlink()
    with pytest.raises(FileNotFoundError, match=r'ckpt: no model.safetensors'):
        from_pretrained(broken)
    (broken / 'config.json').unlink()
    with pytest.raises(FileNotFoundError, match=r'config.json: missing config.json'):
        from_pretrained(broken)


def test_unsupported_model_type(broken):
    config = json.loads((broken / 'config.json').read_text())
    config['model_type'] = 'mixtral'
    (broken / 'config.json').write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'mixtral' is not supported; supported: llama"):
        from_pretrained(broken)


def _copied_tensors(path):
    # Copies: the reader memory-maps the file, which the test then overwrites.
    return {k: np.array(v) for k, v in hf_io.read_safetensors(path / 'model.safetensors').items()}


def test_shape_mismatch_names_tensor(broken):
    tensors = _copied_tensors(broken)
    tensors['model.layers.1.mlp.up_proj.weight'] = np.zeros((95, 64), np.float32)
    hf_io.write_safetensors(broken / 'model.safetensors', tensors)
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.up_proj.weight' has shape "
                                         r"\(95, 64\), expected \(96, 64\)"):
        from_pretrained(broken)


def test_missing_tensor_is_named(broken):
    tensors = _copied_tensors(broken)
    del tensors['model.layers.0.self_attn.k_proj.weight']
    hf_io.write_safetensors(broken / 'model.safetensors', tensors)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.0.self_attn.k_proj.weight'"):
        from_pretrained(broken)


def test_truncated_safetensors(broken):
    f = broken / 'model.safetensors'
    data = f.read_bytes()
    f.write_bytes(data[:len(data) - 100])
    with pytest.raises(ValueError, match=r'model.safetensors: truncated safetensors file: tensor'):
        from_pretrained(broken)
    f.write_bytes(data[:20])
    with pytest.raises(ValueError, match=r'model.safetensors: truncated safetensors file: header'):
        from_pretrained(broken)
