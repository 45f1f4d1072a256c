"""Multi-host JAX: start the distributed runtime from config, and name this host's data shard.

JAX runs one process per host (per TPU VM worker); after `initialize`, `jax.devices()` lists the
devices of all hosts, so a Mesh built from it spans the whole slice and every jitted step runs
collectively. Call `initialize(config.distributed)` first thing in `main`, before any other JAX
call: the runtime cannot join a cluster once a backend exists.

How the cluster is found (`config.distributed`, see `default_config`):
- `coordinator_address` set: explicit cluster (GPU clusters, local multi-process tests), with
  `num_processes` and `process_id` given per process. On CPU the processes exchange data with
  gloo collectives and can simulate `num_cpu_devices` devices each.
- otherwise on a Cloud TPU VM: `jax.distributed.initialize()` with no arguments; JAX reads the
  slice's workers and this worker's id from the TPU metadata. Single-host VMs work the same way.
- otherwise (laptop, Colab, one GPU box): one process, nothing to start.
`mode='off'` skips all of it.

A lost process (a preempted TPU VM worker: SIGKILL, no goodbye) must not leave the others
waiting in a collective for ever. Each process of a multi-process run beats a heartbeat into the
coordination service's key-value store from a thread (`_PeerWatch`); a peer whose heartbeat stops
for `lost_process_timeout_s`, or a coordination service (process 0) that stops answering for as
long, makes every other process print one line naming the lost process and exit with status 75
(EX_TEMPFAIL): relaunching all processes resumes from the last complete checkpoint
(launch/tpu.sh watch does). JAX's own heartbeat and shutdown timeouts, which abort a process
with a long native stack trace, are set past ours as a backstop.
"""
from __future__ import annotations

import atexit
import glob
import logging
import os
import sys
import threading
import time

import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxprefix.config_fields import Field, build

MODES = ("auto", "off")


FIELDS = {
    "mode": Field("auto", "'auto' (detect, see module doc) or 'off'"),
    "coordinator_address": Field("", "'host:port' of process 0; setting it makes the cluster "
                                     "explicit"),
    "num_processes": Field(1, "processes of an explicit cluster"),
    "process_id": Field(0, "this process's id in an explicit cluster (differs per process)"),
    "cpu_collectives": Field("gloo", "CPU cross-process collectives (jax's own choice is none)"),
    "num_cpu_devices": Field(0, "> 0: simulate this many CPU devices in each process"),
    "initialization_timeout_s": Field(300, "seconds to wait for every process to join"),
    "lost_process_timeout_s": Field(60.0, "a process silent this long is lost: the others stop "
                                          "in one line (exit 75)"),
}


def default_config() -> ml_collections.ConfigDict:
    """The `config.distributed` block with its defaults (single process unless on a TPU VM)."""
    return build(FIELDS)


def on_cloud_tpu_vm() -> bool:
    """True on a Cloud TPU VM host (TPU chips are exposed as /dev/accel* or /dev/vfio/<n>).

    Colab's TPU runtime is a single-host VM whose metadata server lacks the slice description
    JAX asks for, so it counts as a plain single process.
    """
    if "COLAB_RELEASE_TAG" in os.environ:
        return False
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _validated(config) -> ml_collections.ConfigDict:
    merged = default_config()
    if config is not None:
        unknown = set(config.keys()) - set(merged.keys())
        if unknown:
            raise ValueError(f"config.distributed: unknown field(s) {sorted(unknown)}; "
                             f"expected some of {sorted(merged.keys())}")
        merged.update(dict(config.items()))
    if merged.mode not in MODES:
        raise ValueError(f"config.distributed.mode={merged.mode!r}: expected one of {MODES}")
    if merged.coordinator_address:
        host, _, port = str(merged.coordinator_address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"config.distributed.coordinator_address={merged.coordinator_address!r}: "
                             "expected 'host:port', e.g. '10.0.0.2:8476'")
        if int(merged.num_processes) < 1:
            raise ValueError(f"config.distributed.num_processes={merged.num_processes}: expected >= 1")
        if not 0 <= int(merged.process_id) < int(merged.num_processes):
            raise ValueError(f"config.distributed.process_id={merged.process_id}: expected 0 <= id < "
                             f"num_processes={merged.num_processes}")
    if not float(merged.lost_process_timeout_s) >= 1:
        raise ValueError(f"config.distributed.lost_process_timeout_s={merged.lost_process_timeout_s}"
                         f": expected >= 1 second")
    if int(merged.num_cpu_devices) < 0:
        raise ValueError(f"config.distributed.num_cpu_devices={merged.num_cpu_devices}: expected >= 0")
    return merged


def _set_before_backend(name: str, value) -> None:
    try:
        jax.config.update(name, value)
    except RuntimeError as e:  # jax refuses once a backend exists
        raise RuntimeError(f"config.distributed needs {name}={value!r}, but JAX was already used in "
                           "this process; call jaxprefix.distributed.initialize before any other JAX "
                           "call") from e


def enable_compilation_cache(directory: str, min_compile_seconds: float = 1.0) -> None:
    """Keeps XLA's compiled programs in `directory` (local) across processes: a rerun, a resumed
    run, or another run of the same shapes loads what took at least `min_compile_seconds` to
    compile instead of compiling it again (the learner's update: minutes on 2 CPU cores)."""
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)


