"""What the compile job reports: each compiled program's figures against its chip
(program_report), the sampler's rows and KV against its budget (sampler_figures), why a slice
does not fit (shortfall, split_shortfall), and compile.json as the table the job prints.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxprefix.models.config import ModelConfig
from jaxprefix.tpu import compiled_stats, costing, programs, topology
from jaxprefix.tpu.topology import GiB

def shortfall(report: dict) -> str:
    worst = max((p for p in report['programs'].values() if not p['fits']),
                key=lambda p: p['hbm_bytes_per_chip'] / p['usable_bytes'])
    over = (worst['hbm_bytes_per_chip'] - worst['usable_bytes']) / GiB
    line = (f"{worst['name']} does not fit {report['topology']}: it needs "
            f"{worst['hbm_bytes_per_chip'] / GiB:.1f} GiB per chip, {over:.1f} GiB over the "
            f"{worst['usable_bytes'] / GiB:.1f} GiB usable ({1 - report['headroom']:.0%} of "
            f"{worst['hbm_capacity_bytes'] / GiB:.0f} GiB)")
    if over <= 0 and worst.get('error'):
        line = f"{worst['name']} does not fit {report['topology']}: {worst['error']}"
    return line


def split_shortfall(split: dict) -> str:
    """Why a split does not fit, in one line: each side's programs that do not."""
    if 'learner' not in split:  # refused before compiling
        return split['why']
    return '; '.join(f"{side}: {p['name']} needs {p['hbm_bytes_per_chip'] / GiB:.1f} GiB a "
                     f"chip of {p['usable_bytes'] / GiB:.1f} usable"
                     + (f" ({p['error'][:120]})" if p.get('error') else '')
                     for side in ('learner', 'sampler')
                     for p in split[side]['programs'].values() if not p['fits'])


def sampler_figures(rows: list, decode: programs.Program | None, step: programs.StepShape,
                    model_config: ModelConfig, chip: topology.Chip, chips: int) -> dict:
    """The sampler's HBM seconds a step beside its floor, and what they mean in tokens.

    The floor is what the step's decoding must read at the least, every row running to
    max_new_tokens (in every turn of a tool run's episodes; docs/SCALING.md), spread over every
    chip's HBM: the KV (costing.kv_read_floor_seconds, in the KV dtype); and the weights, at
    each of the decode's steps (its generations of `decode.rows_in_flight` rows) those its rows
    need, once: every weight but the embedding table, of a MoE's experts those some row routes
    to (ModelConfig.decode_step_params)."""
    from jaxprefix.sampling import budget

    token = budget.page_bytes_per_token(model_config, step.rollout.kv_dtype or model_config.dtype)
    in_flight = decode.rows_in_flight if decode is not None else 0
    steps = decode.unknown_trip_count if decode is not None else 0
    weights = steps * model_config.decode_step_params(in_flight) * jnp.dtype(
        model_config.dtype).itemsize
    weights_s = costing.hbm_seconds(weights / chips, chip)
    floor = weights_s + costing.kv_read_floor_seconds(
        rows=step.rows, contexts=step.contexts, context_length=step.context_length,
        max_new_tokens=step.new_tokens_per_row, kv_bytes_per_token=token, chips=chips,
        chip=chip)
    sampler = [p for p in rows if p['name'].startswith('sampler') and p['roofline']]
    hbm = sum(p['calls_per_step'] * p['roofline']['hbm_s'] for p in sampler)
    seconds = sum(p['calls_per_step'] * p['roofline']['seconds'] for p in sampler)
    generated = step.rows * step.new_tokens_per_row
    return {'sampler_hbm_s': hbm, 'sampler_hbm_floor_s': floor,
            'sampler_floor_weights_s': weights_s,
            'sampler_vs_floor': hbm / floor if floor else None,
            'sampler_ici_s': sum(p['calls_per_step'] * p['roofline']['ici_s'] for p in sampler),
            'rows_in_flight': in_flight, 'decode_steps': steps,
            'generated_tokens_per_s_per_chip': generated / seconds / chips if seconds else None}


