"""metrics.wandb=True: an offline W&B run directory holds every step's metrics and the config."""
import glob
import json
import os

import pytest

from jaxprefix.rl import wandb_writer
from jaxprefix.run_config import base_config
from jaxprefix.run_setup.learner_settings import wandb_settings

wandb_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")


def wandb_records(path):
    """The protobuf records of a .wandb file: a ':W&B' header, then LevelDB-log-framed records
    (4-byte checksum, 2-byte length, 1-byte kind: 1 full, 2 first, 3 middle, 4 last) in 32 KiB
    blocks. The wandb package no longer ships a Python reader of its own files."""
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length = int.from_bytes(data[position + 4:position + 6], "little")
        kind = data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def logged(workdir):
    """(history rows by step, config) of every offline run under workdir/wandb."""
    history, config = {}, {}
    for path in sorted(glob.glob(os.path.join(workdir, "wandb", "offline-run-*", "run-*.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                history[row["_step"]] = row
            elif kind in ("run", "config"):  # the config comes with the run record
                updates = (record.run.config if kind == "run" else record.config).update
                config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


def test_offline_run_holds_step_metrics_and_the_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    c = base_config()
    c.metrics.update(wandb=True, wandb_mode="offline")
    c.train.lora_rank = 8
    writer = wandb_writer.start(wandb_settings(c), str(tmp_path))
    for step in (1, 2):
        writer.write(step, {"reward/mean": 0.25 * step, "loss": float("nan"), "tokens/sampled": 96})
    writer.close()
    # The same workdir again (a resumed run) continues the same W&B run.
    writer = wandb_writer.start(wandb_settings(c), str(tmp_path))
    writer.write(3, {"reward/mean": 0.75, "tokens/sampled": 96})
    writer.close()

    history, config = logged(tmp_path)
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["reward/mean"] for s in (1, 2, 3)] == [0.25, 0.5, 0.75]
    assert "loss" not in history[1]  # non-finite values are left out, as in metrics.jsonl
    assert config["train"]["lora_rank"] == 8 and config["metrics"]["wandb"]
    runs = glob.glob(os.path.join(tmp_path, "wandb", "offline-run-*"))
    run_id = (tmp_path / "wandb_run_id").read_text()
    assert len(runs) == 2 and all(r.endswith(run_id) for r in runs)


def test_off_by_default():
    assert wandb_settings(base_config()) is None
    assert wandb_writer.start(None, "/nonexistent") is None
