"""vLLM as a benchmark arm: a worker process that bench_sampler.py drives over a pipe.

It runs under vLLM's own virtual environment (bench/README.md has the install line), never the
project's: `VENV/bin/python bench/vllm_worker.py HF_DIR MAX_MODEL_LEN` loads our HF export as it
is (f32, prefix caching on) and then answers one JSON object per line on stdin with one per line
on stdout. vLLM's own logging goes to stderr (stdout is the protocol).

  first line out:  {"ready": true, "vllm": version, "dtype": ..., "threads": torch threads,
                    "threads_bind": ..., "reserved_cpus": ...}
  request:         {"prompt_ids": [...], "n": 8, "max_tokens": 128, "temperature": 1.0,
                    "seed": 1, "copies": false, "return_ids": false}
  reply:           {"tokens": generated tokens in all, "ids": [[...], ...] when return_ids}
  {"quit": true} or end of input: exits.

Every request resets the prefix cache first (no call reuses another's prefill) and forces
exactly max_tokens new tokens per sample (ignore_eos, min_tokens). copies=false asks for n
samples of one prompt (SamplingParams(n)); copies=true sends the prompt n times with n=1, so the
copies share its prefill only through prefix caching.
"""
import json
import os
import sys


def main():
  protocol = os.fdopen(os.dup(sys.stdout.fileno()), 'w', buffering=1)
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # vLLM and its children print to stdout
  from vllm import LLM, SamplingParams
  import torch
  import vllm

  model_dir, max_model_len = sys.argv[1], int(sys.argv[2])
  llm = LLM(model=model_dir, dtype='float32', max_model_len=max_model_len,
            enable_prefix_caching=True, seed=0)
  dtype = str(llm.llm_engine.model_config.dtype)
  protocol.write(json.dumps({
      'ready': True, 'vllm': vllm.__version__, 'dtype': dtype, 'threads': torch.get_num_threads(),
      'threads_bind': os.environ.get('VLLM_CPU_OMP_THREADS_BIND', 'auto'),
      'reserved_cpus': os.environ.get('VLLM_CPU_NUM_OF_RESERVED_CPU', 'default')}) + '\n')
  for line in sys.stdin:
    request = json.loads(line)
    if request.get('quit'):
      break
    n, copies = int(request['n']), bool(request.get('copies'))
    params = SamplingParams(n=1 if copies else n, temperature=float(request['temperature']),
                            max_tokens=int(request['max_tokens']),
                            min_tokens=int(request['max_tokens']), ignore_eos=True,
                            seed=request.get('seed'))
    prompts = [{'prompt_token_ids': request['prompt_ids']}] * (n if copies else 1)
    llm.reset_prefix_cache()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    ids = [list(sample.token_ids) for output in outputs for sample in output.outputs]
    reply = {'tokens': sum(len(i) for i in ids)}
    if request.get('return_ids'):
      reply['ids'] = ids
    protocol.write(json.dumps(reply) + '\n')


if __name__ == '__main__':  # vLLM starts its engine with spawn: the guard is required
  main()
