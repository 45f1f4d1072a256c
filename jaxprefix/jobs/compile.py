"""The compile job: does a run fit a TPU slice, and how fast could it go? Asked before renting it.

    python -m jaxprefix.main --config=configs/pope.py:paper --config.job=compile \
        --config.compile.topology=v6e-8 [--config.compile.slices=2] --workdir=/tmp/compile

No TPU is needed, only libtpu (the `tpu` and `test` extras install it): the model is built from
its config.json alone (the model path's, or a shipped copy: models/published.py), the run's mesh
is laid over the compile-only devices of the slice (topology.py), and every program one RL step
runs is compiled by the TPU compiler at the run's shapes (programs.py). For each, compile.json
and the printed table give HBM per chip against the chip's capacity (the training state that
stays resident while the sampler runs is counted in the sampler's programs), FLOPs, bytes,
collectives and a roofline time (compiled_stats.py). Exit status 0 only when every program fits
within (1 - compile.headroom) of HBM; otherwise one line names the program and the shortfall.

Sampler and learner on chips of their own (rollout.devices = d; docs/SCALING.md): the learner's
update is compiled again with config.mesh over the slice's first chips, the sampler's programs
with the decode's layout over the last d, and compile.json's `pipeline` block sets each side's
roofline seconds a step, the copy of the weights after each update and the pipelined step
(costing.pipelined_seconds) beside the sequential one; compile.search_split tries each power
of two below the slice's chips for d.
"""
from __future__ import annotations

import time

import jax
from absl import logging
from flax import nnx

from jaxprefix import storage
from jaxprefix.errors import ConfigError
from jaxprefix.run_setup.learner_settings import routing_replay
from jaxprefix.run_setup.run_settings import RunSettings, resolve
from jaxprefix.run_setup.policy import model_dtypes
from jaxprefix.models import published
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.sharding import make_mesh, split_meshes
from jaxprefix.rl.loop_settings import check_rows
from jaxprefix.rl.train_step import Learner
from jaxprefix.sampling import decode_layout
from jaxprefix.jobs import compile_report
from jaxprefix.tpu import costing, programs, topology
from jaxprefix.tpu.topology import GiB

REPORT = 'compile.json'


def run_compile(config, workdir: str) -> dict:
    """Compiles the run's programs for config.compile.topology; writes compile.json, prints the
    table, and raises SystemExit (one line) when a program does not fit.

    A topology naming only a generation ('v6e') tries its slices from the smallest up and
    reports the first on which everything fits: the slice to rent.

    With rollout.devices = d > 0 (the sampler on d chips of its own, the learner on the rest)
    or compile.search_split, the splits are compiled too (`pipeline`); with d > 0 the exit
    status is the split's: whether each side fits its own chips."""
    c = config.compile
    if not c.topology:
        raise ConfigError('config.compile.topology is empty: expected a TPU type such as v6e-8, '
                          'v5litepod-16 or v5p-32, or a generation (v6e) for the smallest fit')
    if c.slices < 1:
        raise ConfigError(f'config.compile.slices={c.slices}: expected >= 1')
    if not 0 <= c.headroom < 1:
        raise ConfigError(f'config.compile.headroom={c.headroom}: expected a fraction in [0, 1)')
    if c.context_length < 1:
        raise ConfigError(f'config.compile.context_length={c.context_length}: expected the '
                          'longest context (prompt plus guidance or prefix) in tokens, >= 1')
    settings = resolve(config)  # what the rl job would run (the allocation applied), checked
    model_config = run_model_config(settings.config)
    step = step_shape(settings, model_config)
    if step.episodes and step.episode_token_budget <= c.context_length:
        raise ConfigError(f'config.compile.context_length={c.context_length}: expected below the '
                          f'tokens an episode may hold ({step.episode_token_budget}: '
                          f'tools.episode_token_budget, 0 for the model\'s context)')
    generation = c.topology.strip()
    candidates = (topology.generation_slices(generation)
                  if generation in topology.CHIPS or generation in topology.ALIASES
                  else [topology.slice_type(generation)])
    devices = config.rollout.devices
    if devices and len(candidates) == 1:  # a split that does not divide: before any compile
        slice_meshes(settings, model_config, candidates[0], devices)
    search, report = [], None
    for slice_ in candidates:
        try:
            report = compile_for(settings, model_config, slice_, workdir,
                                 searching=len(candidates) > 1)
        except ValueError as e:  # the batch does not split over its chips, or their HBM is
            if len(candidates) == 1:  # too small for the training state alone
                raise
            search.append({'topology': slice_.name, 'fits': False, 'why': str(e)})
            continue
        search.append({'topology': slice_.name, 'fits': report['fits'],
                       'why': '' if report['fits'] else compile_report.shortfall(report)})
        compiled_on = slice_
        if report['fits']:
            break
    if report is None:
        raise ValueError(f'config.compile.topology={c.topology!r}: the run fits no slice size '
                         f'(tried {", ".join(s["topology"] for s in search)})')
    if len(candidates) > 1:
        report['search'] = search
    # The sequential step beside, with rollout.devices or compile.search_split, the split's.
    report['pipeline'] = pipeline(settings, model_config, compiled_on, workdir, report)
    storage.write_json(storage.join(workdir, REPORT), report)
    print(compile_report.table(report))
    split = report['pipeline']
    if devices and not split['fits']:  # the run's own layout is the split
        raise SystemExit(f"compile: rollout.devices={devices} does not fit {report['topology']}: "
                         f"{split['why']}; see {storage.join(workdir, REPORT)}")
    if not devices and not report['fits']:
        raise SystemExit(f"compile: {compile_report.shortfall(report)}; "
                         f"see {storage.join(workdir, REPORT)}")
    if len(candidates) > 1:
        print(f"smallest {generation} slice that fits: {report['topology']}")
    return report


