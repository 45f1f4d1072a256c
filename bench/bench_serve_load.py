"""The OpenAI-compatible server under load (issue 70): N concurrent clients on 127.0.0.1, bounded
in requests and seconds, a mix of what real clients send.

The server is the serve job in a subprocess (`configs/serve.py:hf`) over a tiny random llama
with SmolLM2's tokenizer (built in a temporary directory), or the bundled SmolLM2 itself
(`--model smollm2`), with a small body limit (--max-body-bytes) so oversized bodies are cheap to
send; `--base-url` drives a server already running instead (no RSS then). Each client loops,
picking at random (--mix, weights):

  complete    /v1/completions, prompts and max_tokens of mixed lengths, answered whole
  chat        /v1/chat/completions, answered whole
  stream      /v1/completions with stream: true, read to [DONE]
  leave       a stream the client abandons: before the first chunk (a timeout) or after it
  malformed   garbage (bad JSON, deep nesting, a body over the limit, a bad field): a 4xx
              expected

Printed: requests by kind and outcome, answered requests and completion tokens per second,
p50/p99 latency of the answered ones by kind (streams: to [DONE], and to their first chunk),
errors by kind (an expected 4xx of a malformed request is not an error), the server's /stats
counters, and its resident memory after the warm-up and at the end. Run it briefly on a shared
box: `--seconds 30 --clients 16` is enough to show it works.

  python bench/bench_serve_load.py                    # 16 clients, 30 s, the tiny model
  python bench/bench_serve_load.py --quick            # 4 clients, 8 s
  python bench/bench_serve_load.py --base-url http://127.0.0.1:8000 --model-name NAME
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's jaxprefix, as the server subprocess runs it
KINDS = ("complete", "chat", "stream", "leave", "malformed")
WORDS = "the quick brown fox jumps over a lazy dog while seven cats count to ten".split()


def tiny_model_dir(path: str) -> str:
  """A tiny random llama over SmolLM2's tokenizer, saved as an HF directory."""
  from flax import nnx

  from jaxprefix import models, tokenizers
  from jaxprefix.checkpoints.gguf import bundled_smollm2_path
  from jaxprefix.checkpoints.hf import save_pretrained

  tokenizer = tokenizers.load(bundled_smollm2_path())
  config = models.ModelConfig(
      model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
      eos_token_ids=(tokenizer.eos_id,), bos_token_id=tokenizer.bos_id)
  save_pretrained(models.Decoder(config, rngs=nnx.Rngs(0)), config, path, tokenizer=tokenizer)
  return path


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start_server(args, workdir: str) -> tuple[subprocess.Popen, str, str]:
  """(the serve job's process, its base URL, the model name)."""
  port = free_port()
  if args.model == "smollm2":
    variant, flags, name = "smollm2", [], "SmolLM2-135M-Instruct"
  else:
    path = tiny_model_dir(os.path.join(workdir, "tiny-llama"))
    variant, flags, name = "hf", [f"--config.model.path={path}"], "tiny-llama"
  log = open(os.path.join(workdir, "server.log"), "w")
  process = subprocess.Popen(
      [sys.executable, "-m", "jaxprefix.main", f"--config=configs/serve.py:{variant}",
       f"--workdir={workdir}", f"--config.serve.port={port}",
       f"--config.serve.max_body_bytes={args.max_body_bytes}",
       f"--config.serve.max_in_flight={args.max_in_flight}",
       f"--config.serve.max_tokens={max(args.max_tokens)}", *flags],
      cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  base = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while True:
    if process.poll() is not None:
      sys.exit(f"the server exited {process.returncode}; see {log.name}")
    try:
      urllib.request.urlopen(base + "/health", timeout=5).read()
      return process, base, name
    except OSError:
      if time.monotonic() > deadline:
        sys.exit(f"the server did not start in 300 s; see {log.name}")
      time.sleep(0.5)


def rss_mib(pid: int | None) -> float | None:
  if pid is None:
    return None
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      if line.startswith("VmRSS:"):
        return int(line.split()[1]) / 1024
  return None


class Tally:
  """Outcomes by (kind, outcome), latencies of answered requests, tokens."""

  def __init__(self):
    self.outcomes = collections.Counter()
    self.latency = collections.defaultdict(list)  # kind -> seconds
    self.first_chunk = []                         # streams: seconds to their first chunk
    self.tokens = 0

  def answered(self, kind: str, seconds: float, tokens: int):
    self.outcomes[kind, "answered"] += 1
    self.latency[kind].append(seconds)
    self.tokens += tokens


def prompt(rng: random.Random, words: int) -> str:
  return " ".join(rng.choice(WORDS) for _ in range(words))


def malformed_body(rng: random.Random, name: str, limit: int) -> tuple[str, bytes, int]:
  """(what it is, the body, the status expected)."""
  return rng.choice([
      ("bad json", b'{"model": "%s", "prompt": "hi", "max_tok' % name.encode(), 400),
      ("deep nesting", b"[" * 20_000 + b"]" * 20_000, 400),
      ("not utf-8", b'{"model": "%s", "prompt": "\xff\xfe"}' % name.encode(), 400),
      ("over the limit", json.dumps({"model": name, "prompt": "x" * (limit + 1)}).encode(),
       413),
      ("bad field", json.dumps({"model": name, "prompt": "hi", "n": -3}).encode(), 400),
      ("unknown model", json.dumps({"model": "nope", "prompt": "hi"}).encode(), 400),
  ])


async def one_request(http: httpx.AsyncClient, args, name: str, rng: random.Random,
                      tally: Tally, kind: str):
  max_tokens = rng.choice(args.max_tokens)
  body = {"model": name, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8])}
  started = time.monotonic()
  if kind == "malformed":
    what, data, expected = malformed_body(rng, name, args.max_body_bytes)
    response = await http.post("/v1/completions", content=data,
                               headers={"Content-Type": "application/json"})
    if response.status_code == 429:
      tally.outcomes[kind, "429"] += 1
    elif response.status_code == expected and "error" in response.json():
      tally.outcomes[kind, f"expected {expected}"] += 1
    else:
      tally.outcomes[kind, f"UNEXPECTED {response.status_code} ({what})"] += 1
    return
  if kind in ("chat", "complete"):  # answered whole
    if kind == "chat":
      path, body["messages"] = "/v1/chat/completions", [
          {"role": "user", "content": prompt(rng, rng.randint(2, 40))}]
    else:
      path, body["prompt"] = "/v1/completions", prompt(rng, rng.randint(2, 60))
    response = await http.post(path, json=body)
    if response.status_code != 200:
      tally.outcomes[kind, str(response.status_code)] += 1
      return
    tally.answered(kind, time.monotonic() - started, response.json()["usage"]
                   ["completion_tokens"])
    return
  body["prompt"] = prompt(rng, rng.randint(2, 60))
  body |= {"stream": True, "stream_options": {"include_usage": True}}
  leave_early = kind == "leave" and rng.random() < 0.5
  try:
    async with http.stream("POST", "/v1/completions", json=body,
                           timeout=0.05 if leave_early else args.timeout) as response:
      if response.status_code != 200:
        tally.outcomes[kind, str(response.status_code)] += 1
        return
      tokens, first = 0, None
      async for line in response.aiter_lines():
        if not line.startswith("data: "):
          continue
        first = first or time.monotonic() - started
        if kind == "leave":  # gone after the first chunk
          tally.outcomes[kind, "left after a chunk"] += 1
          return
        if line == "data: [DONE]":
          break
        chunk = json.loads(line[6:])
        if "error" in chunk:
          tally.outcomes[kind, "error chunk"] += 1
          return
        if chunk.get("usage"):
          tokens = chunk["usage"]["completion_tokens"]
      tally.first_chunk.append(first)
      tally.answered(kind, time.monotonic() - started, tokens)
  except httpx.TimeoutException:
    if leave_early:
      tally.outcomes[kind, "left before a chunk"] += 1
    else:
      raise


