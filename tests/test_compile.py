"""The compile job: programs of an RL step compiled for TPU slices on this CPU (libtpu), their
memory and cost read back, and the pieces it stands on (topologies, meshes, the HLO walk)."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxprefix.models import published
from jaxprefix.models.config import ModelConfig
from jaxprefix.models.sharding import make_mesh
from jaxprefix.tpu import compiled_stats, topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model whose matmuls dominate its FLOPs at 128 tokens (attention ~5%, the re-projected
# vocabulary of the log-prob chunks ~4%), so the update should cost about 6 N D.
SMALL = dict(model_type='llama', architectures=['LlamaForCausalLM'], vocab_size=2048,
             hidden_size=512, intermediate_size=2048, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             tie_word_embeddings=True, rope_theta=10000.0, max_position_embeddings=4096)


def test_slice_types_and_their_devices():
    v6e = topology.slice_type('v6e-8')
    assert (v6e.chips, v6e.hosts, v6e.topology) == (8, 1, 'v6e:2x4')
    assert topology.slice_type('v5litepod-16').chip is topology.CHIPS['v5e']
    assert topology.slice_type('v5p-8').chips == 4  # v5p names count TensorCores
    for bad in ('v6e-3', 'v5p-6', 'tpu-8', 'v6e'):
        with pytest.raises(ValueError, match='TPU type'):
            topology.slice_type(bad)
    devices = topology.devices(topology.slice_type('v5e-4'), slices=2)
    assert len(devices) == 8 and devices[0].platform == 'tpu'
    assert sorted({d.slice_index for d in devices}) == [0, 1]


def test_mesh_spans_slices_with_data_over_dcn():
    """On two slices the mesh sizes are one slice's and 'data' also runs across slices: every
    data row of the device grid lies in one slice."""
    devices = topology.devices(topology.slice_type('v5e-4'), slices=2)
    mesh = make_mesh(data=1, fsdp=-1, devices=devices)
    assert dict(mesh.shape) == {'data': 2, 'fsdp': 4, 'tensor': 1}
    for row in mesh.devices:
        assert len({d.slice_index for d in row.ravel()}) == 1
    with pytest.raises(ValueError, match='4 devices in each of 2 slices'):
        make_mesh(fsdp=3, devices=devices)


def test_hlo_walk_counts_loop_bodies_by_their_trip_count():
    """XLA's cost_analysis counts a scan's body once; the walk multiplies it by the trip count
    and agrees with XLA on the same program unrolled (FLOPs within 2%). Its bytes are HBM's:
    here each layer's weights, read once (the activations live in VMEM), within XLA's bytes of
    every memory."""
    devices = topology.devices(topology.slice_type('v5e-4'))
    mesh = Mesh(np.array(devices), ('x',))
    layers, d, b = 6, 1024, 512

    def program(unroll):
        def f(w, x):
            x, _ = jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w, unroll=unroll)
            return (x.astype(jnp.float32) ** 2).sum()
        return jax.jit(f)
    w = jax.ShapeDtypeStruct((layers, d, d), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, 'x')))
    x = jax.ShapeDtypeStruct((b, d), jnp.bfloat16, sharding=NamedSharding(mesh, P('x')))
    looped = program(1).lower(w, x).compile()
    unrolled = program(True).lower(w, x).compile()
    ours = compiled_stats.HloCost(looped.as_text(), num_devices=4).total()
    xla = unrolled.cost_analysis()
    expected = 2 * b * d * d * layers / 4
    assert looped.cost_analysis()['flops'] < expected / 3  # the undercount the walk fixes
    assert ours.flops == pytest.approx(expected, rel=0.02)
    assert ours.flops == pytest.approx(xla['flops'], rel=0.02)
    weights = layers * d * d * 2 / 4
    assert ours.bytes == pytest.approx(weights, rel=0.25)
    assert ours.bytes <= xla['bytes accessed']
    assert ours.collectives['all-gather']['count'] == layers  # one weight gather per layer


def test_hlo_walk_counts_a_rare_branch_of_a_data_dependent_loop_by_its_calls():
    """A loop of unknown trip count whose body multiplies only when a condition holds (the
    continuous sampler's admissions): costed as `rare_branch_calls` multiplications, not one per
    iteration; without the count, one per iteration (the upper bound)."""
    devices = topology.devices(topology.slice_type('v5e-4'))
    mesh = Mesh(np.array(devices), ('x',))
    d, b = 512, 256

    def f(w, x, steps):
        def body(carry):
            i, x = carry
            x = jax.lax.cond(i % 7 == 0, lambda x: jnp.tanh(x @ w), lambda x: x + 1, x)
            return i + 1, x
        return jax.lax.while_loop(lambda c: c[0] < steps, body, (0, x))[1]
    w = jax.ShapeDtypeStruct((d, d), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((b, d), jnp.float32, sharding=NamedSharding(mesh, P('x')))
    steps = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(w, x, steps).compile().as_text()
    matmul = 2 * b * d * d / 4
    rare = compiled_stats.HloCost(text, num_devices=4, unknown_trip_count=70,
                                  rare_branch_calls=10).total()
    every = compiled_stats.HloCost(text, num_devices=4, unknown_trip_count=70).total()
    assert rare.flops == pytest.approx(10 * matmul, rel=0.02)
    assert every.flops == pytest.approx(70 * matmul, rel=0.02)


def test_hlo_walk_counts_a_rare_inner_loop_by_its_iterations_in_all():
    """A data-dependent loop inside the body of another (a multi-turn decode's appending passes
    inside its steps): costed as `rare_loop_trips` iterations in all, not its outer loop's trip
    count at every outer iteration."""
    devices = topology.devices(topology.slice_type('v5e-4'))
    mesh = Mesh(np.array(devices), ('x',))
    d, b = 512, 256

    def f(w, x, steps, due):
        def step(carry):
            i, x = carry
            inner = jax.lax.while_loop(lambda c: (c[0] < 3) & (i % due == 0),
                                       lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
            return i + 1, inner + 1
        return jax.lax.while_loop(lambda c: c[0] < steps, step, (0, x))[1]
    w = jax.ShapeDtypeStruct((d, d), jnp.float32, sharding=NamedSharding(mesh, P()))
    x = jax.ShapeDtypeStruct((b, d), jnp.float32, sharding=NamedSharding(mesh, P('x')))
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(f).lower(w, x, scalar, scalar).compile().as_text()
    matmul = 2 * b * d * d / 4
    cost = compiled_stats.HloCost(text, num_devices=4, unknown_trip_count=70,
                                  rare_branch_calls=0, rare_loop_trips=12).total()
    assert cost.flops == pytest.approx(12 * matmul, rel=0.02)
    assert cost.unknown_loops == 2
    nested = compiled_stats.HloCost(text, num_devices=4, unknown_trip_count=70,
                                    rare_branch_calls=0).total()
    assert nested.flops == pytest.approx(70 * 70 * matmul, rel=0.02)


def _on_one_chip(*arrays):
    """Abstract arrays, (shape, dtype) each, on one v5e chip."""
    device = topology.devices(topology.slice_type('v5e-4'))[:1]
    sharding = NamedSharding(Mesh(np.array(device), ('x',)), P())
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in arrays]


def test_hlo_walk_counts_an_in_place_cache_write_by_what_it_writes():
    """A decode step's scatter of one token per row into a donated KV cache moves those tokens,
    not the cache: the walk counts the update read and written (XLA: 0.3 MB; the whole cache
    read and written would be 128 MB)."""
    rows, length, width = 64, 4096, 128

    def write(cache, token, position):
        return cache.at[jnp.arange(rows), position].set(token)
    compiled = jax.jit(write, donate_argnums=0).lower(*_on_one_chip(
        ((rows, length, width), jnp.bfloat16), ((rows, width), jnp.bfloat16),
        ((rows,), jnp.int32))).compile()
    update = rows * width * 2
    walked = compiled_stats.HloCost(compiled.as_text(), num_devices=1).total().bytes
    assert 2 * update <= walked < 3 * update


def test_hlo_walk_counts_stacked_weights_by_the_layer_each_iteration_slices():
    """A loop over layers of stacked weights reads one layer an iteration, also when the slice
    sits in a fusion nested in the one the loop body calls: the walk counts the layers once
    (without the nested rule: every layer every iteration, 8x the weights)."""
    layers, batch, width = 8, 16, 512

    def forward(weights, x):
        return jax.lax.fori_loop(0, layers, lambda i, x: jnp.tanh(x @ weights[i]), x)
    compiled = jax.jit(forward).lower(*_on_one_chip(
        ((layers, width, width), jnp.bfloat16), ((batch, width), jnp.bfloat16))).compile()
    weights = layers * width * width * 2
    walked = compiled_stats.HloCost(compiled.as_text(), num_devices=1).total().bytes
    assert weights <= walked < 1.5 * weights


def test_published_configs_are_the_models_config_json():
    from jaxprefix.checkpoints.gguf import bundled_smollm2_path, read_gguf_config

    smol = published.hf_config('HuggingFaceTB/SmolLM2-135M-Instruct')
    assert ModelConfig.from_hf(smol) == ModelConfig.from_hf(read_gguf_config(bundled_smollm2_path()))
    qwen = ModelConfig.from_hf(published.hf_config('gs://bucket/Qwen3-4B-Instruct-2507/'))
    assert round(qwen.num_params() / 1e9, 2) == 4.02
    assert published.hf_config('Qwen3-1.7B')['num_hidden_layers'] == 28
    assert published.hf_config('no-such-model') is None


def run_job(tmp_path, *flags):
    """The compile job as a user runs it: (exit status, output, compile.json or None)."""
    model_dir = tmp_path / 'model'
    model_dir.mkdir(exist_ok=True)
    (model_dir / 'config.json').write_text(json.dumps(SMALL))
    work = tmp_path / 'work'
    # carry_multiplication's smoke run: its 61-token completions set the decode loop's length.
    cmd = [sys.executable, '-m', 'jaxprefix.main', '--config=configs/grpo.py:carry_smoke',
           '--config.job=compile', '--config.model.source=hf', f'--config.model.path={model_dir}',
           '--config.compile.context_length=64', f'--workdir={work}', *flags]
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    report = work / 'compile.json'
    return done.returncode, done.stdout + done.stderr, (json.loads(report.read_text())
                                                        if report.exists() else None)


def test_small_run_compiles_for_four_chips_with_sane_figures(tmp_path):
    """16 rows x 128 tokens in 2 minibatches of 2 micro-batches over a v5e-4 (FSDP): every
    program fits; the update costs ~6 N D FLOPs in all (loops counted), the parameters are
    sharded four ways, and XLA's own argument bytes agree with params + Adam moments + batch."""
    status, output, report = run_job(
        tmp_path, '--config.compile.topology=v5e-4', '--config.mesh.data=1',
        '--config.mesh.fsdp=-1', '--config.train.num_minibatches=2',
        '--config.train.micro_batch_size=4')
    assert status == 0, output[-3000:]
    assert '| learner update |' in output and '| sampler decode |' in output
    # The sampler decodes tensor-parallel: heads over the 4 chips the learner shards by FSDP.
    assert '| sampler reshard |' in output
    config = ModelConfig.from_hf(SMALL)
    update = report['programs']['learner update']
    rows, width = report['step']['rows'], report['step']['learner_width']
    assert (rows, width, report['chips']) == (16, 128, 4)
    matmul_params = config.num_params(embeddings=False) + config.vocab_size * config.hidden_size
    six_nd = 6 * matmul_params * rows * width / report['chips']
    assert update['flops'] == pytest.approx(six_nd, rel=0.2)
    params = report['state_bytes_per_chip']['params']
    assert params == pytest.approx(config.num_params() * 4 / 4, rel=0.01)
    batch = rows * width * (4 + 4 + 1 + 4 + 4) / 4
    assert update['argument_bytes'] == pytest.approx(3 * params + batch, rel=0.05)
    for program in report['programs'].values():
        assert program['fits'] and 0 < program['hbm_bytes_per_chip'] < program['usable_bytes']
        assert program['hbm_capacity_bytes'] == 16 * 2**30
        assert program['roofline']['seconds'] > 0
    decode = report['programs']['sampler decode']
    assert decode['assumed_trip_count'] == 61  # the decode loop runs up to max_new_tokens
    # The training state stays while the sampler runs: master weights and Adam's two moments.
    # The weights are cast and laid out for the decode in one program (no learner-layout copy).
    reshard = report['programs']['sampler reshard']
    assert reshard['resident_bytes'] == pytest.approx(3 * params, rel=0.01)
    assert decode['resident_bytes'] == pytest.approx(3 * params, rel=0.01)


def test_a_run_too_big_for_the_chip_exits_non_zero_naming_the_program(tmp_path):
    status, output, report = run_job(
        tmp_path, '--config.compile.topology=v5e-1', '--config.rollout.n=64',
        '--config.rollout.max_new_tokens=8192')
    assert status != 0
    last = output.strip().splitlines()[-1]
    assert last.startswith('compile: ') and 'does not fit v5e-1' in last and 'GiB over' in last
    assert report is not None and not all(p['fits'] for p in report['programs'].values())


def smoke_compile_config(tmp_path, model: dict, topology: str):
    """grpo.py:smoke as a compile job of `model` (a config.json dict) for `topology`, in process."""
    from jaxprefix.run_config import from_file

    (tmp_path / 'config.json').write_text(json.dumps(model))
    config = from_file(os.path.join(ROOT, 'configs', 'grpo.py'), 'smoke')
    config.job = 'compile'
    config.model.update(source='hf', path=str(tmp_path / 'not_here'))
    config.compile.update(topology=topology, context_length=64,
                          model_config=str(tmp_path / 'config.json'))
    return config


def test_a_row_cap_compiles_the_continuous_decode_generate_would_run(tmp_path):
    """rollout.max_rows_in_flight below the step's 16 rows: the sampler program compiled is the
    continuous decode (sampling.abstract_programs, as generate() would run it), with the cap's row
    slots per row device, and its loop counted as the generations of rows through them."""
    from jaxprefix.jobs.compile import run_compile

    config = smoke_compile_config(tmp_path, SMALL, 'v5e-4')
    config.rollout.max_rows_in_flight = 8  # 2 active rows on each of 4 row devices
    config.rollout.tensor_parallel = 1  # decode in the learner's (data-parallel) layout
    report = run_compile(config, str(tmp_path / 'work'))
    assert report['mesh']['data'] == 4 and report['step']['rows'] == 16
    assert set(report['programs']) == {'learner update', 'sampler continuous'}
    continuous = report['programs']['sampler continuous']
    assert '4 block(s) of 2 active rows' in continuous['shapes'], continuous['shapes']
    # 4 rows a block through 2 slots: 2 generations of up to max_new_tokens steps each.
    assert continuous['assumed_trip_count'] == 2 * config.rollout.max_new_tokens
    assert continuous['fits'] and continuous['roofline']['seconds'] > 0


def test_a_tool_run_compiles_the_chunk_program_its_episodes_run(tmp_path):
    """rollout.max_turns=3 with the calculator: the sampler program compiled is the chunk of
    the KV-kept multi-turn decode (turns.abstract_turn_programs, as sample_turns runs it, its
    observations' appending passes included), costed as every row's 3 turns; the learner is
    compiled at the episode budget's width. With tools.rollout='reference', generate's programs
    at the longest context it re-prefills instead."""
    from jaxprefix.jobs.compile import run_compile

    config = smoke_compile_config(tmp_path, SMALL, 'v5e-4')
    config.rollout.max_turns = 3
    config.tools.names = ['calculator']
    config.tools.episode_token_budget = 128
    report = run_compile(config, str(tmp_path / 'work'))
    assert set(report['programs']) == {'learner update', 'sampler reshard', 'sampler turns'}
    turns = report['programs']['sampler turns']
    assert turns['shapes'].startswith('turns: 3 of up to'), turns['shapes']
    assert turns['fits'] and turns['roofline']['seconds'] > 0
    assert turns['loops_with_assumed_trip_count'] == 2  # the steps, and the appending passes
    new_tokens = config.rollout.max_new_tokens
    assert turns['assumed_trip_count'] == 3 * new_tokens  # every row in flight at once
    step = report['step']
    assert (step['max_turns'], step['episode_token_budget'], step['learner_width']) == (3, 128,
                                                                                        128)
    hlo = os.listdir(tmp_path / 'work' / 'hlo' / 'v5e-4')
    assert any('turns' in name for name in hlo), hlo

    config.tools.rollout = 'reference'
    report = run_compile(config, str(tmp_path / 'reference'))
    assert 'sampler turns' not in report['programs'] and 'sampler decode' in report['programs']
    # The last turn re-prefills 128 - 27 tokens, in a context bucket of 128.
    assert 'x 128 tokens' in report['programs']['sampler prefill']['shapes']


def test_a_split_reports_each_side_and_the_pipelined_step(tmp_path):
    """rollout.devices=2 on v6e-4: the learner's update compiled with config.mesh (FSDP) over
    the first 2 chips, the sampler's programs tensor-parallel over the last 2 with no training
    state beside them; the pipelined step is the slower side plus the weights' copy (the
    sampler's f32 weights, half of them a chip, over ICI). The sequential figure is the
    time-shared compile's (the tests above), given here."""
    from jaxprefix.jobs.compile import pipeline, run_model_config
    from jaxprefix.run_setup.run_settings import resolve

    config = smoke_compile_config(tmp_path, SMALL, 'v6e-4')
    config.mesh.update(data=1, fsdp=-1, tensor=1)
    config.rollout.devices = 2
    settings = resolve(config)
    model_config = run_model_config(config)
    block = pipeline(settings, model_config, topology.slice_type('v6e-4'),
                     str(tmp_path / 'work'), {'step': {'roofline_seconds': 1.0}, 'chips': 4})
    sampler, learner, transfer = block['sampler'], block['learner'], block['transfer']
    assert block['sequential_s'] == 1.0 and block['devices'] == 2 and block['fits']
    assert learner['mesh'] == {'data': 1, 'fsdp': 2, 'tensor': 1}
    assert sampler['mesh'] == {'data': 1, 'fsdp': 1, 'tensor': 2}
    assert set(learner['programs']) == {'learner update'}
    assert set(sampler['programs']) == {'sampler prefill', 'sampler decode'}  # no reshard
    assert all(p['resident_bytes'] == 0 for p in sampler['programs'].values())
    assert min(sampler['seconds'], learner['seconds']) > 0
    weights = ModelConfig.from_hf(SMALL).num_params() * 4 / 2  # f32 compute (smoke), 2 ways
    assert transfer['bytes_per_sampler_chip'] == pytest.approx(weights, rel=0.02)
    assert transfer['seconds'] == pytest.approx(
        transfer['bytes_per_sampler_chip'] / topology.CHIPS['v6e'].ici_bytes_per_s)
    assert block['pipelined_s'] == pytest.approx(
        max(sampler['seconds'], learner['seconds']) + transfer['seconds'])
    assert (tmp_path / 'work' / 'hlo' / 'v6e-4' / 'split_2' / 'learner_update.txt').exists()


def test_a_split_that_does_not_divide_is_refused_in_one_line(tmp_path):
    """rollout.devices=1 on v6e-4 leaves the learner 3 chips, which the step's micro-batches of
    16 rows do not split over: refused in one line before anything is compiled."""
    from jaxprefix.errors import ConfigError, one_line
    from jaxprefix.jobs.compile import run_compile

    config = smoke_compile_config(tmp_path, SMALL, 'v6e-4')
    config.mesh.update(data=1, fsdp=-1, tensor=1)
    config.rollout.devices = 1
    with pytest.raises(ConfigError) as refused:
        run_compile(config, str(tmp_path / 'work'))
    line = one_line(refused.value)
    assert '\n' not in line and line.startswith('error: config.rollout.devices=1: on v6e-4 the '
                                                  'learner gets 3 chips, the sampler 1'), line
    assert 'not divisible' in line and not (tmp_path / 'work').exists()


def test_the_weights_a_split_sampler_is_sent(tmp_path):
    """What each update replaces on a sampler of its own chips, per chip of its decode mesh:
    every weight in the compute dtype; with LoRA the merged targeted weights, or the adapters
    when the sampler applies them (merged_sampling=False)."""
    from flax import nnx

    from jaxprefix.models import lora
    from jaxprefix.tpu import programs

    config = ModelConfig.from_hf(SMALL, param_dtype='float32', dtype='bfloat16')
    mesh = make_mesh(data=1, tensor=2, devices=topology.devices(topology.slice_type('v6e-4'))[2:])
    model, sent = programs.sampler_weights(config, mesh)
    assert sent == pytest.approx(config.num_params() * 2 / 2, rel=0.02)
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(nnx.state(model)))
    _, sent = programs.sampler_weights(config, mesh, lora.LoraConfig(4, targets=('q', 'o')))
    layers, d, heads = config.num_layers, config.hidden_size, config.num_heads * config.head_dim
    assert sent == 2 * layers * d * heads * 2 / 2  # q and o, bf16, heads split 2 ways
    _, sent = programs.sampler_weights(
        config, mesh, lora.LoraConfig(4, targets=('q', 'o'), merged_sampling=False))
    adapters = layers * 4 * 2 * (d + heads) * 4  # A and B of q and o, rank 4, f32
    assert adapters / 2 <= sent <= adapters  # some split over the heads