def compile_for(settings: RunSettings, model_config: ModelConfig, slice_: topology.SliceType,
                workdir: str, *, searching: bool = False) -> dict:
    """compile.json's content for one slice type (times config.compile.slices); each compiled
    program's HLO text goes to <workdir>/hlo/<slice>/ for a closer look. `searching` (a slice of
    a generation's search): a slice whose chips cannot hold the training state is refused
    (ValueError) before anything is compiled."""
    config, train, spec = settings.config, settings.train, settings.rollout
    c = config.compile
    start = time.perf_counter()
    contexts = settings.method.contexts_per_step
    mesh = make_mesh(**config.mesh, devices=topology.devices(slice_, c.slices))
    check_rows(train, contexts, config.rollout.n, mesh,
               problems_per_step=config.train.problems_per_step)
    step = step_shape(settings, model_config)
    model = programs.abstract_model(model_config, mesh, settings.loop.adapters)
    logging.info('compile: %s on %d x %s, mesh %s', model_config.model_type, c.slices, slice_.name,
                 dict(mesh.shape))
    learner = Learner(model, train, mesh)
    state = _abstract_state(learner, slice_)
    held = programs.bytes_per_chip(state) + programs.bytes_per_chip(learner.rest)
    if searching and held > (1 - c.headroom) * slice_.chip.hbm_bytes:  # nothing to compile
        raise ValueError(_state_too_big(held, slice_, c.headroom))
    compiled = _timed('learner update', lambda: programs.learner_programs(
        learner, state, train, step))
    usable = (1 - c.headroom) * slice_.chip.hbm_bytes
    # the sampler can wait
    if searching and not 0 < compile_report.hbm_bytes(compiled[0]) <= usable:
        return _report(config, model_config, slice_, workdir, mesh, step, compiled, learner,
                       state, None, start)
    # While the sampler runs on its compute-dtype copy of the weights, the training state (master
    # weights or adapters, optimizer moments) stays in HBM.
    decode = decode_layout(mesh, model_config, spec.tensor_parallel)
    sampler_model, copies, copies_note, reshard = programs.sampling_model(learner, state, decode)
    if reshard is not None:
        compiled.append(reshard)
    resident = programs.bytes_per_chip(state) + copies
    note = 'training state: trained weights and optimizer moments'
    if copies:
        note += ', ' + copies_note
    if train.kl_coef > 0:
        resident += programs.bytes_per_chip(state.params)
        note += ', KL reference weights'
    sampled, kv_budget = _sampler(sampler_model, mesh, step, slice_.chip, resident, note)
    compiled += sampled

    return _report(config, model_config, slice_, workdir, mesh, step, compiled, learner, state,
                   kv_budget, start)


def step_shape(settings: RunSettings, model_config: ModelConfig) -> programs.StepShape:
    """What one step of the run samples and trains on: a tool run's episodes of
    rollout.max_turns turns, each up to tools.episode_token_budget tokens (0: the model's
    context), as the rl job samples them."""
    config, tools = settings.config, settings.tools
    return programs.StepShape(
        contexts=settings.method.contexts_per_step, context_length=config.compile.context_length,
        n=config.rollout.n, rollout=settings.rollout,
        routing_replay=routing_replay(config, any(model_config.sparse_layers)),
        max_turns=tools.max_turns,
        episode_token_budget=(tools.episode_token_budget
                              or model_config.max_position_embeddings),
        kv_kept=tools.rollout == 'kv_kept')