async def client_loop(index: int, base: str, args, name: str, tally: Tally, deadline: float,
                      budget: list[int]):
  rng = random.Random(args.seed * 1000 + index)
  weights = [args.mix[k] for k in KINDS]
  async with httpx.AsyncClient(base_url=base, timeout=args.timeout,
                               headers={"Authorization": f"Bearer {args.api_key}"}) as http:
    while time.monotonic() < deadline and budget[0] > 0:
      budget[0] -= 1
      kind = rng.choices(KINDS, weights)[0]
      try:
        await one_request(http, args, name, rng, tally, kind)
      except httpx.TimeoutException:
        tally.outcomes[kind, "client timeout"] += 1
      except httpx.HTTPError as e:
        tally.outcomes[kind, f"connection error {type(e).__name__}"] += 1


async def drive(base: str, args, name: str, seconds: float, clients: int,
                max_requests: int) -> tuple[Tally, float]:
  tally, started = Tally(), time.monotonic()
  budget = [max_requests]
  await asyncio.gather(*(client_loop(i, base, args, name, tally, started + seconds, budget)
                         for i in range(clients)))
  return tally, time.monotonic() - started


def percentile(values: list[float], q: float) -> float:
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def report(tally: Tally, wall: float, stats: dict, rss: dict):
  answered = sum(len(v) for v in tally.latency.values())
  print(f"\n{answered} requests answered in {wall:.1f} s: {answered / wall:.2f} requests/s, "
        f"{tally.tokens / wall:.1f} completion tokens/s")
  print("\nlatency of answered requests (s):")
  print(f"  {'kind':<10} {'count':>6} {'p50':>8} {'p99':>8} {'max':>8}")
  for kind, values in sorted(tally.latency.items()):
    print(f"  {kind:<10} {len(values):>6} {statistics.median(values):>8.3f} "
          f"{percentile(values, 0.99):>8.3f} {max(values):>8.3f}")
  if tally.first_chunk:
    print(f"  {'stream, first chunk':<19} p50 {statistics.median(tally.first_chunk):.3f} "
          f"p99 {percentile(tally.first_chunk, 0.99):.3f}")
  print("\noutcomes by kind:")
  for (kind, outcome), count in sorted(tally.outcomes.items()):
    print(f"  {kind:<10} {outcome:<36} {count:>6}")
  errors = {k: v for k, v in tally.outcomes.items()
            if k[1] not in ("answered", "left after a chunk", "left before a chunk")
            and not k[1].startswith("expected")}
  print(f"\nerrors by kind: {dict(errors) if errors else 'none'}")
  print(f"server /stats: in_flight {stats.get('in_flight')}, refused {stats.get('refused')}, "
        f"client_left {stats.get('client_left')}, dropped_requests "
        f"{stats.get('dropped_requests')}, sampler calls {len(stats.get('sampler_calls', []))}")
  if rss["before"] is not None:
    print(f"server RSS: {rss['before']:.0f} MiB after the warm-up, {rss['after']:.0f} MiB at the "
          f"end ({rss['after'] - rss['before']:+.0f} MiB)")


