"""Multi-turn tool episodes: the KV kept across turns (rows leave the continuous decode for their
tools) against re-prefilling the conversation each turn (the reference rollout).

SmolLM2-135M-Instruct (the bundled GGUF, f32) answers --contexts arithmetic questions through
its chat template, --n episodes each, temperature 1, turns of up to --turn-tokens tokens. The
turns are forced tool calls: every turn is read as a call of a calculator (on an expression
made from the turn's length) until a turn's length is a multiple of 3 or --max-turns turns
are sampled, so episodes run 1-4 turns and every call appends SmolLM2's real tool turn
(--calls every: no turn answers, every episode runs --max-turns turns). The
calculator sleeps --tool-ms first, standing in for a tool that takes time (a python tool's
subprocess takes ~40 ms).

  reference  tools.episodes.rollout_episodes: one generate() per turn on every running
             conversation, re-prefilled whole; the calls of a turn run in --tool-workers
             threads between that turn's generate() and the next, the device idle meanwhile;
  kv_kept    rollout_episodes(kv_kept=True): one continuous decode in chunks of at most
             --chunk-steps steps; a row whose turn ends waits with its KV in its pages while
             its tool runs in one of --tool-workers threads and the device decodes the others.

Both arms draw every token of an episode from the same stream (tests/test_tool_episodes.py checks
they give the same episodes on a tiny model); on SmolLM2 the static and paged decodes round apart
in f32 and a flipped sampled token sends an episode its own way, so the script prints how many
episodes came out equal and rates each arm by its own sampled tokens. Arms alternate, --repeats rounds after
a compile round (bench/common.py). Printed: sampled tokens/s of each arm and their ratio, the
tokens each re-prefilled, the device's idle share (of the wall time, and of the time a tool was
running), the turns per episode, the cores, threads and load.

  python bench/bench_tool_turns.py              # 8 contexts x 4 episodes
  python bench/bench_tool_turns.py --quick      # 2 x 2, a sanity run
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

from jaxprefix import tokenizers, tools  # noqa: E402
from jaxprefix.checkpoints import gguf, hf  # noqa: E402
from jaxprefix.tools.calculator import CALCULATOR  # noqa: E402
from jaxprefix.tools.calls import ToolCall  # noqa: E402
from jaxprefix.tools.episodes import episode_metrics, rollout_episodes  # noqa: E402

SYSTEM = ("You have a calculator. Call it as <tool_call>{\"name\": \"calculator\", "
          "\"arguments\": {\"expression\": \"...\"}}</tool_call> and use its answer.")


def forced_calls(text: str) -> list[ToolCall]:
  """Every turn a call, unless its length is a multiple of 3 (then it is the answer)."""
  if len(text) % 3 == 0:
    return []
  return every_turn_a_call(text)


def every_turn_a_call(text: str) -> list[ToolCall]:
  """Every turn a call: every episode runs --max-turns turns."""
  return [ToolCall("calculator", {"expression": f"{len(text)} * 7"})]


CALL_RULES = {'mixed': forced_calls, 'every': every_turn_a_call}


def slow_calculator(milliseconds: float) -> tools.Registry:
  def calculator(arguments: dict) -> str:
    time.sleep(milliseconds / 1000)
    return CALCULATOR.fn(arguments)
  return tools.Registry([tools.Tool("calculator", calculator, CALCULATOR.description)])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--contexts', type=int, default=8)
  parser.add_argument('--n', type=int, default=4)
  parser.add_argument('--turn-tokens', type=int, default=32)
  parser.add_argument('--max-turns', type=int, default=4)
  parser.add_argument('--tool-ms', type=float, default=50.0)
  parser.add_argument('--tool-workers', type=int, default=4)
  parser.add_argument('--chunk-steps', type=int, default=16)
  parser.add_argument('--kv-rows', type=int, default=None,
                      help="kv_kept's rows in flight (default: every episode's row at once)")
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--calls', choices=sorted(CALL_RULES), default='mixed',
                      help="mixed: a turn whose length is a multiple of 3 is the answer (episodes "
                           "of 1 to --max-turns turns); every: every turn calls the tool")
  parser.add_argument('--quick', action='store_true')
  args = parser.parse_args()
  if args.quick:
    args.contexts, args.n, args.repeats = 2, 2, 1

  path = gguf.bundled_smollm2_path()
  model, _ = hf.from_gguf(path, 'float32')
  tokenizer = tokenizers.load(path)
  questions = [f"What is {a} * {b}?" for a, b in zip(range(12, 12 + args.contexts),
                                                     range(37, 37 + args.contexts))]
  contexts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                             {"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True)
              for q in questions]
  budget = max(map(len, contexts)) + args.max_turns * (args.turn_tokens + 24)
  registry = slow_calculator(args.tool_ms)
  timings = {'reference': {}, 'kv_kept': {}}
  results = {}

  def arm(kv_kept: bool):
    name = 'kv_kept' if kv_kept else 'reference'

    def run():
      timing = {}
      results[name] = rollout_episodes(
          model, contexts, tokenizer=tokenizer, tools=registry, n=args.n,
          max_turns=args.max_turns, episode_token_budget=budget,
          max_new_tokens=args.turn_tokens, stop_ids=[tokenizer.eos_id], seed=0,
          temperature=1.0, parse=CALL_RULES[args.calls], tool_workers=args.tool_workers,
          kv_kept=kv_kept, chunk_steps=args.chunk_steps, timings=timing,
          **({'max_rows_in_flight': args.kv_rows} if kv_kept else {}))
      for key, value in timing.items():
        timings[name].setdefault(key, []).append(value)
    return run

  arms = {'reference': arm(False), 'kv_kept': arm(True)}
  for run in arms.values():  # compiles
    run()
  for entry in timings.values():
    entry.clear()
  seconds = common.time_alternating(arms, args.repeats)

  reference, kept = results['reference'], results['kv_kept']
  same = sum(a.tokens.tolist() == b.tokens.tolist() for a, b in zip(reference, kept))
  sampled = {name: sum(int(e.sampled.sum()) for e in episodes)
             for name, episodes in results.items()}
  turns = collections.Counter(e.turns for e in kept)
  print(f"load: {os.getloadavg()}, cores: {os.cpu_count()}, XLA:CPU on every core "
        f"(XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}), tool threads: {args.tool_workers}")
  print(f"{len(kept)} episodes ({args.contexts} contexts x {args.n}), turns per episode "
        f"{dict(sorted(turns.items()))}, {sampled['kv_kept']} sampled tokens (reference: {sampled['reference']}), tool "
        f"{args.tool_ms:.0f} ms a call; episodes equal across arms: {same} of {len(kept)} (f32: "
        f"the static and paged decodes round apart, and a sampled token that flips sends an "
        f"episode its own way)")
  rates = {}
  for name, episodes in results.items():
    median, spread = common.summary(seconds[name])
    rates[name] = sampled[name] / median
    t = {k: statistics.median(v) for k, v in timings[name].items()}
    idle = 1 - t['device_s'] / t['wall_s']
    idle_tools = t['idle_while_tools_s'] / t['tools_s'] if t['tools_s'] else 0.0
    steps = (f", {t['steps']:.0f} decode steps in {t['chunks']:.0f} chunks "
             f"({t['narrow_chunks']:.0f} on part of the rows)" if 'steps' in t else '')
    print(f"  {name:9s}  {rates[name]:7.1f} sampled tok/s (median of {args.repeats}, spread "
          f"{spread:.0%}); re-prefilled {episode_metrics(episodes)['rollout/reprefilled_tokens']:.0f}"
          f" tokens; device idle {idle:.0%} of the wall time, {idle_tools:.0%} of the time a "
          f"tool runs{steps}")
  print(f"kv_kept / reference: {rates['kv_kept'] / rates['reference']:.2f}x sampled tokens/s "
        f"(kv_kept rows in flight: {args.kv_rows or 'all'}, chunks of at most "
        f"{args.chunk_steps} steps, --calls {args.calls})")


if __name__ == '__main__':
  main()