def slice_meshes(settings: RunSettings, model_config: ModelConfig, slice_: topology.SliceType,
                 devices: int) -> tuple:
    """(the learner's mesh, the sampler's) with the sampler on the slice's last `devices` chips
    (rollout.devices): config.mesh over the first chips, the decode's layout (decode_layout)
    over the last. A split the meshes or the learner's rows do not divide is refused in one
    line (ConfigError)."""
    config = settings.config
    what = f'config.rollout.devices={devices}'
    if config.compile.slices > 1:  # the split would cut across the slices' DCN
        raise ConfigError(f'{what}: a split is costed on one slice only (compile.slices='
                          f'{config.compile.slices})')
    chips = topology.devices(slice_)
    learner_chips = len(chips) - devices
    if not 0 < devices < len(chips):
        raise ConfigError(f'{what}: expected 0 (all {len(chips)} chips of {slice_.name}, '
                          f'time-shared) or fewer, leaving the learner some')
    try:  # the run's own rule (models.split_meshes): the sampler takes the last chips
        learner, sampler = split_meshes(devices, devices=chips, **config.mesh)
        check_rows(settings.train, settings.method.contexts_per_step, settings.loop.n, learner,
                   problems_per_step=config.train.problems_per_step)
        sampler = decode_layout(sampler, model_config, settings.rollout.tensor_parallel)
    except ValueError as e:
        raise ConfigError(f'{what}: on {slice_.name} the learner gets {learner_chips} chips, '
                          f'the sampler {devices}, and {e}') from None
    return learner, sampler


def split_for(settings: RunSettings, model_config: ModelConfig, slice_: topology.SliceType,
              workdir: str, devices: int) -> dict:
    """The pipeline block's figures for the sampler on the slice's last `devices` chips and the
    learner on the rest (slice_meshes), each side's programs compiled on its own mesh and its
    HLO under <workdir>/hlo/<slice>/split_<devices>/. A side whose chips cannot hold it is
    reported as not fitting; the learner's compile is skipped when its state alone is over."""
    config, train, chip = settings.config, settings.train, slice_.chip
    c = config.compile
    learner_mesh, sampler_mesh = slice_meshes(settings, model_config, slice_, devices)
    step = step_shape(settings, model_config)
    adapters = settings.loop.adapters
    logging.info('compile: split %d: learner mesh %s, sampler mesh %s', devices,
                 dict(learner_mesh.shape), dict(sampler_mesh.shape))
    # The learner: its training state and update, nothing of the sampler's beside them.
    learner = Learner(programs.abstract_model(model_config, learner_mesh, adapters), train,
                      learner_mesh)
    held = 0.0
    try:
        state = _abstract_state(learner, slice_)
        held = programs.bytes_per_chip(state) + programs.bytes_per_chip(learner.rest)
        if held > (1 - c.headroom) * chip.hbm_bytes:
            raise ValueError(_state_too_big(held, slice_, c.headroom))
        learned = _timed(f'learner update on {learner_mesh.size} chips',
                         lambda: programs.learner_programs(learner, state, train, step))
    except ValueError as e:
        learned = [programs.Program('learner update', None, error=str(e), required_bytes=held)]
    # The sampler: its compute-dtype weights on the decode layout, the rest of HBM its KV.
    model, sent = programs.sampler_weights(model_config, sampler_mesh, adapters)
    sampled, kv_budget = _sampler(model, sampler_mesh, step, chip, 0.0, '')
    directory = storage.join(workdir, 'hlo', slice_.name, f'split_{devices}')
    _write_hlo(learned + sampled, directory)

    def side(compiled, mesh):
        rows = [compile_report.program_report(p, chip, mesh.size, c.headroom) for p in compiled]
        fits = all(r['fits'] for r in rows)
        return {'chips': mesh.size, 'mesh': dict(mesh.shape), 'fits': fits,
                'seconds': sum(r['calls_per_step'] * r['roofline']['seconds'] for r in rows)
                if fits else None, 'programs': {r['name']: r for r in rows}}, rows
    learner_side, _ = side(learned, learner_mesh)
    sampler_side, rows = side(sampled, sampler_mesh)
    sampler_side.update(kv_budget_bytes=kv_budget, **compile_report.sampler_figures(
        rows, next((p for p in sampled if p.rows_in_flight), None), step, model_config, chip,
        devices))
    transfer_s = costing.weight_transfer_seconds(sent, devices, learner_mesh.size, chip)
    fits = learner_side['fits'] and sampler_side['fits']
    split = {'devices': devices, 'max_staleness': config.train.max_staleness, 'fits': fits,
             'sampler': sampler_side, 'learner': learner_side}
    return split | {
            'transfer': {'bytes_per_sampler_chip': sent, 'seconds': transfer_s,
                         'what': 'the weights each update replaces on the sampler: '
                                 + ('every trained weight in the compute dtype'
                                    if adapters is None else
                                    'the merged targeted weights' if adapters.merged_sampling
                                    else 'the adapters')},
            'pipelined_s': costing.pipelined_seconds(sampler_side['seconds'],
                                                     learner_side['seconds'], transfer_s)
            if fits else None, 'why': '' if fits else compile_report.split_shortfall(split)}


