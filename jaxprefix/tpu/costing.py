"""What a step costs on a TPU chip: the rules the compile job, launch/capacity_plan.py and the
kernels' own costing share, written once.

- Seconds on a chip: `compute_seconds` (FLOPs at a share of peak bf16 FLOP/s), `hbm_seconds`
  (bytes at HBM bandwidth), and a compiled program's `roofline`: max(compute, HBM) per chip,
  with collectives' ICI time beside it, not added.
- Sampler and learner on chips of their own (rollout.devices): `weight_transfer_seconds`, the
  copy of new weights from one side to the other, and `pipelined_seconds`, a step when the two
  overlap.
- The sampler's floor (`kv_read_floor_seconds`): the KV a step's decode must read at the least;
  `sampling_floor_seconds`: a batch of sampling calls' FLOPs and weight reads, before any work.
- Pallas kernels are custom calls whose costs XLA cannot see; models/backend.py writes them
  into the name stack (SPLASH_SCOPE, PAGED_SCOPE, GMM_SCOPE) and `kernel_flops` /
  `kernel_bytes` read them back from a compiled program's op names (compiled_stats.HloCost
  takes both).
"""
from __future__ import annotations

import re

from jaxprefix.models.backend import GMM_SCOPE, PAGED_SCOPE, SPLASH_SCOPE
from jaxprefix.tpu.topology import Chip

# FLOPs of each splash kernel relative to its forward (QK^T, PV): dq recomputes QK^T and forms
# dP, dQ (3 matmuls); dkv recomputes QK^T and forms dV, dP, dK (4); fused backward: 5.
_KERNEL_MATMULS = {'fwd': 2, 'dq': 3, 'dkv': 4, 'bwd': 5}
_SPLASH_RE = re.compile(SPLASH_SCOPE.format(r'(\d+)'))
_KIND_RE = re.compile(r'splash_m[hq]a_(fwd|dq|dkv|bwd)')
_PAGED_RE = re.compile(PAGED_SCOPE.format(r'(\w+?)', r'(\d+)'))
_GMM_RE = re.compile(GMM_SCOPE.format(r'(\d+)', r'(\d+)'))
_PAGED_WHOLE_OPERANDS = 6  # (layer, first_token, lengths, table, q, q_start), then the pages


def compute_seconds(flops: float, chips: int, chip: Chip, utilization: float = 1.0) -> float:
    """Seconds of `flops` spread over `chips` chips at `utilization` of their peak bf16 rate."""
    return flops / (utilization * chips * chip.peak_bf16_flops)


def hbm_seconds(bytes_per_chip: float, chip: Chip) -> float:
    """Seconds one chip takes to read `bytes_per_chip` from its HBM."""
    return bytes_per_chip / chip.hbm_bytes_per_s


def roofline(flops: float, bytes_accessed: float, ici_bytes: float, chip: Chip) -> dict:
    """One chip's roofline of a program: its FLOPs, HBM bytes and bytes moved over ICI."""
    compute_s = compute_seconds(flops, 1, chip)
    memory_s = hbm_seconds(bytes_accessed, chip)
    return {'compute_s': compute_s, 'hbm_s': memory_s, 'ici_s': ici_bytes / chip.ici_bytes_per_s,
            'seconds': max(compute_s, memory_s),
            'bound': 'compute' if compute_s >= memory_s else 'HBM bandwidth'}


def weight_transfer_seconds(bytes_per_receiver: float, receivers: int, senders: int,
                            chip: Chip) -> float:
    """Seconds to copy new weights from the learner's `senders` chips to the sampler's
    `receivers` chips over ICI, each receiver taking in `bytes_per_receiver` (its shard of the
    weights in its own layout).

    Bandwidth model: every chip moves bytes at the chip's ici_bytes_per_s (all its links, the
    figure a roofline's ICI seconds use), and the copy lasts as long as its busiest chip: a
    receiver taking in its shard, or a sender putting out its even share of all of them
    (receivers x bytes / senders). Hops, link contention and the torus's shape are left out: a
    floor, as the roofline is."""
    return max(bytes_per_receiver, receivers * bytes_per_receiver / senders) / chip.ici_bytes_per_s


def pipelined_seconds(sampler_s: float, learner_s: float, transfer_s: float) -> float:
    """A step with the sampler running ahead of the learner (train.max_staleness >= 1) on chips
    of its own: the slower side sets the pace, and the weight copy after each update overlaps
    neither. Each side holds one copy of the weights: the sampler's HBM beyond them is its KV
    budget, with no room for a second copy to fill while it decodes, so it waits for the new
    weights; the learner's next update donates the weights being sent, so it waits until they
    are out."""
    return max(sampler_s, learner_s) + transfer_s


def sampling_floor_seconds(*, flops: float, calls: int, decode_steps: int, weight_bytes: float,
                           chips: int, chip: Chip) -> float:
    """The least time `calls` sampling calls can take on `chips` chips: their FLOPs at peak, or
    every decode step of every call reading the (sharded) weights once, whichever is longer."""
    return max(compute_seconds(flops, chips, chip),
               hbm_seconds(calls * decode_steps * weight_bytes / chips, chip))


def kv_read_floor_seconds(*, rows: int, contexts: int, context_length: int, max_new_tokens: int,
                          kv_bytes_per_token: int, chips: int, chip: Chip) -> float:
    """The KV a step's decoding must read at the least, every row running to max_new_tokens:
    each row's own filled tokens once per step (t at its t-th step) and each context's KV once
    per step of its group, spread over every chip's HBM. Weights and activations are left out,
    so no schedule reaches it."""
    tokens = (rows * max_new_tokens * (max_new_tokens - 1) / 2
              + contexts * context_length * max_new_tokens)
    return tokens * kv_bytes_per_token / (chips * chip.hbm_bytes_per_s)


def kernel_flops(op_name: str) -> float | None:
    """FLOPs of one call of a splash kernel or a Megablox grouped matmul (its backward's
    kernels costed like its forward) named in a compiled HLO op_name, else None."""
    gmm = _GMM_RE.search(op_name)
    if gmm:
        return float(gmm.group(2))
    flops, kind = _SPLASH_RE.search(op_name), _KIND_RE.search(op_name)
    if not (flops and kind):
        return None
    return float(flops.group(1)) * _KERNEL_MATMULS[kind.group(1)] / _KERNEL_MATMULS['fwd']


def kernel_bytes(op_name: str, operand_bytes: list, output_bytes: float,
                 tokens_per_call: dict[str, float]) -> float | None:
    """HBM bytes one call of a kernel named in a compiled HLO op_name moves, read and written,
    else None (not one of these kernels):
      - the paged kernel: its small operands whole, of its pages the tokens_per_call[name]
        tokens an average call reads (the compile job knows the schedule; name: what the pages
        hold), its output;
      - Megablox's grouped matmul: what its name says an average call moves
        (backend.megablox_matmul)."""
    gmm = _GMM_RE.search(op_name)
    if gmm:
        return float(gmm.group(1))
    match = _PAGED_RE.search(op_name)
    if not match or len(operand_bytes) < _PAGED_WHOLE_OPERANDS:
        return None
    tokens = tokens_per_call.get(match.group(1), 0.0)
    return (sum(operand_bytes[:_PAGED_WHOLE_OPERANDS]) + tokens * int(match.group(2))
            + output_bytes)