def initialize(config: ml_collections.ConfigDict | None = None) -> str:
    """Starts the JAX distributed runtime as `config` (a `config.distributed` block) says.

    Returns how the process runs: 'explicit' (coordinator address given), 'tpu' (Cloud TPU VM,
    detected) or 'single' (one process, nothing started). Calling it again is harmless.
    """
    config = _validated(config)
    if config.num_cpu_devices:
        _set_before_backend("jax_num_cpu_devices", int(config.num_cpu_devices))
    if jax.distributed.is_initialized():
        return "explicit" if config.coordinator_address else "tpu"
    if config.mode == "off":
        return "single"
    lost_s = float(config.lost_process_timeout_s)
    # JAX's own watch (its abort has a native stack trace) only behind ours; its shutdown
    # barrier waits at most as long for a peer that died at the very end.
    timeouts = dict(initialization_timeout=int(config.initialization_timeout_s),
                    heartbeat_timeout_seconds=int(2 * lost_s) + 5,
                    shutdown_timeout_seconds=int(5 * lost_s))
    if config.coordinator_address:
        if config.cpu_collectives:
            _set_before_backend("jax_cpu_collectives_implementation", config.cpu_collectives)
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=int(config.num_processes),
            process_id=int(config.process_id), **timeouts)
        mode = "explicit"
    elif on_cloud_tpu_vm():
        jax.distributed.initialize(**timeouts)
        mode = "tpu"
    else:
        return "single"
    if jax.process_count() > 1:
        global _watch
        _watch = _PeerWatch(lost_s)
        _watch.start()
    logging.info("jax.distributed (%s): process %d of %d, %d local of %d devices", mode,
                 jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count())
    return mode


_watch = None  # this process's _PeerWatch, in a multi-process run


def wait_for_lost_peer() -> None:
    """Called on an unexpected error of a multi-process run: a collective that failed because a
    peer died (gloo: 'Connection reset by peer') is the loss of that peer, so wait until the
    watch can tell (it ends the process in one line if so); return when every peer answers."""
    if _watch is not None:
        time.sleep(_watch.timeout_s + 2 * _watch.interval_s)


class _PeerWatch:
    """Beats this process's heartbeat into the coordination service's key-value store and
    watches the others'; a silent peer (or service) ends this process in one line."""

    KEY = "jaxprefix/heartbeat"

    def __init__(self, timeout_s: float):
        # jax offers no public handle on the coordination service's key-value store; this is
        # the client jax.distributed.initialize made (multihost_utils reaches it the same way).
        from jax._src import distributed as jax_distributed

        self.client = jax_distributed.global_state.client
        self.timeout_s, self.interval_s = timeout_s, max(0.2, timeout_s / 10)
        self.me, self.count = jax.process_index(), jax.process_count()
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, daemon=True, name="peer-watch").start()
        atexit.register(self.stop)  # runs before the runtime's shutdown at exit

    def stop(self) -> None:
        """A clean exit: the others must not take this process for lost."""
        self._stop.set()
        try:
            self.client.key_value_set(f"{self.KEY}/{self.me}", "done", allow_overwrite=True)
        except Exception:  # noqa: BLE001  (the service is gone: nobody is left to tell)
            pass

    def _watch(self) -> None:
        now = time.monotonic()
        seen = {p: (None, now) for p in range(self.count) if p != self.me}  # value, when changed
        service_ok = now
        beat = 0
        while not self._stop.wait(self.interval_s):
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{self.KEY}/{self.me}", str(beat), allow_overwrite=True)
                for peer, (value, since) in seen.items():
                    try:
                        current = self.client.key_value_try_get(f"{self.KEY}/{peer}")
                    except Exception:  # noqa: BLE001  (no beat of it yet)
                        current = None
                    if current != value or current == "done":
                        seen[peer] = (current, now)
                service_ok = now
            except Exception:  # noqa: BLE001  (the coordination service does not answer)
                if now - service_ok > self.timeout_s and not self._stop.is_set():
                    self._lost(0, now - service_ok)
                continue
            for peer, (_, since) in seen.items():
                if now - since > self.timeout_s and not self._stop.is_set():
                    self._lost(peer, now - since)

    def _lost(self, peer: int, silent_s: float) -> None:
        sys.stderr.write(
            f"\nerror: process {peer} of {self.count} of this run stopped answering (no heartbeat "
            f"for {silent_s:.0f} s, config.distributed.lost_process_timeout_s="
            f"{self.timeout_s:g}): it was preempted, killed or crashed (its log says which), and "
            f"process {self.me} stops too; expected every process alive: relaunch all of them "
            f"with the same command, the run resumes from its last complete checkpoint\n")
        sys.stderr.flush()
        os._exit(75)  # EX_TEMPFAIL; the main thread may sit in a collective that never returns


def data_shard() -> tuple[int, int]:
    """(index, count) of this host's shard of the data: each host reads only its own problems."""
    return jax.process_index(), jax.process_count()


def is_primary() -> bool:
    """True on the one process that writes metrics, reports and other single-copy files."""
    return jax.process_index() == 0


def to_host(tree):
    """Host numpy copies of the arrays in `tree`, whole on every process.

    `jax.device_get` refuses arrays with shards on other hosts' devices; those are gathered with
    a collective, so every process must call this at the same point (as it runs the same program).
    """
    def fetch(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(fetch, tree)