def pipeline(settings: RunSettings, model_config: ModelConfig, slice_: topology.SliceType,
             workdir: str, sequential: dict) -> dict:
    """compile.json's `pipeline` block: the sequential step (the time-shared compile's,
    `sequential`), and with rollout.devices = d > 0 the split at d (split_for); with
    compile.search_split each power of two below the slice's chips (and d) is tried, `search`
    lists them, and the fastest split that fits is the one reported (`best_devices`)."""
    config = settings.config
    block = {'sequential_s': sequential['step']['roofline_seconds']}
    devices, search = config.rollout.devices, config.compile.search_split
    if not devices and not search:
        return block
    chips = sequential['chips']
    tried = {devices} - {0}
    if search:
        tried |= {2**k for k in range(chips.bit_length()) if 2**k < chips}
    splits = {}
    for d in sorted(tried):
        try:
            splits[d] = split_for(settings, model_config, slice_, workdir, d)
        except ValueError as e:  # the split does not divide: nothing compiled
            if not search:
                raise
            splits[d] = {'devices': d, 'fits': False, 'why': str(e), 'pipelined_s': None}
    fitting = [s for s in splits.values() if s['fits']]
    best = min(fitting, key=lambda s: s['pipelined_s'])['devices'] if fitting else None
    chosen = devices or best
    if chosen:
        block |= splits[chosen]
    if search:
        block |= {'best_devices': best, 'search': list(splits.values())}
    return block


def _abstract_state(learner: Learner, slice_: topology.SliceType):
    """The learner's abstract TrainState (compiling the optimizer's init to learn its
    shardings); ValueError when the compiler finds it does not fit the chips."""
    try:
        return learner.abstract_state()
    except jax.errors.JaxRuntimeError as e:
        if 'RESOURCE_EXHAUSTED' not in str(e):
            raise
        raise ValueError(f'the training state alone does not fit {slice_.name}: '
                         f'{str(e).splitlines()[0][:200]}') from None


def _state_too_big(held: float, slice_: topology.SliceType, headroom: float) -> str:
    return (f'the training state alone needs {held / GiB:.1f} GiB per chip, over '
            f'{1 - headroom:.0%} of {slice_.chip.hbm_bytes / GiB:.0f} GiB')


def _sampler(model, mesh, step: programs.StepShape, chip: topology.Chip, resident: float,
             note: str) -> tuple[list, int]:
    """The sampler's compiled programs for `model` on `mesh`, `resident` bytes per chip held
    beside them, and its KV budget: what the chips hold beyond its weights (and their
    tensor-parallel copy when the decode reshards them) and `resident`."""
    weights = programs.bytes_per_chip(nnx.state(model)) + programs.decode_copy_bytes(model, step)
    kv_budget = step.rollout.kv_budget_bytes(chip.hbm_bytes, mesh.size, resident + weights)
    try:
        return _timed('sampler', lambda: programs.sampler_programs(
            model, mesh, step, kv_budget_bytes=kv_budget, resident_bytes=resident,
            resident_note=note)), kv_budget
    except ValueError as e:  # the KV budget holds no row beside the weights: nothing to compile
        return [programs.Program('sampler', None, error=str(e), required_bytes=weights,
                                 resident_bytes=resident, resident_note=note)], kv_budget


