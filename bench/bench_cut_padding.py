"""The learner's update with and without cutting padding (TrainConfig.width_steps) or packing
rows (TrainConfig.pack_rows), issue 48.

Both arms are jaxprefix's Learner.update on SmolLM2-135M-Instruct with LoRA rank 16 on every
projection, remat on, micro-batches of 8 rows, log-prob chunks of 256 positions, temperature 0.8,
on the same batch: --rows rows of a --prompt-token prompt and completions spread over 8..--new
tokens (40% at --new, as truncated completions are), padded to the bucketed batch width as the
loop pads them.
  full  width_steps=1: every micro-batch computed at the batch width (the update before issue 48);
  cut   width_steps=8 (an option; the default is 1): each minibatch's rows sorted by length into micro-batches,
        each micro-batch computed at the shortest of 8 steps of the width that holds its rows.
  packed  train.pack_rows: the rows packed one after another into rows of the batch width
        (first-fit, longest first), the micro-batches left empty not computed.
The first update of each arm (its compile) is timed apart; then --rounds alternating rounds. The
arms' first gradient norms must agree (both are exact). Printed: tokens each arm computes,
seconds per update (median, spread), the ratios, and the load.

  python bench/bench_cut_padding.py                 # 16 rows, prompt 60, up to 128 new
  python bench/bench_cut_padding.py --rows 64       # the real-model run's 8 x 8 rows
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import common  # noqa: E402
from jaxprefix.models import lora  # noqa: E402
from jaxprefix.rl.dynamic_sampling import bucket  # noqa: E402
from jaxprefix.rl.batch_layout import trim_widths  # noqa: E402
from jaxprefix.rl.train_config import TrainConfig  # noqa: E402
from jaxprefix.rl.train_step import Learner  # noqa: E402

MICRO_ROWS, STEPS = 8, 8


def ragged_batch(rows: int, prompt: int, new: int, vocab: int, seed: int = 0):
    """A learner batch: completions of 8..new tokens, 40% of them at `new`."""
    rng = np.random.default_rng(seed)
    completion = np.where(rng.random(rows) < 0.4, new, rng.integers(8, new, rows))
    width = bucket(prompt + new)
    cols = np.arange(width)[None]
    length = (prompt + completion)[:, None]
    token_mask = cols < length
    return {"tokens": np.where(token_mask, rng.integers(3, vocab, (rows, width)), 0).astype(np.int32),
            "positions": np.where(token_mask, cols, 0).astype(np.int32),
            "token_mask": token_mask,
            "completion_mask": ((cols >= prompt) & token_mask).astype(np.float32),
            "old_logprobs": np.full((rows, width), -2.0, np.float32),
            "advantages": rng.standard_normal(rows).astype(np.float32)}


def computed_tokens(batch, steps: int) -> int:
    """Tokens the update computes: each sorted micro-batch at its cut width."""
    width = batch["tokens"].shape[1]
    lengths = np.sort(batch["token_mask"].sum(1))
    widths = np.asarray(trim_widths(width, steps))
    micro = lengths.reshape(-1, MICRO_ROWS).max(1)
    return int(MICRO_ROWS * widths[np.searchsorted(widths, micro)].sum())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.rows % MICRO_ROWS:
        parser.error(f"--rows must be a multiple of {MICRO_ROWS}")
    common.print_load()
    model, config = common.load_smollm2()
    model = lora.with_adapters(model, lora.LoraConfig(16))
    batch = ragged_batch(args.rows, args.prompt, args.new, config.vocab_size)
    real = int(batch["token_mask"].sum())
    arms, norms = {}, {}
    for name, steps, pack in (("full", 1, False), ("cut", STEPS, False), ("packed", 1, True)):
        learner = Learner(model, TrainConfig(learning_rate=1e-4, micro_batch_size=MICRO_ROWS,
                                             remat=True, logprob_chunk=256, temperature=0.8,
                                             width_steps=steps, pack_rows=pack))
        state = learner.init_state()
        start = time.perf_counter()
        state, metrics = learner.update(state, batch)
        norms[name] = float(metrics["grad_norm"])
        computed = (round(float(metrics["update/computed_share"]) * batch["tokens"].size) if pack
                    else computed_tokens(batch, steps))
        print(f"{name}: width_steps={steps}, pack_rows={pack}, {computed} tokens computed "
              f"({real} real); first update (compile + run) {time.perf_counter() - start:.1f} s",
              flush=True)
        arms[name] = [learner, state]
    for name in ("cut", "packed"):
        np.testing.assert_allclose(norms[name], norms["full"], rtol=1e-4)

    def run(arm):
        def call():
            arm[1], metrics = arm[0].update(arm[1], batch)
            return jax.block_until_ready(metrics)
        return call

    seconds = common.time_alternating({name: run(arm) for name, arm in arms.items()},
                                      args.rounds)
    for name, samples in seconds.items():
        median, spread = common.summary(samples)
        print(f"  {name:<4} median {median:7.2f} s/update  spread {spread:4.0%}  "
              f"({[round(s, 1) for s in samples]})")
    for name in ("cut", "packed"):
        ratio = np.median(seconds["full"]) / np.median(seconds[name])
        print(f"full / {name} seconds: {ratio:.2f}x ({args.rounds} alternating rounds)")
    common.print_load()


if __name__ == "__main__":
    main()
