"""A whole run on gs:// against a real GCS API on 127.0.0.1 (tests/gcs_emulator.py).

`configs/grpo.py:smoke` with the model directory, the problem files and the workdir all on
gs://, stopped by SIGTERM mid-run and resumed by the same command, must log the same metrics rows
as an uninterrupted run, keep its checkpoints in the bucket, and leave no file on local disk
outside the declared cache directory. Bad remote paths are one-line errors that name the path.
"""
import json
import os
import signal
import struct
import subprocess
import sys
import time

import pytest
from flax import nnx

from jaxprefix.checkpoints.hf import from_pretrained, save_pretrained
from jaxprefix import models, storage
from jaxprefix.data.tasks import carry_multiplication as task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4
NOT_COMPARED = ("time/", "throughput/")  # wall-clock figures differ between any two runs


def tiny_base(path: str) -> None:
    """A random tiny policy over the demo task's characters, saved as an HF directory."""
    tokenizer = task.tokenizer()
    config = models.ModelConfig(
        model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=4, head_dim=8,
        max_position_embeddings=task.SEQUENCE_LENGTH, eos_token_ids=(tokenizer.eos_id,),
        pad_token_id=tokenizer.pad_id)
    save_pretrained(models.Decoder(config, rngs=nnx.Rngs(0)), config, path,
                           tokenizer=tokenizer)


def problem_file(path: str, count: int, seed: int) -> None:
    problems = task.generate(count, digits=(20, 20), multipliers=(6, 9), seed=seed)
    storage.write_atomic(path, "".join(
        json.dumps({"id": p.id, "question": p.question, "answer": p.answer,
                    "solution": p.solution}) + "\n" for p in problems))


def run_inputs(root: str, tmp_path_factory):
    """gs:// inputs of the runs under `root`, and local folders each run starts in (cwd,
    TMPDIR, cache)."""
    tiny_base(f"{root}/base")
    problem_file(f"{root}/train.jsonl", 8, seed=1)
    problem_file(f"{root}/eval.jsonl", 4, seed=2)
    local = tmp_path_factory.mktemp("local")
    for name in ("cwd", "tmp", "cache"):
        (local / name).mkdir()
    return root, local


@pytest.fixture(scope="module")
def remote(gcs, tmp_path_factory):
    return run_inputs(f"gs://bucket/run-{os.getpid()}", tmp_path_factory)


def command(root: str, workdir: str) -> list[str]:
    return [sys.executable, "-m", "jaxprefix.main", f"--config={ROOT}/configs/grpo.py:smoke",
            f"--workdir={workdir}", f"--config.model.path={root}/base",
            "--config.data.source=file", f"--config.data.path={root}/train.jsonl",
            f"--config.data.eval_path={root}/eval.jsonl", "--config.data.verifier=exact",
            f"--config.train.total_steps={STEPS}"]


def start(args, local):
    """The run in an empty working directory with its own TMPDIR and cache directory."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TMPDIR=str(local / "tmp"),
               **{storage.CACHE_ENV: str(local / "cache")})
    return subprocess.Popen(args, cwd=local / "cwd", env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def finish(process, timeout=600) -> str:
    _, stderr = process.communicate(timeout=timeout)
    assert process.returncode == 0, stderr[-3000:]
    return stderr


def event_steps(path: str) -> list[int]:
    """Steps of the scalar events in a TensorBoard event file (records: length, crc, data, crc)."""
    from tensorboard.compat.proto import event_pb2

    data, steps, at = storage.read_bytes(path), [], 0
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
        if event.summary.value:
            steps.append(event.step)
        at += 12 + length + 4
    return steps


def compared(rows):
    return [{k: v for k, v in row.items() if not k.startswith(NOT_COMPARED)} for row in rows]


def test_smoke_run_on_gcs_resumes_after_sigterm_with_the_same_metrics(gcs, remote):
    root, local = remote
    whole, split = f"{root}/whole", f"{root}/split"
    # The uninterrupted run and the first half of the interrupted one run side by side.
    uninterrupted = start(command(root, whole), local)
    interrupted = start(command(root, split), local)
    metrics = f"{split}/metrics.jsonl"
    deadline = time.time() + 600
    while not (storage.exists(metrics) and storage.read_text(metrics).strip()):
        assert interrupted.poll() is None, interrupted.communicate()[1][-3000:]
        assert time.time() < deadline, "no step was logged"
        time.sleep(0.3)
    interrupted.send_signal(signal.SIGTERM)
    _, stderr = interrupted.communicate(timeout=300)
    assert interrupted.returncode == 143, stderr[-3000:]
    stopped_at = len(storage.read_text(metrics).splitlines())
    assert 1 <= stopped_at < STEPS
    saved = {name.split("/")[3] for name in gcs.objects("bucket", f"{split[len('gs://bucket/'):]}/checkpoints/")}
    assert str(stopped_at) in saved, saved  # the checkpoint of the step it stopped after

    finish(start(command(root, split), local))  # the same command again
    finish(uninterrupted)

    from jaxprefix.rl.metrics import read_metrics

    resumed, reference = read_metrics(split), read_metrics(whole)
    assert [r["step"] for r in reference] == list(range(1, STEPS + 1))
    assert compared(resumed) == compared(reference)
    assert storage.exists(f"{split}/compute.json")
    assert storage.read_json(f"{split}/compute.json") == storage.read_json(f"{whole}/compute.json")
    # The second invocation resumed from the checkpoint: its event file starts after it.
    first, second = storage.glob(f"{split}/tensorboard", "events.out.tfevents.*")
    assert event_steps(first) == list(range(1, stopped_at + 1))
    assert event_steps(second) == list(range(stopped_at + 1, STEPS + 1))
    # Nothing of the runs on local disk but the cache (the base's weights, memory-mapped; XLA's
    # compiled programs under xla/).
    assert os.listdir(local / "cwd") == [] and os.listdir(local / "tmp") == []
    assert not os.path.exists(os.path.join(ROOT, "gs:"))
    cached = [f for folder, _, files in os.walk(local / "cache") for f in files
              if not os.path.relpath(folder, local / "cache").startswith("xla")]
    assert cached == ["model.safetensors"]


def test_bad_remote_paths_are_one_line_errors(gcs, remote, tmp_path):
    root, local = remote
    args = command(root, "gs://no-such-bucket/run")
    process = start(args, local)
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 1
    assert stderr.strip().splitlines()[-1] == (
        "error: gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist or cannot be "
        "read with this machine's credentials")

    no_config = f"{root}/model-without-config"
    storage.write_atomic(f"{no_config}/model.safetensors", b"")
    with pytest.raises(FileNotFoundError, match=f"^{no_config}/config.json: missing config.json$"):
        from_pretrained(no_config)
    with pytest.raises(FileNotFoundError, match=f"^{root}/nothing: not a checkpoint directory"):
        from_pretrained(f"{root}/nothing")