SMALL_MOE = dict(model_type='qwen3_moe', architectures=['Qwen3MoeForCausalLM'], vocab_size=2048,
                 hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                 tie_word_embeddings=False, rope_theta=10000.0, max_position_embeddings=4096)


def test_a_mixture_of_experts_compiles_with_megablox_and_expert_parallel_decode(tmp_path):
    """A small MoE (8 experts, top-2) on v6e-4 (v6e:2x2), FSDP learner: the learner's update and
    the sampler's decode run the experts through Megablox's kernel (costed by its name), the
    update takes the batch's routes (int8: routing replay), the decode and the learner split the
    experts over their 4 chips, and the floor counts the weights a decode step reads."""
    from jaxprefix.jobs.compile import run_compile
    from jaxprefix.tpu.costing import kernel_bytes, kernel_flops

    config = smoke_compile_config(tmp_path, SMALL_MOE, 'v6e-4')
    config.mesh.update(data=1, fsdp=-1, tensor=1)
    report = run_compile(config, str(tmp_path / 'work'))
    assert report['fits'] and report['mesh'] == {'data': 1, 'fsdp': 4, 'tensor': 1}
    hlo = tmp_path / 'work' / 'hlo' / 'v6e-4'
    update, decode = ((hlo / f'{name}.txt').read_text()
                      for name in ('learner_update', 'sampler_decode'))
    for text in (update, decode):
        kernels = compiled_stats.HloCost(text, num_devices=4)
        names = [compiled_stats._op_name(i.attrs) for body in kernels.computations.values()
                 for i in body if 'tpu_custom_call' in i.attrs]
        megablox = [n for n in names if kernel_bytes(n, [], 0.0, {}) is not None
                    and 'paged' not in n]
        assert megablox and all(kernel_flops(n) > 0 for n in megablox)
    assert 'tgmm' in update  # the experts' weight gradient: Megablox's backward
    step = report['step']
    rows = step['rows'] // 4
    assert f"s8[{rows},{step['learner_width']},2,2]" in update  # routes: rows, width, layers, k
    # The decode lays the 8 experts over its 4 chips (heads over 'tensor'): 2 a chip.
    assert re.search(r'\[2,2,512,256\]', decode)  # [sparse layers, experts, D, F]
    # So does the learner's FSDP (experts over 'fsdp'): it moves tokens, and gathers no experts.
    assert re.search(r'\[2,2,512,256\]', update)
    assert not [line for line in update.splitlines()
                if re.search(r' all-gather(-start)?\(', line)
                and re.search(r'512,256\]|256,512\]', line)]
    config_ = ModelConfig.from_hf(SMALL_MOE)
    assert step['rows_in_flight'] == step['rows'] and step['decode_steps'] == step['max_new_tokens']
    weights = step['max_new_tokens'] * config_.decode_step_params(step['rows']) * 4  # f32
    assert step['sampler_floor_weights_s'] == pytest.approx(
        weights / (4 * report['chip']['hbm_bytes_per_s']))