def program_report(p: programs.Program, chip: topology.Chip, devices: int,
                   headroom: float) -> dict:
    """compile.json's entry for one program (bytes and FLOPs per chip, per call)."""
    usable = (1 - headroom) * chip.hbm_bytes
    entry = {'name': p.name, 'shapes': p.shapes, 'calls_per_step': p.calls_per_step,
             'hbm_capacity_bytes': chip.hbm_bytes, 'usable_bytes': usable,
             'resident_bytes': p.resident_bytes, 'resident': p.resident_note}
    if p.compiled is None:  # refused by the compiler: what it said it needed, at least
        hbm = p.required_bytes + p.resident_bytes
        return entry | {'hbm_bytes_per_chip': hbm, 'fits': False, 'error': p.error,
                        'headroom_fraction': 1 - hbm / chip.hbm_bytes, 'flops': None,
                        'bytes_accessed': None, 'collectives': {}, 'roofline': None}
    memory = p.compiled.memory_analysis()
    hbm = hbm_bytes(p)
    cost = compiled_stats.HloCost(p.compiled.as_text(), num_devices=devices,
                                  unknown_trip_count=p.unknown_trip_count,
                                  rare_branch_calls=p.rare_branch_calls,
                                  rare_loop_trips=p.rare_loop_trips,
                                  kernel_flops=costing.kernel_flops,
                                  kernel_bytes=functools.partial(
                                      costing.kernel_bytes,
                                      tokens_per_call=p.paged_tokens_per_call)).total()
    return entry | {
        'hbm_bytes_per_chip': hbm, 'fits': hbm <= usable,
        'headroom_fraction': 1 - hbm / chip.hbm_bytes,
        'argument_bytes': memory.argument_size_in_bytes,
        'output_bytes': memory.output_size_in_bytes,
        'alias_bytes': memory.alias_size_in_bytes, 'temp_bytes': memory.temp_size_in_bytes,
        'code_bytes': memory.generated_code_size_in_bytes,
        'flops': cost.flops, 'bytes_accessed': cost.bytes, 'collectives': cost.collectives,
        'loops_with_assumed_trip_count': cost.unknown_loops,
        'assumed_trip_count': p.unknown_trip_count if cost.unknown_loops else None,
        'kernels_without_flops': cost.kernels_without_flops,
        'roofline': costing.roofline(cost.flops, cost.bytes,
                                     sum(c['moved'] for c in cost.collectives.values()), chip),
    }


def hbm_bytes(p: programs.Program) -> float:
    """HBM per chip a compiled program needs: XLA's arguments + outputs - donated + temporaries
    + code, and what stays resident beside it (0: not compiled)."""
    if p.compiled is None:
        return 0.0
    memory = p.compiled.memory_analysis()
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes
            + memory.generated_code_size_in_bytes + p.resident_bytes)