def get_stats(base: str, key: str) -> dict:
  request = urllib.request.Request(base + "/stats", headers={"Authorization": f"Bearer {key}"})
  with urllib.request.urlopen(request, timeout=30) as response:
    return json.loads(response.read())


def parse_args():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--clients", type=int, default=16)
  parser.add_argument("--seconds", type=float, default=30.0)
  parser.add_argument("--max-requests", type=int, default=5000, help="over all clients")
  parser.add_argument("--warmup-seconds", type=float, default=20.0,
                      help="the same mix first, unmeasured: most shapes compile there")
  parser.add_argument("--max-tokens", default="4,8,16", help="the requests' max_tokens")
  parser.add_argument("--mix", default="complete=3,chat=2,stream=3,leave=1,malformed=1")
  parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
  parser.add_argument("--max-body-bytes", type=int, default=65536)
  parser.add_argument("--max-in-flight", type=int, default=256)
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds, per request")
  parser.add_argument("--base-url", default="", help="drive this server instead")
  parser.add_argument("--model-name", default="", help="with --base-url")
  parser.add_argument("--api-key", default=os.environ.get("JAXPREFIX_API_KEY", "none"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--rounds", type=int, default=1,
                      help="measured rounds on the same server (RSS after each: a leak grows "
                           "every round, compiles only while new shapes come); the last is "
                           "reported in full")
  parser.add_argument("--quick", action="store_true", help="4 clients, 8 s, 5 s warm-up")
  args = parser.parse_args()
  args.max_tokens = [int(t) for t in args.max_tokens.split(",")]
  args.mix = {k: 0.0 for k in KINDS} | {k: float(v) for k, v in
                                        (p.split("=") for p in args.mix.split(","))}
  if args.quick:
    args.clients, args.seconds, args.warmup_seconds = 4, 8.0, 5.0
  return args


def main():
  args = parse_args()
  one, five, _ = os.getloadavg()
  print(f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs")
  process = None
  with tempfile.TemporaryDirectory(prefix="serve-load-") as workdir:
    if args.base_url:
      base, name = args.base_url.rstrip("/"), args.model_name
    else:
      process, base, name = start_server(args, workdir)
    try:
      print(f"warm-up: {args.warmup_seconds:.0f} s, {args.clients} clients")
      asyncio.run(drive(base, args, name, args.warmup_seconds, args.clients,
                        args.max_requests))
      rss = {"before": rss_mib(process and process.pid)}
      print(f"load: {args.rounds} x {args.seconds:.0f} s, {args.clients} clients, at most "
            f"{args.max_requests} requests a round, mix {args.mix}")
      for round_ in range(1, args.rounds + 1):
        tally, wall = asyncio.run(drive(base, args, name, args.seconds, args.clients,
                                        args.max_requests))
        time.sleep(1.0)  # the server's last cancellations land
        rss["after"] = rss_mib(process and process.pid)
        answered = sum(len(v) for v in tally.latency.values())
        print(f"round {round_}: {answered / wall:.2f} requests/s answered, server RSS "
              f"{rss['after'] or 0:.0f} MiB")
      report(tally, wall, get_stats(base, args.api_key), rss)
    finally:
      if process is not None:
        process.send_signal(signal.SIGTERM)
        status = process.wait(60)
        print(f"server stopped: exit status {status}")
  one, five, _ = os.getloadavg()
  print(f"load average {one:.2f} (1 min) {five:.2f} (5 min)")


if __name__ == "__main__":
  main()