def _report(config, model_config, slice_, workdir, mesh, step, compiled, learner, state,
            kv_budget, start) -> dict:
    """compile.json's content from the compiled programs (and their HLO under workdir)."""
    c, spec, chip = config.compile, step.rollout, slice_.chip
    rows = [compile_report.program_report(p, chip, mesh.size, c.headroom) for p in compiled]
    _write_hlo(compiled, storage.join(workdir, 'hlo', slice_.name))
    return {
        'topology': slice_.name, 'slices': c.slices, 'chips': mesh.size,
        'hosts': slice_.hosts * c.slices, 'mesh': dict(mesh.shape),
        'fits': all(p['fits'] for p in rows),
        'chip': {'generation': chip.generation, 'hbm_bytes': chip.hbm_bytes,
                 'peak_bf16_flops': chip.peak_bf16_flops,
                 'hbm_bytes_per_s': chip.hbm_bytes_per_s, 'ici_bytes_per_s': chip.ici_bytes_per_s},
        'headroom': c.headroom,
        'model': {'model_type': model_config.model_type, 'params': model_config.num_params(),
                  'param_dtype': model_config.param_dtype, 'dtype': model_config.dtype,
                  'lora_rank': config.train.get('lora_rank', 0)},
        'step': {'contexts': step.contexts, 'n': step.n, 'rows': step.rows,
                 'context_length': step.context_length, 'max_new_tokens': step.max_new_tokens,
                 'max_turns': step.max_turns,
                 'episode_token_budget': step.episode_token_budget if step.episodes else None,
                 'max_rows_in_flight': spec.max_rows_in_flight, 'kv_budget_bytes': kv_budget,
                 'kv_dtype': spec.kv_dtype or model_config.dtype, 'page_size': spec.page_size,
                 'learner_width': step.learner_width, 'routing_replay': step.routing_replay,
                 'roofline_seconds': sum(p['calls_per_step'] * p['roofline']['seconds']
                                         for p in rows if p['roofline']),
                 **compile_report.sampler_figures(
                     rows, next((p for p in compiled if p.rows_in_flight), None), step,
                     model_config, chip, mesh.size)},
        'state_bytes_per_chip': {'params': programs.bytes_per_chip(state.params),
                                 'optimizer': programs.bytes_per_chip(state.opt_state),
                                 'frozen': programs.bytes_per_chip(learner.rest)},
        'programs': {p['name']: p for p in rows},
        'compile_seconds': time.perf_counter() - start,
    }


def _write_hlo(compiled: list, directory: str) -> None:
    for p in compiled:
        if p.compiled is not None:
            storage.write_atomic(storage.join(directory, p.name.replace(' ', '_') + '.txt'),
                                 p.compiled.as_text())


def run_model_config(config) -> ModelConfig:
    """The run's ModelConfig from config.json facts alone (no weights are read)."""
    dtype, param_dtype = model_dtypes(config)
    if config.model.source == 'sft':
        from jaxprefix.data.tasks import carry_multiplication as task
        from jaxprefix.run_setup import sft_base

        return sft_base.model_config(config.sft, task.tokenizer()).replace(
            param_dtype=param_dtype, dtype=dtype)
    return ModelConfig.from_hf(hf_config(config), param_dtype=param_dtype, dtype=dtype)


def hf_config(config) -> dict:
    """config.compile.model_config, else the model path's config (config.json, GGUF header),
    else the shipped config.json of a model of that name."""
    m, given = config.model, config.compile.model_config
    if given:
        return storage.read_json(given)
    path = m.path
    if storage.is_placeholder(path):  # gs://YOUR_BUCKET/<name>: the shipped config of <name>
        return _shipped(path)
    try:
        if m.source == 'gguf':
            from jaxprefix.checkpoints import gguf

            path = gguf.bundled_smollm2_path() if path == 'bundled' else path
            if storage.isfile(path):
                return gguf.read_gguf_config(storage.local_copy(path))
        elif path and storage.isfile(storage.join(path, 'config.json')):
            return storage.read_json(storage.join(path, 'config.json'))
    except Exception as e:  # noqa: BLE001 - an unreachable bucket: fall back to the shipped copy
        logging.info('compile: %s not readable here (%s); looking for a shipped config', path, e)
    return _shipped(path)


def _shipped(path: str) -> dict:
    shipped = published.hf_config(path)
    if shipped is None:
        raise ValueError(f'config.model.path={path!r}: no config.json readable there and no '
                         f'shipped config of that name ({", ".join(published.names())}); give '
                         f'one with --config.compile.model_config=PATH/config.json')
    return shipped


def _timed(what: str, build):
    start = time.perf_counter()
    logging.info('compile: compiling the %s ...', what)
    result = build()
    logging.info('compile: %s compiled in %.0f s', what, time.perf_counter() - start)
    return result