def table(report: dict) -> str:
    """The printed summary: one row per program, per chip and per call."""
    step = report['step']
    model = report['model']
    turns = step.get('max_turns', 1)
    sampled = (f"{turns} turns of up to {step['max_new_tokens']} new tokens in "
               f"{step['episode_token_budget']} tokens an episode" if turns > 1
               else f"{step['max_new_tokens']} new tokens")
    lines = [
        f"compile: {report['slices']} x {report['topology']} ({report['chips']} chips, "
        f"{report['hosts']} host(s)), mesh {report['mesh']}",
        f"model {model['model_type']} {model['params'] / 1e9:.2f}B params ({model['param_dtype']} "
        f"parameters, {model['dtype']} compute); step: {step['contexts']} contexts x "
        f"n={step['n']} = {step['rows']} rows, context {step['context_length']} + "
        f"{sampled}, learner width {step['learner_width']}", '',
        '| program | calls/step | HBM GiB/chip | args | temp | resident | headroom | fits '
        '| TFLOP | GB | compute s | HBM s | ICI s | collectives |',
        '|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|']
    for p in report['programs'].values():
        if p['roofline'] is None:
            lines.append(f"| {p['name']} | {p['calls_per_step']} | >= "
                         f"{p['hbm_bytes_per_chip'] / GiB:.2f} | | | "
                         f"{p['resident_bytes'] / GiB:.2f} | | **no** | | | | | | {p['error']} |")
            continue
        collectives = ', '.join(f"{kind} {c['count']:,.0f}x" for kind, c in p['collectives'].items())
        cells = [p['name'], p['calls_per_step'], f"{p['hbm_bytes_per_chip'] / GiB:.2f}",
                 f"{p['argument_bytes'] / GiB:.2f}", f"{p['temp_bytes'] / GiB:.2f}",
                 f"{p['resident_bytes'] / GiB:.2f}", f"{p['headroom_fraction']:.0%}",
                 'yes' if p['fits'] else '**no**', f"{p['flops'] / 1e12:,.1f}",
                 f"{p['bytes_accessed'] / 1e9:,.1f}", f"{p['roofline']['compute_s']:,.2f}",
                 f"{p['roofline']['hbm_s']:,.2f}", f"{p['roofline']['ici_s']:,.2f}",
                 collectives or '-']
        lines.append('| ' + ' | '.join(str(x) for x in cells) + ' |')
    lines += ['', f"Per chip and per call, on {report['topology']} chips of "
              f"{report['chip']['hbm_bytes'] / GiB:.0f} GiB (fits: within "
              f"{1 - report['headroom']:.0%}). HBM = arguments + outputs - donated + temporaries + "
              "code + resident (the training state, in HBM while the sampler runs). Roofline "
              "seconds per call = max(compute s, HBM s); ICI s (collectives) shown beside it. "
              f"One step's roofline: {step['roofline_seconds']:,.0f} s."]
    if step.get('sampler_vs_floor'):
        lines.append(f"Sampler: {step['sampler_hbm_s']:,.0f} s of HBM time against a floor of "
                     f"{step['sampler_hbm_floor_s']:,.0f} s ({step['sampler_vs_floor']:.2f}x; "
                     f"{step['kv_dtype']} KV, the weights "
                     f"{step['sampler_floor_weights_s']:,.0f} s of it), "
                     f"{step['rows_in_flight']:,} rows in flight, {step['sampler_ici_s']:,.0f} s "
                     f"of ICI; {step['generated_tokens_per_s_per_chip']:,.0f} generated tokens/s "
                     f"per chip when every row runs to {turns * step['max_new_tokens']:,} "
                     "tokens.")
    return '\n'.join(lines + _pipeline_lines(report.get('pipeline', {})))


def _pipeline_lines(block: dict) -> list[str]:
    """The split's figures beside the sequential step, and the search's, if any."""
    lines = []
    if 'devices' in block:
        s, l, t = block['sampler'], block['learner'], block['transfer']
        seconds = lambda side: f"{side['seconds']:,.0f} s" if side['fits'] else 'does not fit'
        lines += ['', f"Split at rollout.devices={block['devices']}: sampler on {s['chips']} "
                  f"chips (mesh {s['mesh']}) {seconds(s)} a step, learner on {l['chips']} "
                  f"(mesh {l['mesh']}) {seconds(l)}, weights copy {t['seconds']:,.2f} s "
                  f"({t['bytes_per_sampler_chip'] / GiB:.2f} GiB a sampler chip).",
                  '| side | program | HBM GiB/chip | fits | roofline s |', '|---|---|---:|---|---:|']
        for name in ('sampler', 'learner'):
            for p in block[name]['programs'].values():
                lines.append(f"| {name} | {p['name']} | {p['hbm_bytes_per_chip'] / GiB:.2f} | "
                             f"{'yes' if p['fits'] else '**no**'} | "
                             + (f"{p['roofline']['seconds']:,.2f} |" if p['roofline'] else
                                f"{p['error'][:100]} |"))
        if block['fits']:
            lines.append(f"Pipelined step (max(sampler, learner) + copy; train.max_staleness "
                         f">= 1): {block['pipelined_s']:,.0f} s against the sequential "
                         f"{block['sequential_s']:,.0f} s.")
    if 'search' in block:
        lines.append('Splits tried (compile.search_split):')
    for tried in block.get('search', []):
        sampler = tried.get('sampler', {}).get('seconds')
        lines.append(f"  rollout.devices={tried['devices']}: " + (
            f"pipelined {tried['pipelined_s']:,.0f} s" if tried['fits'] else tried['why'])
            + (f" (sampler {sampler:,.0f} s)" if sampler and not tried['fits'] else ''))
    if 'search' in block:
        lines.append(f"Fastest split: rollout.devices={block['best_devices']}; sequential "
                     f"{block['sequential_s']:,.0f} s." if block['best_devices'] else
                     'No split fits.')
    return lines
