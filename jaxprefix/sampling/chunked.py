"""generate() in chunks of decode steps, what every row has drawn so far read between them: for a
caller that hands tokens out as they come (the server's streams, serving/batcher.py).

The programs are generate()'s own, run a chunk at a time: the static decode stops its loop
after `chunk_steps` more steps without marking its rows done (static.decode's `until`) and the
next call goes on from the state it returned; the continuous decode runs as sample_turns runs
it (continuous.start, then continuous.advance `chunk_steps` steps at a time) with generate()'s
own shape and one turn a row. Every step is the step generate() takes, so the rollouts are
generate()'s for the same arguments (tests/test_sampling_chunked.py); each chunk costs a return
to the host and a read of the rows' outputs.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from jaxprefix import distributed
from jaxprefix.sampling import continuous, static
from jaxprefix.sampling.continuous_state import UNBOUNDED, Limits
from jaxprefix.sampling.layout import Context
from jaxprefix.sampling.rollouts import Rollouts
from jaxprefix.sampling.sampler import (layout_arrays, mesh_scope, prefill_program, prepare_request,
                                        sampler_args, continuous_shape, laid_out)
from jaxprefix.sampling.turns import episode_progress


@dataclasses.dataclass(frozen=True)
class Progress:
    """Every row's outputs after a chunk, on the host: row i*n + j is sample j of context i;
    completions[r, :lengths[r]] are its tokens so far. `rollouts`: the result, on the last."""
    completions: np.ndarray  # int32 [rows, T]
    logprobs: np.ndarray     # f32 [rows, T]
    lengths: np.ndarray      # int32 [rows]
    stopped: np.ndarray      # bool [rows]
    rollouts: Rollouts | None = None


def generate_in_chunks(model, contexts: Sequence[Context], *, chunk_steps: int,
                       unwanted: Callable[[], Sequence[int]] | None = None,
                       **generate) -> Iterator[Progress]:
    """generate(model, contexts, **generate)'s rollouts, with the rows' progress after every
    `chunk_steps` decode steps; the last Progress carries the rollouts. `unwanted()`, asked
    between chunks: rows the caller needs no more of; the static decode stops them (their
    rollouts end there, and the call ends when the others do), the continuous one decodes
    them on."""
    if chunk_steps < 1:
        raise ValueError(f'chunk_steps={chunk_steps}: expected >= 1')
    if generate.get('record_routes'):
        raise ValueError('record_routes: generate_in_chunks records no experts')
    req = prepare_request(model, contexts, **generate)
    if req.reshard is not None:
        req = dataclasses.replace(req, params=req.reshard())
    rows = req.layout.num_contexts * req.n
    with mesh_scope(req.mesh):
        chunks = _static(req, chunk_steps, unwanted or (lambda: ())) if req.plan is None \
            else _continuous(req, chunk_steps)
        for outputs, last in chunks:
            outputs = [x[:rows] for x in distributed.to_host(outputs)]
            yield Progress(*outputs, rollouts=laid_out(req, *outputs, None) if last else None)


def _static(req, chunk_steps: int, unwanted: Callable[[], Sequence[int]]):
    """(completions, logprobs, lengths, stopped) on the device after each chunk, and whether it
    was the last."""
    segments, state, _ = prefill_program(req)()
    until = 0
    while True:
        until += chunk_steps
        state = static.decode(req.graphdef, req.params, segments, state, *sampler_args(req),
                              hoist_layers=req.hoist_layers, until=np.int32(until))
        done, step = jax.device_get((state.done.all(), state.step))
        last = bool(done) or int(step) >= req.max_new_tokens
        yield (state.completions, state.logprobs, state.lengths, state.stopped), last
        if last:
            return
        stop = np.zeros(state.done.shape, bool)  # a mask: one shape, whatever the rows
        stop[np.asarray(unwanted(), np.int32)] = True
        if stop.any():  # done rows ride along drawing nothing; the loop ends when all are
            state = state.replace(done=state.done | stop)


def _continuous(req, chunk_steps: int):
    shape = continuous_shape(req)
    arrays = layout_arrays(req.layout, True)
    settings, seed_key, stop_ids, max_new_tokens = sampler_args(req)
    limits = Limits.one_turn(max_new_tokens)
    state = continuous.start(req.graphdef, req.params, arrays, shape=shape)
    layer_weights = continuous.hoisted_weights(req.graphdef, req.params, layout=shape.layout)
    while True:
        state = continuous.advance(req.graphdef, req.params, arrays, settings, seed_key,
                                   stop_ids, limits, layer_weights, state, np.int32(chunk_steps),
                                   np.int32(UNBOUNDED), shape=shape)
        _, _, alive, can_go, _ = jax.device_get(episode_progress(state, arrays, shape=shape))
        last = not (alive and can_go)
        out = state.out
        yield (out.completions, out.logprobs, out.lengths, out.stopped), last
        if last:
            return
