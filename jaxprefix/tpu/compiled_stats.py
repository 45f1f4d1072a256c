"""What one compiled program needs and costs on each chip: HBM, FLOPs, bytes, collectives, time.

Memory comes from XLA's own memory_analysis(). FLOPs and bytes come from walking the compiled
(per-device) HLO text, because XLA's cost_analysis() counts the body of a while loop once: a
model whose layers run under lax.scan would be costed as one layer. The walk multiplies each
loop body by its trip count (read from the loop condition, `counter < N`; a loop without one,
the sampler's decode loop, takes the caller's `unknown_trip_count`), counts dot / convolution
FLOPs inside fusions, and counts bytes at fusion boundaries as XLA does (a parameter only
sliced inside a fusion counts its slice; a dynamic-update-slice in place its update). Pallas
kernels (custom calls) have no FLOPs XLA can see: `kernel_flops(op_name)` supplies them; and a
kernel that reads only part of an operand (the paged decode reads a row's filled pages, not the
pool) says how many bytes it moves, read and written, through `kernel_bytes(op_name,
operand_bytes, output_bytes)`.

The roofline time of a program is max(FLOPs / peak FLOP/s, bytes / HBM bandwidth) per chip;
collectives get their own ICI estimate (ring algorithms: an all-gather moves (g-1)/g of its
result per chip), reported beside it, not added.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

_DTYPE_BYTES = {'pred': 1, 's4': 0.5, 'u4': 0.5, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2,
                'bf16': 2, 's32': 4, 'u32': 4, 'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8,
                'c128': 16, 'token': 0}
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?')
_MEMORY_SPACE = re.compile(r'S\((\d+)\)')
_INSTRUCTION = re.compile(r'^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$')
_HEADER = re.compile(r'^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_CALLED = re.compile(r'\b(?:calls|body|condition|to_apply|true_computation|false_computation)'
                     r'=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_NO_TRAFFIC = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'after-all',
               'partition-id', 'replica-id', 'opt-barrier', 'while', 'conditional', 'call',
               'copy-done', 'all-gather-done', 'all-reduce-done', 'collective-permute-done',
               'async-done', 'async-update', 'send-done', 'recv-done', 'slice-done'}
_SLICING = {'dynamic-slice', 'slice', 'gather'}
# Ops that update their first operand in place, and the index of the operand holding the update.
_UPDATE_OPERAND = {'dynamic-update-slice': 1, 'scatter': 2}
COLLECTIVES = ('all-gather', 'all-reduce', 'reduce-scatter', 'all-to-all', 'collective-permute')


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    shape: str
    operands: list
    args: str    # the text inside the parentheses (a constant's value, a parameter's index)
    attrs: str


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in '({[':
            depth += 1
        elif text[i] in ')}]':
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def _parse_instruction(name: str, rest: str) -> Instruction | None:
    end = _balanced(rest, 0) if rest.startswith('(') else rest.find(' ')
    shape, tail = rest[:end], rest[end:].lstrip()
    opcode = re.match(r'([\w\-]+)\(', tail)
    if not opcode:
        return None
    close = _balanced(tail, opcode.end() - 1)
    args = tail[opcode.end():close - 1]
    return Instruction(name, opcode.group(1), shape, re.findall(r'%([\w.\-]+)', args), args,
                       tail[close:])


def parse_hlo(text: str) -> tuple[dict[str, list[Instruction]], str]:
    """Computations (name -> instructions) of an HLO module's text, and the entry's name."""
    computations: dict[str, list[Instruction]] = {}
    entry, current, pending = '', None, None

    def flush():
        if pending is not None and current is not None:
            parsed = _parse_instruction(*pending)
            if parsed:
                computations[current].append(parsed)

    for line in text.splitlines():
        header = _HEADER.match(line)
        instruction = _INSTRUCTION.match(line) if current is not None else None
        if header and not line.startswith((' ', '\t')):
            flush()
            pending, current = None, header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
        elif instruction:
            flush()
            pending = [instruction.group(1), instruction.group(2)]
        elif line.strip() == '}' and not line.startswith((' ', '\t')):
            flush()
            pending, current = None, None
        elif pending is not None:
            pending[1] += ' ' + line.strip()  # attributes continued over several lines
    flush()
    return computations, entry


def arrays(shape: str, hbm_only: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array of a shape; hbm_only: leave out arrays that XLA placed in
    another memory space than HBM (`S(1)` in their layout: TPU's VMEM, where XLA's memory-space
    assignment keeps small buffers and prefetches weights; `S(2)`, `S(6)`: scalars)."""
    return [(dtype, tuple(int(d) for d in dims.split(',') if d))
            for dtype, dims, layout in _ARRAY.findall(shape)
            if not (hbm_only and _in_other_memory(layout))]


