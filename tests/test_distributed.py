"""jax.distributed from config: 2 processes x 4 CPU devices on 127.0.0.1 act as one 8-device mesh."""
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import textwrap
import time

import ml_collections
import numpy as np
import pytest

from jaxprefix import distributed

REPO = pathlib.Path(__file__).resolve().parents[1]

# Each process owns 4 rows of an [8, 3] array (data-sharded as the loader shards problems),
# then the mesh computes a jitted global sum and a shard_map psum across both processes.
WORKER = textwrap.dedent("""
    import json, sys
    import ml_collections
    from jaxprefix import distributed
    config = distributed.default_config()
    config.coordinator_address = sys.argv[1]
    config.num_processes = 2
    config.process_id = int(sys.argv[2])
    config.num_cpu_devices = 4
    mode = distributed.initialize(config)

    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ('data', 'fsdp'))
    index, count = distributed.data_shard()
    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) ** 2
    rows = np.array_split(full, count)[index]
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(('data', 'fsdp'))), rows)
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    psum = jax.jit(jax.shard_map(
        lambda b: jax.lax.psum(b.sum(axis=0), ('data', 'fsdp')),
        mesh=mesh, in_specs=P(('data', 'fsdp')), out_specs=P()))(x)
    host = distributed.to_host({'x': x, 'total': total})
    print('RESULT ' + json.dumps(dict(
        gathered=host['x'].tolist(), gathered_total=float(host['total']),
        mode=mode, shard=[index, count], primary=distributed.is_primary(),
        devices=jax.device_count(), local_devices=jax.local_device_count(),
        processes=sorted({d.process_index for d in mesh.devices.flat}),
        total=float(total), psum=np.asarray(psum).tolist())), flush=True)
    jax.distributed.shutdown()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_form_one_eight_device_mesh(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # devices come from config
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    address = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, str(script), address, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0])
    finally:
        for p in procs:  # never leave a process waiting on a dead peer
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for i, (p, out) in enumerate(zip(procs, outputs)):
        lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
        assert p.returncode == 0 and lines, f"process {i} failed (rc {p.returncode}):\n{out[-3000:]}"
        results.append(json.loads(lines[-1][len("RESULT "):]))

    full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3) ** 2
    for i, r in enumerate(results):
        assert r["mode"] == "explicit"
        assert r["shard"] == [i, 2]
        assert r["primary"] == (i == 0)
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["processes"] == [0, 1]
        assert r["total"] == pytest.approx(float(full.sum()))
        np.testing.assert_allclose(r["psum"], full.sum(axis=0))
        np.testing.assert_array_equal(r["gathered"], full)  # whole on each process
        assert r["gathered_total"] == r["total"]


def test_a_second_process_loads_the_compiled_program(tmp_path):
    """enable_compilation_cache: what one process compiled, the next loads (a cache hit)."""
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        from jaxprefix import distributed
        distributed.enable_compilation_cache({str(tmp_path / "xla")!r}, min_compile_seconds=0)
        hits = []
        jax.monitoring.register_event_listener(
            lambda event, **_: hits.append(event) if event.endswith("cache_hits") else None)
        jax.jit(lambda x: jnp.tanh(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
        print("HITS", len(hits))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env, check=True).stdout for _ in range(2)]
    assert "HITS 0" in runs[0] and "HITS 0" not in runs[1], runs
    assert any((tmp_path / "xla").iterdir())


def test_single_process_without_coordinator_starts_nothing():
    config = distributed.default_config()
    config.mode = "off"
    assert distributed.initialize(config) == "single"
    assert distributed.data_shard() == (0, 1)
    assert distributed.is_primary()


@pytest.mark.parametrize("field, value, message", [
    ("coordinator_address", "localhost", "expected 'host:port'"),
    ("process_id", 2, "process_id=2"),
    ("mode", "always", "mode='always'"),
])
def test_bad_config_names_the_field(field, value, message):
    config = distributed.default_config()
    config.coordinator_address = "127.0.0.1:1234"
    config.num_processes = 2
    config[field] = value
    with pytest.raises(ValueError, match=message):
        distributed.initialize(config)


def test_unknown_field_is_rejected():
    with pytest.raises(ValueError, match="unknown field"):
        distributed.initialize(ml_collections.ConfigDict(dict(num_hosts=2)))


# ---- the grpo smoke run: 2 processes x 4 devices end where 1 process x 8 devices ends ----------

def _final_params(workdir: pathlib.Path) -> dict:
    """The arrays of the latest checkpoint as host numpy (whatever mesh wrote them), by step."""
    import jax
    import orbax.checkpoint as ocp
    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert steps, f"no checkpoint under {workdir / 'checkpoints'}"
    out = {}
    for step in steps[-2:]:
        path = workdir / "checkpoints" / str(step) / "arrays"
        tree = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        out[step] = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
            restore_args=args))
    return out


def _main(workdir, devices, *flags, steps=2):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "jaxprefix.main", "--config=configs/grpo.py:smoke",
         f"--workdir={workdir}", f"--config.train.total_steps={steps}",
         "--config.checkpoint.every=1", f"--config.distributed.num_cpu_devices={devices}",
         *flags], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _cluster(address, i, *flags):
    return (f"--config.distributed.coordinator_address={address}",
            "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}", *flags)


def _wait_all(procs, timeout_s):
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [f"process {i} failed (rc {p.returncode}):\n{out[-4000:]}"
              for i, (p, out) in enumerate(zip(procs, outputs)) if p.returncode != 0]
    assert not failed, "\n".join(failed)  # every failed process's log: the first may be a victim


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / "configs" / "grpo.py").exists()
                    or not (REPO / "jaxprefix" / "jobs" / "rl.py").exists(),
                    reason="needs configs/grpo.py and the rl job (jaxprefix/jobs/rl.py)")
def test_grpo_smoke_two_hosts_matches_one_host(tmp_path):
    one, two = tmp_path / "one_host", tmp_path / "two_hosts"
    # Every micro-batch computed, though every group scores alike: the learner's diagnostics
    # (entropy, ratios) are then compared across the two layouts too.
    every = "--config.train.skip_zero_advantage=False"
    _wait_all([_main(one, 8, every)], timeout_s=600)
    address = f"127.0.0.1:{_free_port()}"
    _wait_all([_main(two, 4, *_cluster(address, i, every)) for i in range(2)], timeout_s=600)
    expected, got = _final_params(one), _final_params(two)
    assert sorted(got) == sorted(expected)
    last = max(expected)
    flat_expected, flat_got = dict(_flat(expected[last])), dict(_flat(got[last]))
    assert flat_got.keys() == flat_expected.keys()
    for key, value in flat_expected.items():  # params (SFT-trained base + RL), optimizer, RNG
        np.testing.assert_allclose(flat_got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    # The smoke run's groups all score 0 (grad_norm 0), so RL leaves the params as they were;
    # the per-step metrics (rewards, lengths, entropy, ratios) show whether both runs sampled and
    # scored the same rollouts.
    records_one, records_two = _metrics(one), _metrics(two)
    assert len(records_two) == len(records_one) == 2
    for a, b in zip(records_two, records_one):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert all(r["entropy"] > 0 for r in records_one)


def _metrics(workdir: pathlib.Path) -> list[dict]:
    """metrics.jsonl records without wall-clock figures."""
    from jaxprefix.rl.metrics import read_metrics

    records = read_metrics(str(workdir))
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}
            for r in records]


def _flat(tree):
    """{'['params']['w']': array} for every leaf."""
    import jax
    return [(jax.tree_util.keystr(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


LOST_S = 10  # config.distributed.lost_process_timeout_s of the lost-host run


@pytest.mark.slow
def test_a_lost_process_stops_the_other_in_one_line_and_a_relaunch_resumes(tmp_path):
    """Process 1 SIGKILLed after the first checkpoint (a preempted TPU VM worker): process 0
    exits within the bound with one line naming it, and relaunching both ends where a run that
    was never interrupted ends."""
    one, two = tmp_path / "one_host", tmp_path / "two_hosts"
    steps = 4
    address = f"127.0.0.1:{_free_port()}"
    watch = f"--config.distributed.lost_process_timeout_s={LOST_S}"
    procs = [_main(two, 4, *_cluster(address, i, watch), steps=steps) for i in range(2)]
    try:
        deadline = time.monotonic() + 600
        while not (two / "checkpoints" / "1").is_dir() or len(_rows(two)) < 2:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, \
                procs[0].communicate(timeout=60)[0][-3000:]
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        output = procs[0].communicate(timeout=LOST_S * 6)[0]
        detected = time.monotonic() - killed
        (tmp_path / "process0.log").write_text(output)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    print(f"lost process detected after {detected:.1f} s")
    lines = output.strip().splitlines()
    assert procs[0].returncode == 75, output[-3000:]
    assert lines[-1].startswith("error: process 1 of 2 of this run stopped answering"), lines[-5:]
    assert "Traceback" not in output and "Check failure" not in output, output[-3000:]
    assert detected < LOST_S + 5  # the bound, plus the watch's beat and the exit
    logged = len(_rows(two))
    assert 2 <= logged < steps

    address = f"127.0.0.1:{_free_port()}"  # the same command again, both processes
    _wait_all([_main(two, 4, *_cluster(address, i, watch), steps=steps) for i in range(2)],
              timeout_s=600)
    _wait_all([_main(one, 8, steps=steps)], timeout_s=600)  # never interrupted
    records_one, records_two = _metrics(one), _metrics(two)
    assert len(records_two) == len(records_one) == steps
    for a, b in zip(records_two, records_one):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def _rows(workdir: pathlib.Path) -> list[str]:
    path = workdir / "metrics.jsonl"
    return [l for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
