"""Cloud TPU slices by accelerator type (as gcloud spells them): chip facts and devices.

`slice_type('v6e-8')` parses a name; `devices(slice, slices=2)` asks libtpu for the compile-only
devices of that many slices, so a program can be lowered and compiled for them on any machine
(MaxText's train_compile.py does the same for its training step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile

GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    generation: str            # as in accelerator types: 'v5e', 'v5p', 'v6e'
    libtpu_name: str           # libtpu's topology prefix
    hbm_bytes: int
    peak_bf16_flops: float     # dense bf16 matmul FLOP/s
    hbm_bytes_per_s: float
    ici_bytes_per_s: float     # bidirectional inter-chip interconnect, per chip
    cores_per_chip: int        # v5p type names count TensorCores, two per chip
    chips_per_host: int
    single_host_chips: int     # the largest slice served by one host
    shapes: dict               # chips -> slice shape, as libtpu takes it


_2D = {1: '1x1', 4: '2x2', 8: '2x4', 16: '4x4', 32: '4x8', 64: '8x8', 128: '8x16', 256: '16x16'}

# Per-chip figures from the Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs/
# v5e, /v5p, /v6e; 2025). HBM is given there in GB or GiB; XLA's memory limit on these chips is
# the GiB figure, less a small runtime reserve that the compile job's 10% headroom covers.
CHIPS = {
    # v5e: 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s, ICI 400 GB/s (1,600 Gbps) per chip.
    'v5e': Chip('v5e', 'v5e', 16 * GiB, 197e12, 819e9, 400e9, 1, 4, 8, _2D),
    # v6e (Trillium): 918 TFLOP/s bf16, 32 GB HBM at 1,640 GB/s, ICI 800 GB/s per chip.
    'v6e': Chip('v6e', 'v6e', 32 * GiB, 918e12, 1640e9, 800e9, 1, 4, 8, _2D),
    # v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s, ICI 1,200 GB/s per chip; two
    # TensorCores per chip (megacore: one JAX device), so v5p-8 is 4 chips.
    'v5p': Chip('v5p', 'v5', 95 * GiB, 459e12, 2765e9, 1200e9, 2, 4, 4,
                {4: '2x2x1', 8: '2x2x2', 16: '2x2x4', 32: '2x4x4', 64: '4x4x4', 128: '4x4x8',
                 256: '4x8x8', 512: '8x8x8', 1024: '8x8x16', 2048: '8x16x16',
                 4096: '16x16x16', 6144: '16x16x24'}),
}
ALIASES = {'v5litepod': 'v5e'}
# jax's device_kind of each generation's chips (a v5p chip shows as 'TPU v5').
DEVICE_KINDS = {'TPU v5 lite': 'v5e', 'TPU v5e': 'v5e', 'TPU v6 lite': 'v6e', 'TPU v6e': 'v6e',
                'TPU v5': 'v5p', 'TPU v5p': 'v5p'}


def chip_of(device_kind: str) -> Chip | None:
    """The Chip a jax device of `device_kind` is; None off TPU or for a generation not known."""
    generation = DEVICE_KINDS.get(device_kind)
    return CHIPS[generation] if generation else None


@dataclasses.dataclass(frozen=True)
class SliceType:
    """One slice of `chips` chips of one generation, e.g. v6e-8."""
    name: str
    chip: Chip
    chips: int

    @property
    def hosts(self) -> int:
        c = self.chip
        return 1 if self.chips <= c.single_host_chips else self.chips // c.chips_per_host

    @property
    def topology(self) -> str:
        return f'{self.chip.libtpu_name}:{self.chip.shapes[self.chips]}'


def slice_type(name: str) -> SliceType:
    """'v6e-8', 'v5litepod-16', 'v5p-32' (TensorCores) -> SliceType; one-line error otherwise."""
    match = re.fullmatch(r'(v\d+[a-z]*|v5litepod)-(\d+)', name.strip())
    generation = ALIASES.get(match.group(1), match.group(1)) if match else None
    if generation not in CHIPS:
        raise ValueError(f'TPU type {name!r}: expected <generation>-<count> with generation one of '
                         f'{sorted(CHIPS) + sorted(ALIASES)}, e.g. v6e-8, v5litepod-16, v5p-32')
    chip = CHIPS[generation]
    count = int(match.group(2))
    chips, odd = divmod(count, chip.cores_per_chip)
    if odd or chips not in chip.shapes:
        offered = ', '.join(f'{generation}-{c * chip.cores_per_chip}' for c in chip.shapes)
        raise ValueError(f'TPU type {name!r}: no such {generation} slice; offered: {offered}')
    return SliceType(name.strip(), chip, chips)


def generation_slices(generation: str) -> list[SliceType]:
    """Every slice of a generation ('v6e'), smallest first."""
    chip = CHIPS[ALIASES.get(generation, generation)]
    return [slice_type(f'{chip.generation}-{c * chip.cores_per_chip}') for c in sorted(chip.shapes)]


def devices(slice_: SliceType, slices: int = 1) -> list:
    """Compile-only TPU devices of `slices` slices of this type (no TPU needed; libtpu is).

    Devices of a multi-slice topology carry `slice_index`."""
    from jax.experimental import topologies

    # Compiling touches no chip: let this process load libtpu even while another holds its lock
    # (any `import jax` without JAX_PLATFORMS=cpu takes it on a machine without TPUs).
    os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
    bounds = (1, 1, 1) if slice_.chips == 1 else (2, 2, 1)
    kwargs = dict(chips_per_host_bounds=bounds)
    if slices > 1:
        kwargs['num_slices'] = slices
    with _libtpu_messages_hidden():
        return list(topologies.get_topology_desc(topology_name=slice_.topology, platform='tpu',
                                                 **kwargs).devices)


@contextlib.contextmanager
def _libtpu_messages_hidden():
    """libtpu, loaded on a machine without TPUs, writes a page of warnings to stderr (file
    descriptor 2, from C++): keep them out of the report unless loading fails."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        except Exception:
            os.dup2(saved, 2)
            captured.seek(0)
            sys.stderr.write(captured.read().decode(errors='replace'))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