def _in_other_memory(layout: str) -> bool:
    space = _MEMORY_SPACE.search(layout)
    return bool(space) and space.group(1) != '0'


def shape_bytes(shape: str, hbm_only: bool = True) -> float:
    """Bytes of a shape's arrays (by default those in HBM: the traffic a roofline counts)."""
    return sum(_DTYPE_BYTES.get(dtype, 4) * math.prod(dims)
               for dtype, dims in arrays(shape, hbm_only))


@dataclasses.dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> {count, bytes, moved}
    unknown_loops: int = 0
    kernels_without_flops: int = 0

    def add(self, other: Cost, times: float = 1.0) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times
        for kind, c in other.collectives.items():
            mine = self.collectives.setdefault(kind, dict(count=0.0, bytes=0.0, moved=0.0))
            for key in mine:
                mine[key] += c[key] * times
        self.unknown_loops += other.unknown_loops
        self.kernels_without_flops += other.kernels_without_flops


class HloCost:
    """Costs of one compiled HLO module, per device."""

    def __init__(self, text: str, *, num_devices: int, unknown_trip_count: int = 1,
                 rare_branch_calls: int | None = None, rare_loop_trips: int | None = None,
                 kernel_flops: Callable[[str], float | None] = lambda op_name: None,
                 kernel_bytes: Callable[[str, list, float], float | None]
                 = lambda op, sizes, out: None):
        """rare_branch_calls: how many times in all a conditional in the body of a loop of
        unknown trip count takes its costliest branch (the continuous sampler's admissions:
        a prefill now and then, a no-op otherwise); None: at every iteration (an upper bound).
        rare_loop_trips: how many iterations in all a loop of unknown trip count in that body
        runs (a multi-turn decode's appending passes, a few an observation); None: counted as
        any loop of unknown trip count, at every iteration of the outer one."""
        self.computations, self.entry = parse_hlo(text)
        self.shapes = {c: {i.name: i.shape for i in body} for c, body in self.computations.items()}
        self.num_devices = num_devices
        self.unknown_trip_count = unknown_trip_count
        self.rare_branch_calls = rare_branch_calls
        self.rare_loop_trips = rare_loop_trips
        self.kernel_flops = kernel_flops
        self.kernel_bytes = kernel_bytes
        self._costs: dict[str, Cost] = {}

    def total(self) -> Cost:
        return self._cost(self.entry)

    def _cost(self, computation: str) -> Cost:
        if computation not in self._costs:
            cost = Cost()
            for ins in self.computations.get(computation, []):
                cost.add(self._instruction(computation, ins))
            self._costs[computation] = cost
        return self._costs[computation]

    def _instruction(self, computation: str, ins: Instruction) -> Cost:
        cost = Cost()
        op = ins.opcode
        called = _CALLED.findall(ins.attrs)
        if op == 'while':
            body, condition = _attr(ins.attrs, 'body'), _attr(ins.attrs, 'condition')
            trips = self._trip_count(computation, ins, condition)
            if trips is None and self.rare_branch_calls is not None:
                cost.unknown_loops = 1
                self._add_rare_branch_loop(cost, body, self.unknown_trip_count)
            else:
                if trips is None:
                    trips, cost.unknown_loops = self.unknown_trip_count, 1
                cost.add(self._cost(body), trips)
            cost.add(self._cost(condition), (trips or self.unknown_trip_count) + 1)
            return cost
        if op == 'conditional':
            branches = self._branches(ins, called)
            if branches:
                cost.add(branches[-1])
            return cost
        if op in ('call', 'async-start'):
            for c in called:
                cost.add(self._cost(c))
            return cost
        if op == 'fusion':
            fused = _attr(ins.attrs, 'calls')
            inner = self._cost(fused)
            cost.flops = inner.flops
            cost.bytes = self._fusion_bytes(computation, ins, fused)
            return cost
        kind = op.removesuffix('-start')
        if kind in COLLECTIVES:
            cost.collectives[kind] = self._collective(computation, ins, kind)
        if op in ('dot', 'convolution'):
            cost.flops = self._matmul_flops(computation, ins)
        elif op == 'custom-call':
            flops = self.kernel_flops(_op_name(ins.attrs))
            if flops is None and 'tpu_custom_call' in ins.attrs:
                cost.kernels_without_flops = 1
            cost.flops = flops or 0.0
        moved = None
        if op == 'custom-call':
            table = self.shapes[computation]
            moved = self.kernel_bytes(_op_name(ins.attrs),
                                      [shape_bytes(table.get(o, '')) for o in ins.operands],
                                      shape_bytes(ins.shape))
        if moved is not None:
            cost.bytes = moved
        elif op in _SLICING:  # reads the slice where its source is, writes it where it goes
            cost.bytes = (self._moved(computation, ins.operands[:1], ins.shape)
                          + shape_bytes(ins.shape))
        elif op == 'slice-start':  # ((source), destination, context): an async slice
            destination = _ARRAY.search(ins.shape[ins.shape.index(')') + 1:])
            destination = destination.group(0) if destination else ''
            cost.bytes = (self._moved(computation, ins.operands[:1], destination)
                          + shape_bytes(destination))
        elif 'custom_call_target="AllocateBuffer"' in ins.attrs:
            cost.bytes = 0.0  # reserves memory, moves none
        elif op == 'copy-start':  # (destination, source, context): an async copy between spaces
            destination = ins.shape[1:].split(', ')[0] if ins.shape.startswith('(') else ins.shape
            cost.bytes = self._operand_bytes(computation, ins.operands) + shape_bytes(destination)
        elif op in _UPDATE_OPERAND:  # in place: reads the update, writes it into the buffer
            update = _UPDATE_OPERAND[op]
            written = self.shapes[computation].get(ins.operands[update], '') \
                if len(ins.operands) > update else ''
            cost.bytes = (self._operand_bytes(computation, ins.operands[update:update + 1])
                          + self._moved(computation, ins.operands[:1], written))
        elif op not in _NO_TRAFFIC:
            cost.bytes = shape_bytes(ins.shape) + self._operand_bytes(computation, ins.operands)
        return cost

    # --- pieces -------------------------------------------------------------------------------

    def _branches(self, ins: Instruction, called: list[str]) -> list[Cost]:
        """The costs of a conditional's branches, cheapest first (by FLOPs)."""
        names = re.findall(r'%?([\w.\-]+)', (_BRANCHES.search(ins.attrs) or [None, ''])[1])
        names += [c for c in called if c not in names]
        return sorted((self._cost(b) for b in names), key=lambda c: c.flops)

    def _add_rare_branch_loop(self, cost: Cost, body: str, trips: int) -> None:
        """`trips` runs of `body`, whose conditionals take their costliest branch only
        rare_branch_calls times in all and their cheapest otherwise."""
        rare = min(self.rare_branch_calls, trips)
        for ins in self.computations.get(body, []):
            if ins.opcode == 'while' and self.rare_loop_trips is not None:
                inner, condition = _attr(ins.attrs, 'body'), _attr(ins.attrs, 'condition')
                if self._trip_count(body, ins, condition) is None:  # iterations in all
                    cost.unknown_loops += 1
                    cost.add(self._cost(inner), self.rare_loop_trips)
                    cost.add(self._cost(condition), trips + self.rare_loop_trips)
                    continue
            if ins.opcode != 'conditional':
                cost.add(self._instruction(body, ins), trips)
                continue
            branches = self._branches(ins, _CALLED.findall(ins.attrs))
            if branches:
                cost.add(branches[0], trips - rare)
                cost.add(branches[-1], rare)

    def _moved(self, computation: str, buffers, shape: str) -> float:
        """Bytes of `shape` (in any memory) when the first of `buffers` is in HBM, else 0."""
        table = self.shapes[computation]
        in_hbm = not buffers or shape_bytes(table.get(buffers[0], ''), hbm_only=True) > 0 or \
            shape_bytes(table.get(buffers[0], ''), hbm_only=False) == 0
        return shape_bytes(shape, hbm_only=False) if in_hbm else 0.0

    def _operand_bytes(self, computation: str, names) -> float:
        table = self.shapes[computation]
        return sum(shape_bytes(table.get(n, '')) for n in names)

    def _fusion_bytes(self, computation: str, ins: Instruction, fused: str) -> float:
        """Bytes a fusion reads and writes: a parameter only sliced inside counts its slices; a
        buffer updated in place (dynamic-update-slice, scatter) counts only its update, written
        (a decode step's scatter of one token into the KV cache moves that token, not the cache)."""
        body = self.computations.get(fused, [])
        if not body:
            return shape_bytes(ins.shape) + self._operand_bytes(computation, ins.operands)
        table = {i.name: i for i in body}
        root = body[-1]
        outputs = [table[o] for o in root.operands if o in table] if root.opcode == 'tuple' \
            else [root]
        in_place = {o.operands[0] for o in outputs if o.opcode in _UPDATE_OPERAND}
        reads = 0.0
        for i in body:
            if i.opcode != 'parameter' or i.name in in_place:
                continue
            index = int(i.args)
            operand = ins.operands[index] if index < len(ins.operands) else ''
            full = shape_bytes(self.shapes[computation].get(operand, i.shape))
            reads += self._read_bytes(fused, i, full)
        # Outputs XLA placed outside HBM (the fusion's own layouts say where) write no HBM bytes.
        in_hbm = [not _in_other_memory(layout) for _, _, layout in _ARRAY.findall(ins.shape)]
        writes = 0.0
        for k, o in enumerate(outputs):
            if k < len(in_hbm) and not in_hbm[k]:
                continue
            update = o.operands[_UPDATE_OPERAND[o.opcode]] if o.opcode in _UPDATE_OPERAND else None
            written = table[update].shape if update in table else o.shape
            writes += shape_bytes(written, hbm_only=False)
        return reads + writes

    def _read_bytes(self, fused: str, param: Instruction, full: float) -> float:
        """Bytes a fusion reads of its parameter `param` (`full` bytes): only its slices when it
        is only sliced, also inside nested fusions (a decode step's layer of stacked weights)."""
        uses = [i for i in self.computations.get(fused, []) if param.name in i.operands]
        if not uses:
            return full
        total = 0.0
        for use in uses:
            if use.opcode in _SLICING:  # read from where the parameter is (`full`: HBM or not)
                total += shape_bytes(use.shape, hbm_only=False)
            elif use.opcode == 'fusion':
                inner = _attr(use.attrs, 'calls')
                params = {i.args: i for i in self.computations.get(inner, [])
                          if i.opcode == 'parameter'}
                for k, operand in enumerate(use.operands):
                    if operand == param.name and str(k) in params:
                        total += self._read_bytes(inner, params[str(k)], full)
            else:
                return full
        return min(full, total)

    def _matmul_flops(self, computation: str, ins: Instruction) -> float:
        table = self.shapes[computation]
        out = arrays(ins.shape)
        lhs = arrays(table.get(ins.operands[0], '')) if ins.operands else []
        if not out or not lhs:
            return 0.0
        out_elements = math.prod(out[0][1])
        lhs_dims = lhs[0][1]
        if ins.opcode == 'dot':
            dims = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', ins.attrs)
            contract = [int(d) for d in dims.group(1).split(',') if d] if dims else []
            return 2.0 * out_elements * math.prod(lhs_dims[d] for d in contract)
        labels = re.search(r'dim_labels=(\w+)_(\w+)->(\w+)', ins.attrs)
        rhs = arrays(table.get(ins.operands[1], '')) if len(ins.operands) > 1 else []
        if not labels or not rhs:
            return 0.0
        lhs_labels, _, out_labels = labels.groups()
        out_dims = out[0][1]
        groups = re.search(r'feature_group_count=(\d+)', ins.attrs)
        contract = lhs_dims[lhs_labels.index('f')] // (int(groups.group(1)) if groups else 1)
        batch_groups = re.search(r'batch_group_count=(\d+)', ins.attrs)
        if batch_groups:  # weight-gradient form: each output sums over its batch group too
            contract *= lhs_dims[lhs_labels.index('b')] // int(batch_groups.group(1))
        # Spatial dimensions: count only (output, window) pairs that land on real input, not on
        # padding (TPU matmuls are often convolutions with a padded window).
        spatial = [l for l in out_labels if l.isdigit()]
        window = _window(ins.attrs, len(spatial))
        pairs = 1
        out_spatial = 1
        for d, label in enumerate(spatial):
            n_in, n_out = lhs_dims[lhs_labels.index(label)], out_dims[out_labels.index(label)]
            pairs *= _window_pairs(n_in, n_out, *(w[d] for w in window))
            out_spatial *= n_out
        return 2.0 * out_elements / max(out_spatial, 1) * pairs * contract

    def _collective(self, computation: str, ins: Instruction, kind: str) -> dict:
        sizes = [_DTYPE_BYTES.get(d, 4) * math.prod(s) for d, s in arrays(ins.shape)]
        table = self.shapes[computation]
        sizes += [shape_bytes(table.get(o, ''), hbm_only=False) for o in ins.operands]
        size = max(sizes, default=0.0)
        g = _group_size(ins.attrs, self.num_devices)
        share = (g - 1) / g if g > 1 else 0.0
        moved = {'all-reduce': 2 * share * size, 'collective-permute': size}.get(kind, share * size)
        return dict(count=1.0, bytes=size, moved=moved)

    def _trip_count(self, computation: str, ins: Instruction, condition: str) -> int | None:
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
        if known:
            return int(known.group(1))
        body = self.computations.get(condition, [])
        if not body:
            return None
        root = body[-1]
        table = {i.name: i for i in body}
        if root.opcode != 'compare' or 'direction=LT' not in root.attrs or len(root.operands) != 2:
            return None
        counter, limit = (table.get(o) for o in root.operands)
        if not (counter and limit and counter.opcode == 'get-tuple-element'
                and limit.opcode == 'constant'):
            return None
        value = re.fullmatch(r'\s*(-?\d+)\s*', limit.args)
        index = re.search(r'index=(\d+)', counter.attrs)
        if not (value and index):
            return None
        start = self._initial_value(computation, ins, int(index.group(1)))
        step = self._counter_step(_attr(ins.attrs, 'body'), int(index.group(1)))
        return max(0, -(-(int(value.group(1)) - start) // step)) if step else None

    def _counter_step(self, body: str, index: int) -> int | None:
        """What the loop body adds to tuple element `index` (the counter) each iteration."""
        instructions = self.computations.get(body, [])
        table = {i.name: i for i in instructions}
        root = instructions[-1] if instructions else None
        if root is None or root.opcode != 'tuple' or index >= len(root.operands):
            return None
        update = table.get(root.operands[index])
        if update is None or update.opcode != 'add':
            return None
        for name in update.operands:
            operand = table.get(name)
            if operand is not None and operand.opcode == 'constant':
                number = re.fullmatch(r'\s*(-?\d+)\s*', operand.args)
                return int(number.group(1)) if number and int(number.group(1)) > 0 else None
        return None

    def _initial_value(self, computation: str, ins: Instruction, index: int) -> int:
        """The loop counter's value on entry when it is a constant (XLA's loops start at 0)."""
        table = {i.name: i for i in self.computations[computation]}
        init = table.get(ins.operands[0]) if ins.operands else None
        if init is not None and init.opcode == 'tuple' and index < len(init.operands):
            value = table.get(init.operands[index])
            while value is not None and value.opcode == 'copy':
                value = table.get(value.operands[0])
            if value is not None and value.opcode == 'constant':
                number = re.fullmatch(r'\s*(-?\d+)\s*', value.args)
                if number:
                    return int(number.group(1))
        return 0


def _attr(attrs: str, key: str) -> str:
    match = re.search(rf'\b{key}=%?([\w.\-]+)', attrs)
    return match.group(1) if match else ''


def _window(attrs: str, dims: int) -> tuple[list, list, list, list, list]:
    """(sizes, low pads, strides, lhs dilations, rhs dilations) of a convolution's window."""
    match = re.search(r'window=\{([^}]*)\}', attrs)
    fields = dict(f.split('=', 1) for f in match.group(1).split()) if match else {}
    per_dim = lambda key, default: ([int(x.split('_')[0]) for x in fields[key].split('x')]
                                    if key in fields else [default] * dims)
    return (per_dim('size', 1), per_dim('pad', 0), per_dim('stride', 1), per_dim('lhs_dilate', 1),
            per_dim('rhs_dilate', 1))


def _window_pairs(n_in: int, n_out: int, size: int, low: int, stride: int, lhs_dilation: int,
                  rhs_dilation: int) -> int:
    """How many (output position, window offset) pairs of one spatial dimension read an input
    element rather than padding."""
    last = (n_in - 1) * lhs_dilation
    total = 0
    for k in range(size):
        shift = k * rhs_dilation - low  # input index of output 0 at this offset
        if lhs_dilation == 1:  # outputs o with 0 <= o * stride + shift <= last
            first, final = -(-max(0, -shift) // stride), (last - shift) // stride
            total += max(0, min(final, n_out - 1) - first + 1)
        else:
            total += sum(1 for o in range(n_out) if 0 <= o * stride + shift <= last
                         and (o * stride + shift) % lhs_dilation == 0)
    return total


def _op_name(attrs: str) -> str:
    match = re.search(r'op_name="([^"]*)"', attrs)
    return match.group(1) if match else ''


def _group_size(attrs: str, num_devices: int) -> int:
    """Devices per replica group of a collective, in any of HLO's spellings."""
    listed = re.search(r'replica_groups=\{\{([^}]*)\}', attrs)
    if listed:
        return len([d for d in listed.group(1).split(',') if d.strip()])
    iota = re.search(r'replica_groups=\[([\d,]+)\]<=', attrs)
    if iota:
        return int(iota.group(1).split(',')[-1])
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if mesh:
        sizes = {a: int(n) for a, n in re.findall(r"'(\w+)'=(\d+)", mesh.group(1))}
        return math.prod(sizes.get(a, 1) for a in re.findall(r"'(\w+)'", mesh.group(2)))
    return num_devices
