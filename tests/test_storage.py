"""The storage layer on local paths and on gs:// (a real GCS API on 127.0.0.1, tests/gcs_emulator.py)."""
import os
import sys

import pytest

from jaxprefix import storage


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    request.getfixturevalue("gcs")
    return f"gs://bucket/{request.node.name.replace('[', '_').rstrip(']')}-{os.getpid()}"


def test_write_read_list_remove(root):
    path = storage.join(root, "sub", "a.json")
    assert not storage.exists(path)
    storage.write_json(path, {"x": [1, 2]})
    assert storage.exists(path) and storage.isfile(path)
    assert storage.isdir(storage.join(root, "sub"))
    assert storage.read_json(path) == {"x": [1, 2]}
    storage.write_atomic(path, b"{\"x\": 3}")  # replaces
    assert storage.read_json(path) == {"x": 3}
    storage.write_atomic(storage.join(root, "sub", "b.txt"), "hé")
    assert storage.read_text(storage.join(root, "sub", "b.txt")) == "hé"
    assert storage.listdir(storage.join(root, "sub")) == ["a.json", "b.txt"]
    assert storage.glob(storage.join(root, "sub"), "*.txt") == [storage.join(root, "sub", "b.txt")]
    assert storage.size(path) == len(b"{\"x\": 3}")
    written = storage.modified_ns(path)
    assert written > 0
    storage.write_atomic(path, b"{\"x\": 4}")
    assert storage.modified_ns(path) >= written
    storage.rename(path, storage.join(root, "sub", "c.json"))
    assert not storage.exists(path) and storage.read_json(storage.join(root, "sub", "c.json"))
    storage.remove(storage.join(root, "sub", "b.txt"))
    assert storage.listdir(storage.join(root, "sub")) == ["c.json"]
    storage.rmtree(root)
    assert not storage.exists(storage.join(root, "sub", "c.json"))


def test_open_for_writing_and_appending_lines(root):
    path = storage.join(root, "lines.txt")
    with storage.open(path, "w") as f:
        f.write("one\n")
    with storage.open(path) as f:
        assert f.read() == "one\n"


def test_create_exclusive_writes_once(root):
    path = storage.join(root, "lock")
    assert storage.create_exclusive(path, "first")
    assert not storage.create_exclusive(path, "second")
    assert storage.read_text(path) == "first"
    storage.remove(path)
    assert storage.create_exclusive(path, b"third") and storage.read_text(path) == "third"


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    path = str(tmp_path / "d" / "f.bin")
    storage.write_atomic(path, b"1" * 1000)
    storage.write_atomic(path, b"2")
    assert os.listdir(tmp_path / "d") == ["f.bin"] and storage.read_bytes(path) == b"2"


def test_open_atomic_keeps_a_mapped_file_intact(tmp_path):
    """Two processes of one run save the same base model (model.safetensors) while the other
    maps it: the writer must replace the file, not rewrite it in place (in place, the map reads
    the new bytes, or SIGBUS once the file was truncated)."""
    import numpy as np

    path = str(tmp_path / "model.safetensors")
    storage.write_atomic(path, b"1" * 4096)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    with storage.open_atomic(path) as f:
        f.write(b"2" * 2048)
        f.write(b"2" * 2048)
    assert bytes(mapped[:4]) == b"1111" and storage.read_bytes(path) == b"2" * 4096
    with pytest.raises(RuntimeError), storage.open_atomic(path) as f:
        f.write(b"3")
        raise RuntimeError("the writer fails half way")
    assert storage.read_bytes(path) == b"2" * 4096 and os.listdir(tmp_path) == ["model.safetensors"]


def test_paths():
    assert storage.is_remote("gs://b/x") and not storage.is_remote("/tmp/x")
    assert storage.join("gs://b/run/", "a", "b.json") == "gs://b/run/a/b.json"
    assert storage.join("runs/x", "a") == os.path.join("runs/x", "a")
    assert storage.dirname("gs://b/run/x.json") == "gs://b/run"
    assert storage.dirname("gs://b/run") == "gs://b"
    assert storage.basename("gs://b/run/x.json") == "x.json"


def test_local_copy_is_cached_under_the_cache_dir(gcs, tmp_path, monkeypatch):
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    remote = f"gs://bucket/copy-{os.getpid()}/w.bin"
    storage.write_atomic(remote, b"abc" * 1000)
    local = storage.local_copy(remote)
    assert local.startswith(str(tmp_path / "cache")) and open(local, "rb").read() == b"abc" * 1000
    assert storage.local_copy(remote) == local  # downloaded once
    storage.write_atomic(remote, b"changed")  # a new object: a new copy
    assert open(storage.local_copy(remote), "rb").read() == b"changed"
    assert storage.local_copy(str(tmp_path / "x")) == str(tmp_path / "x")


def test_require_backend_errors_are_one_line(gcs, monkeypatch):
    storage.require_backend("gs://bucket/run")  # exists
    storage.require_backend("/no/such/local/dir")  # local paths always pass
    with pytest.raises(ValueError, match=r"^gs://no-such-bucket/run: bucket gs://no-such-bucket "
                                         r"does not exist") as e:
        storage.require_backend("gs://no-such-bucket/run")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"s3://b/x: unsupported storage scheme"):
        storage.require_backend("s3://b/x")
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as on a machine without it
    with pytest.raises(ValueError, match=r"^gs://bucket/run: gs:// paths need the gcsfs package.*"
                                         r"pip install gcsfs"):
        storage.require_backend("gs://bucket/run")


def test_train_checkpointer_on_gcs(gcs):
    import jax.numpy as jnp
    import numpy as np

    from jaxprefix.checkpoints.train_state import TrainCheckpointer

    directory = f"gs://bucket/ckpt-{os.getpid()}"
    ckpt = TrainCheckpointer(directory, max_to_keep=2)
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.int32(3)}
    for step in (1, 2, 3):
        ckpt.save(step, tree, {"step": step})
    ckpt.close()
    again = TrainCheckpointer(directory)
    assert again.all_steps() == [2, 3]
    arrays, meta = again.restore(tree)
    np.testing.assert_array_equal(arrays["w"], tree["w"])
    assert meta == {"step": 3}
    again.close()
    names = gcs.objects("bucket", f"ckpt-{os.getpid()}/")
    assert names and all(n.split("/")[1] in ("2", "3") for n in names)