@pytest.mark.slow
def test_paper_variant_fits_v6e_8(tmp_path):
    """The paper run (Qwen3-4B, f32 master weights, bf16 compute) on 8 v6e chips: every program
    within 90% of HBM, and the sampler (weights split over the 8 chips' heads, KV in pages read
    only where filled) within 1.25x of its HBM floor with under 100 s of ICI a step. Prints the
    table for docs/SCALING.md."""
    from jaxprefix.jobs.compile import run_compile
    from jaxprefix.run_config import from_file

    config = from_file(os.path.join(ROOT, 'configs', 'pope.py'), 'paper')
    assert (config.model.param_dtype, config.model.dtype) == ('float32', 'bfloat16')
    config.job = 'compile'
    config.compile.topology = 'v6e-8'
    # As printed: model.path is the variant's placeholder, so its shipped config.json is used
    # and the bucket is never asked.
    assert config.model.path == 'gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507'
    report = run_compile(config, str(tmp_path))
    # The run itself, not a smaller one: 64 problems asked guided and plainly, 8 samples each,
    # 16,384 new tokens after 2,048-token contexts, trained at the bucketed width.
    step = report['step']
    assert (step['contexts'], step['n'], step['max_new_tokens']) == (128, 8, 16384)
    assert (step['context_length'], step['learner_width']) == (2048, 20480)
    assert report['headroom'] == 0.1 and report['model']['params'] > 4e9
    names = set(report['programs'])
    assert names == {'learner update', 'sampler reshard', 'sampler continuous'}
    for p in report['programs'].values():
        assert p['fits'] and p['hbm_bytes_per_chip'] <= 0.9 * p['hbm_capacity_bytes'], p['name']
    assert step['kv_dtype'] == 'bfloat16'
    assert step['sampler_vs_floor'] <= 1.25, step
    assert step['sampler_ici_s'] < 100, step
    print(json.dumps({k: step[k] for k in ('sampler_hbm_s', 'sampler_hbm_floor_s',
                                           'sampler_vs_floor', 'sampler_ici_s',
                                           'generated_tokens_per_s_per_chip')}))


