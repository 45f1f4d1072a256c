"""Logical axes -> mesh axes; a sharded forward on 8 simulated CPU devices equals the unsharded."""
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import tiny_checkpoints as tc
from jaxprefix.checkpoints.hf import from_pretrained
from jaxprefix.models import make_mesh, shard_model, sharding

forward = nnx.jit(lambda model, tokens, mask: model(tokens, mask=mask))


def test_make_mesh_sizes_and_errors():
    assert len(jax.devices()) == 8
    assert dict(make_mesh().shape) == {'data': 8, 'fsdp': 1, 'tensor': 1}
    assert dict(make_mesh(fsdp=2, tensor=4).shape) == {'data': 1, 'fsdp': 2, 'tensor': 4}
    assert dict(make_mesh(data=2, fsdp=-1, tensor=2).shape) == {'data': 2, 'fsdp': 2, 'tensor': 2}
    with pytest.raises(ValueError, match='fsdp=3 .* does not divide the 8 devices'):
        make_mesh(fsdp=3)
    with pytest.raises(ValueError, match='at most one axis may be -1'):
        make_mesh(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match='= 4 but there are 8 devices'):
        make_mesh(data=1, fsdp=2, tensor=2)


def test_logical_spec_follows_rules_and_drops_non_dividing_axes():
    mesh_shape = {'data': 1, 'fsdp': 2, 'tensor': 4}
    assert sharding.logical_spec(('vocab', 'embed'), (128, 64), mesh_shape) == P('tensor', 'fsdp')
    # 2 KV heads cannot be split over tensor=4: that dimension stays replicated.
    assert sharding.logical_spec(('layers', 'embed', 'kv_heads', 'head_dim'), (2, 64, 2, 24),
                                 mesh_shape) == P(None, 'fsdp', None, None)
    assert sharding.logical_spec(('batch', 'length'), (4, 9), {'data': 2, 'fsdp': 2}) == P(
        ('data', 'fsdp'), None)
    assert sharding.logical_spec(('batch',), (2,), {'data': 2, 'fsdp': 2}) == P('data')
    with pytest.raises(ValueError, match="'bogus' has no entry in sharding.RULES"):
        sharding.logical_spec(('bogus',))


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    path, _ = tc.save_checkpoint('qwen2', tmp_path_factory.mktemp('qwen2'))
    return path


def test_parameters_carry_logical_axes(tiny):
    model, _ = from_pretrained(tiny)
    assert sharding.variable_axes(model.q) == ('layers', 'embed', 'heads', 'head_dim')
    assert model.q.get_metadata()[sharding.METADATA_KEY] == ('layers', 'embed', 'heads', 'head_dim')
    assert sharding.variable_axes(model.embed) == ('vocab', 'embed')


def test_sharded_forward_equals_unsharded(tiny):
    tokens = tc.random_tokens(4, 9, seed=5)
    mask = np.ones(tokens.shape, bool)
    mask[1, :3] = False
    want = np.asarray(forward(from_pretrained(tiny)[0], tokens, mask))

    mesh = make_mesh(data=-1, fsdp=2, tensor=4)
    loaded, _ = from_pretrained(tiny, mesh=mesh)        # placed shard by shard while loading
    moved = shard_model(from_pretrained(tiny)[0], mesh)  # placed after the fact
    for model in (loaded, moved):
        assert model.q[...].sharding.spec == P(None, 'fsdp', 'tensor', None)
        assert model.q[...].addressable_shards[0].data.shape == (2, 32, 1, 24)
        assert model.gate[...].sharding.spec == P(None, 'fsdp', 'tensor')
        assert model.k[...].sharding.spec == P(None, 'fsdp', None, None)
    with jax.set_mesh(mesh):  # activations constrained: batch over ('data', 'fsdp')
        got = np.asarray(forward(loaded, tokens, mask))
        assert from_pretrained(tiny)[0].o[...].sharding.spec == P(None, 'tensor', None, 'fsdp')
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(forward(moved, tokens, mask)), want, atol=1e-5, rtol=0)
