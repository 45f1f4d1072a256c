"""Train-state checkpoints: exact round trips, shardings restored, N latest kept."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxprefix.checkpoints.train_state import TrainCheckpointer


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(4, 8, rngs=rngs)


def state_tree(seed=0):
    params = nnx.state(Tiny(nnx.Rngs(seed)), nnx.Param)
    opt_state = optax.adamw(1e-3).init(params)
    return {"params": params, "opt_state": opt_state, "step": jnp.int32(7),
            "rng": jax.random.key_data(jax.random.key(seed))}


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_save_restore_round_trip(tmp_path):
    saved = state_tree(0)
    meta = {"data": {"epoch": 1, "position": 17}, "method": {"pool": {"p1": ["a", "b"]}}}
    ckpt = TrainCheckpointer(str(tmp_path / "ckpt"))
    assert ckpt.latest_step() is None
    ckpt.save(7, saved, meta)
    ckpt.wait()
    arrays, restored_meta = ckpt.restore(state_tree(1))  # a different template: values come back
    assert_trees_equal(arrays, saved)
    assert restored_meta == meta
    ckpt.close()
    # A fresh manager on the same directory (a restarted process) sees the step.
    assert TrainCheckpointer(str(tmp_path / "ckpt")).latest_step() == 7


def test_restore_without_checkpoint_names_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="ckpt"):
        TrainCheckpointer(str(tmp_path / "ckpt")).restore(state_tree())


def test_sharded_round_trip_onto_new_shardings(tmp_path):
    devices = np.array(jax.devices())
    assert devices.size == 8
    mesh = Mesh(devices.reshape(4, 2), ("fsdp", "tensor"))
    value = jnp.arange(64.0).reshape(8, 8)
    saved = {"w": jax.device_put(value, NamedSharding(mesh, P("fsdp", "tensor")))}
    ckpt = TrainCheckpointer(str(tmp_path / "ckpt"))
    ckpt.save(1, saved)
    ckpt.wait()
    target = NamedSharding(mesh, P("tensor", None))
    like = {"w": jax.device_put(jnp.zeros((8, 8)), target)}
    arrays, _ = ckpt.restore(like)
    assert arrays["w"].sharding == target
    np.testing.assert_array_equal(np.asarray(arrays["w"]), np.asarray(value))
    ckpt.close()


def test_keeps_n_latest(tmp_path):
    ckpt = TrainCheckpointer(str(tmp_path / "ckpt"), max_to_keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, {"x": jnp.full((2,), step)}, {"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [2, 3]
    assert not ckpt.save(3, {"x": jnp.zeros((2,))})  # an existing step is not overwritten
    arrays, meta = ckpt.restore({"x": jnp.zeros((2,), jnp.int32)}, step=2)
    np.testing.assert_array_equal(arrays["x"], [2, 2])
    assert meta == {"step": 2}
    ckpt.close()