def test_a_bad_compile_setting_is_one_line_not_a_traceback(tmp_path):
    """A compile run without a topology stops before any compile, naming the field and what
    it expects, in one line (it was a ValueError's traceback)."""
    status, output, report = run_job(tmp_path, '--config.compile.topology=')
    assert status != 0 and report is None
    assert 'Traceback' not in output
    assert 'config.compile.topology is empty: expected a TPU type such as v6e-8' in output


def test_a_tool_run_whose_contexts_leave_no_room_in_an_episode_is_refused_before_compiling(
        tmp_path):
    """compile.context_length at or over the episode's token budget: no turn could be sampled,
    so the job stops in one line naming both fields, before any compile."""
    from jaxprefix.errors import ConfigError
    from jaxprefix.jobs.compile import run_compile

    config = smoke_compile_config(tmp_path, SMALL, 'v5e-4')
    config.rollout.max_turns = 3
    config.tools.names = ['calculator']
    config.tools.episode_token_budget = 64  # the context_length smoke_compile_config sets
    with pytest.raises(ConfigError, match=r'config\.compile\.context_length=64: expected below '
                                          r'the tokens an episode may hold \(64: '
                                          r'tools\.episode_token_budget'):
        run_compile(config, str(tmp_path / 'work'))
    assert not (tmp_path / 'work').exists()
