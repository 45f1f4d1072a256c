"""One GRPO step on SmolLM2-135M-Instruct with LoRA: jaxprefix against TRL's GRPOTrainer (issue 48).

Both arms take the same GRPO step on the same CPU, in one process, from the same weights (the
bundled GGUF, dequantised to f32), on the same problems (reasoning-gym basic_arithmetic, 2 terms
of 1-2 digits; --problems of them a step, the same ones in both arms), the same prompt (the chat
template over the boxed-answer system prompt and the question; the token ids are checked equal),
--n samples each of up to --new tokens at temperature 0.8, stop at <|im_end|>, the same reward
(jaxprefix's `math_lenient` verifier on the completion text), Dr. GRPO (advantages not divided by
the group's std, loss summed over tokens / (rows x --new)), no KL, one update per batch in
micro-batches of 8 rows, LoRA rank --rank (alpha 32) on every linear layer of the decoder, AdamW
lr 1e-4 (constant), global-norm clip 1.0, f32 throughout (--bf16: both arms compute in bf16
with f32 adapters, TRL's own default precision: its `bf16=True` autocast, our base held in bf16).
  ours  `configs/grpo.py:smollm2` with the overrides above, one step of the RL loop's body:
        scoring.sample_and_score (sampler with the adapters merged; reward), the loop's batch,
        Learner.update (remat on, its defaults otherwise; --width-steps k sets
        train.width_steps, each micro-batch cut to the shortest of k widths that holds its
        rows, default 8 as in configs/grpo.py:smollm2_learns; 1: full width). Old log-probs
        are the sampler's. Micro-batches whose rows all have advantage 0 (groups that scored
        alike) are skipped, as the run does
        (train.skip_zero_advantage; the same gradient): each step prints the share computed,
        and --no-skip computes them all, as TRL does. --pack sets train.pack_rows: each
        minibatch's rows packed one after another into rows of the batch width (the same
        gradient), the micro-batches left empty not computed.
  trl   TRL's GRPOTrainer as its docs set it up on CPU: transformers' model (our HF export read
        back by from_pretrained), peft LoraConfig(target_modules='all-linear'), its own
        generation (transformers' generate), per_device_train_batch_size 8 with
        gradient_accumulation_steps = rows / 8 (one generation batch a step, so no old log-probs
        are recomputed), its default gradient checkpointing, use_cpu.
Rounds alternate the arms: each TRL step (timed from its on_step_begin to its on_step_end
callback) is followed, inside its on_step_end, by one step of ours. The first step of each arm
is its warm-up (compiles, caches) and is reported apart. Where each arm's step goes: sampling
(generation), rewards, logprobs (forward passes outside the update), update (fwd + bwd + optimizer),
host (the rest: tokenising, batching, advantages). Requirements of the TRL arm (not in setup.cfg):
`pip install "trl==1.16.0" "torch==2.13.0" "transformers==5.24.0"` (peft, accelerate, datasets).

  python bench/bench_grpo_step_trl.py              # 8 problems x 8 samples x 128 new, 2 rounds
  python bench/bench_grpo_step_trl.py --quick      # 2 x 4 x 16 new, 1 round: a sanity run
"""
from __future__ import annotations

import argparse
import collections
import faulthandler
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import common, limits  # noqa: E402
from jaxprefix import rewards, sampling, tokenizers, variants  # noqa: E402
from jaxprefix.checkpoints.gguf import bundled_smollm2_path  # noqa: E402
from jaxprefix.data.reasoning_gym_source import reasoning_gym_problems  # noqa: E402
from jaxprefix.methods.prompting import ChatPrompts  # noqa: E402
from jaxprefix.rl import loop, scoring  # noqa: E402
from jaxprefix.run_setup.learner_settings import (lora_config, loop_settings,  # noqa: E402
                                                  reward_settings, train_config)
from jaxprefix.rl.train_step import Learner  # noqa: E402

TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
PROBLEMS, PROBLEM_SEED = 32, 0
MICRO_ROWS, LORA_ALPHA, LEARNING_RATE, TEMPERATURE = 8, 32.0, 1e-4, 0.8


def run_config(args):
    """configs/grpo.py:smollm2 with the bench's shape and settings."""
    c, _ = variants.method_config("grpo.py", "grpo", "smollm2")
    c.rollout.update(n=args.n, temperature=TEMPERATURE, max_new_tokens=args.new)
    c.train.update(problems_per_step=args.problems, learning_rate=LEARNING_RATE, max_grad_norm=1.0,
                   weight_decay=0.0, advantage="dr_grpo", aggregation="seq_mean_token_sum_norm",
                   lora_rank=args.rank, micro_batch_size=MICRO_ROWS, remat=True,
                   width_steps=args.width_steps, skip_zero_advantage=not args.no_skip,
                   pack_rows=args.pack)
    c.train.lora.alpha = LORA_ALPHA
    return c


class Ours:
    """One step of the RL loop's body per call; records where each step's seconds go."""

    def __init__(self, config, problems, args):
        model, _ = common.load_smollm2(jnp.bfloat16 if args.bf16 else jnp.float32)
        self.config, self.problems, self.args = config, problems, args
        self.learner = Learner(loop.adapted(model, lora_config(config), config.seed),
                               train_config(config))
        self.state = self.learner.init_state()
        self.tokenizer = tokenizers.load(bundled_smollm2_path())
        prompts = ChatPrompts(self.tokenizer, config.model.system_prompt)
        self.contexts = [prompts.question(p) for p in problems]
        self.rollout = sampling.RolloutSpec.from_config(config.rollout)
        self.step, self.parts = 0, []

    def __call__(self):
        start = time.perf_counter()
        picked = [(self.step * self.args.problems + i) % len(self.problems)
                  for i in range(self.args.problems)]
        request = scoring.RolloutRequest([self.contexts[i] for i in picked],
                                      [self.problems[i] for i in picked], {}, self.args.n)
        policy = self.learner.sampling_model(self.state)
        scored = scoring.sample_and_score(policy, self.tokenizer, request,
                                       reward_settings(self.config),
                                       rollout=self.rollout, seed=self.step,
                                       stop_ids=(self.tokenizer.eos_id,))
        del policy
        _, batch = loop._batch([scored], loop_settings(self.config))
        update_start = time.perf_counter()
        self.state, metrics = self.learner.update(self.state, batch)
        jax.block_until_ready(metrics)
        end = time.perf_counter()
        total = end - start
        self.parts.append({"step": total, "sampling": scored.seconds_sampling,
                           "rewards": scored.seconds_reward, "logprobs": 0.0,
                           "update": end - update_start,
                           "host": total - scored.seconds_sampling - scored.seconds_reward
                           - (end - update_start),
                           "tokens": int(batch["token_mask"].sum()),
                           "decode_steps": int(scored.rollouts.lengths.max()),
                           "rows": len(scored.rollouts.lengths),
                           "prefill": sum(len(c) for c in request.contexts),
                           "context": float(scored.rollouts.context_lengths.mean()),
                           "forwarded": int((scored.rollouts.context_lengths
                                             + scored.rollouts.lengths).sum()),
                           "width": batch["tokens"].shape[1],
                           "reward": float(scored.rewards.mean()),
                           "computed": float(metrics["update/computed_share"])})
        self.step += 1
        print(f"  ours step {self.step}: {total:.1f} s", flush=True)


def trl_trainer(config, problems, args, export_dir, on_step_end):
    """TRL's GRPOTrainer as its docs set it up, timed per step and per part."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(os.cpu_count())
    system = config.model.system_prompt
    order = [(s * args.problems + i) % len(problems)
             for s in range(args.rounds + 1) for i in range(args.problems)]
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": system},
                                             {"role": "user", "content": problems[i].question}],
                                  "index": i} for i in order])

    def reward(completions, index, **_):
        texts = [c[-1]["content"] for c in completions]
        scores, _ = rewards.score_batch(config.data.verifier, texts, [problems[i] for i in index],
                                        timeout_s=config.rewards.timeout_s)
        return [float(s) for s in scores]

    rows = args.problems * args.n
    trl_args = GRPOConfig(
        output_dir=os.path.join(export_dir, "trl"), use_cpu=True, bf16=args.bf16, fp16=False,
        per_device_train_batch_size=MICRO_ROWS, gradient_accumulation_steps=rows // MICRO_ROWS,
        num_generations=args.n, max_completion_length=args.new, temperature=TEMPERATURE,
        learning_rate=LEARNING_RATE, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, loss_type="dr_grpo", scale_rewards="none", beta=0.0,
        num_iterations=1, max_steps=args.rounds + 1, shuffle_dataset=False, logging_steps=1,
        report_to="none", save_strategy="no", seed=0, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_args, train_dataset=dataset,
                          processing_class=tokenizer,
                          peft_config=LoraConfig(r=args.rank, lora_alpha=LORA_ALPHA,
                                                 target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    seconds = collections.defaultdict(float)
    scope = []  # the innermost timed part a logprob forward runs in

    def timed(name, fn):
        def call(*a, **k):
            scope.append(name)
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - start
                scope.pop()
        return call

    trainer._generate = timed("sampling", trainer._generate)
    trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("prepare",
                                                    trainer._generate_and_score_completions)
    logps = trainer._get_per_token_logps_and_entropies

    def scoped_logps(*a, **k):  # only forwards in the generate-and-score stage are 'logprobs'
        return timed("logprobs", logps)(*a, **k) if scope and scope[-1] == "prepare" else \
            logps(*a, **k)
    trainer._get_per_token_logps_and_entropies = scoped_logps
    parts = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            seconds.clear()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            step = time.perf_counter() - self.start
            prepare = seconds["prepare"]
            parts.append({"step": step, "sampling": seconds["sampling"],
                          "rewards": seconds["rewards"], "logprobs": seconds["logprobs"],
                          "update": step - prepare,
                          "host": prepare - seconds["sampling"] - seconds["rewards"]
                          - seconds["logprobs"]})
            print(f"  trl step {len(parts)}: {step:.1f} s", flush=True)
            on_step_end()

    trainer.add_callback(Clock())
    return trainer, tokenizer, parts


def cpu_facts() -> str:
    try:
        lines = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    except OSError:
        return ""
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "L1d", "L2", "L3", "Flags")
    out = []
    for line in lines:
        if line.startswith(keep):
            key, _, value = line.partition(":")
            value = value.strip()
            if key.startswith("Flags"):
                value = " ".join(f for f in value.split()
                                 if f.startswith(("avx512", "amx"))) or "no avx512 / amx"
            out.append(f"{key.strip()}: {value}")
    return "; ".join(out)


def print_parts(name, parts):
    keys = ("step", "sampling", "rewards", "logprobs", "update", "host")
    med = {k: statistics.median(p[k] for p in parts) for k in keys}
    spread = (max(p["step"] for p in parts) - min(p["step"] for p in parts)) / med["step"]
    print(f"  {name:<5} " + "  ".join(f"{k} {med[k]:6.1f}" for k in keys)
          + f"  (s, median of {len(parts)}; step spread {spread:.0%})")
    return med["step"]


def print_floors(parts, measured, bf16: bool):
    """Ours against this machine's floors (bench/limits.py), phase by phase, medians."""
    shape = limits.smollm2_shape()
    if bf16:
        shape |= dict(weight_bytes=shape["weight_bytes"] // 2,
                      kv_bytes_per_token=shape["kv_bytes_per_token"] // 2)
    sampling, update, rates = [], [], []
    for p in parts:
        floor = limits.sampler_floor_s(measured, rows=p["rows"], decode_steps=p["decode_steps"],
                                       prefill_tokens=p["prefill"], context=p["context"],
                                       bf16=bf16, **shape)
        sampling.append(p["sampling"] / floor)
        update.append(p["update"] / limits.update_floor_s(
            measured, n_params=shape["n_params"], tokens=p["forwarded"], bf16=bf16))
        rates.append(6 * shape["n_params"] * p["forwarded"] / p["update"])
    wide = measured.matmul_bf16_wide if bf16 else measured.matmul_f32_wide
    print(f"against the floors ({measured.describe()}):\n"
          f"  sampling {statistics.median(sampling):.1f}x its floor; update "
          f"{statistics.median(update):.1f}x its floor, its 6ND rate "
          f"{statistics.median(rates) / 1e9:.0f} GFLOP/s = {statistics.median(rates) / wide:.0%} of "
          f"the measured {'bf16' if bf16 else 'f32'} matmul rate")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="timed steps of each arm")
    parser.add_argument("--width-steps", type=int, default=8,
                        help="ours: train.width_steps (micro-batches cut to the shortest of k "
                             "widths that holds their rows; 1: full width), default the "
                             "real-model run's (configs/grpo.py:smollm2_learns)")
    parser.add_argument("--no-skip", action="store_true",
                        help="ours: compute every micro-batch (train.skip_zero_advantage=False)")
    parser.add_argument("--pack", action="store_true",
                        help="ours: train.pack_rows (rows packed into rows of the batch width)")
    parser.add_argument("--bf16", action="store_true",
                        help="both arms compute in bf16 with f32 adapters (TRL's default)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.problems, args.n, args.new, args.rounds = 2, 4, 16, 1
    if args.problems * args.n % MICRO_ROWS:
        parser.error(f"--problems x --n must be a multiple of {MICRO_ROWS} (the micro-batch)")
    import torch

    faulthandler.dump_traceback_later(1200, repeat=True)  # where a stuck step is
    common.print_load()
    print(f"CPU: {os.cpu_count()} CPUs; {cpu_facts()}")
    measured = limits.measure()  # before either arm loads: the box as the arms find it
    print(f"limits: {measured.describe()}", flush=True)
    problems = reasoning_gym_problems("basic_arithmetic", PROBLEMS, PROBLEM_SEED, **TASK_CONFIG)
    config = run_config(args)
    ours = Ours(config, problems, args)
    with tempfile.TemporaryDirectory() as export_dir:
        from jaxprefix.checkpoints.hf import save_pretrained
        model, model_config = common.load_smollm2()
        save_pretrained(model, model_config, export_dir, tokenizer=ours.tokenizer)
        del model
        trainer, hf_tokenizer, trl_parts = trl_trainer(config, problems, args, export_dir, ours)
        prompt = hf_tokenizer.apply_chat_template(
            [{"role": "system", "content": config.model.system_prompt},
             {"role": "user", "content": problems[0].question}], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        if list(prompt) != list(ours.contexts[0]):
            raise SystemExit("the arms' prompt token ids differ")
        print(f"threads: torch {torch.get_num_threads()}, jax (XLA CPU) every core; "
              f"{args.problems} problems x {args.n} samples, up to {args.new} new tokens, "
              f"temperature {TEMPERATURE}, LoRA r{args.rank} all linear, lr {LEARNING_RATE}, "
              f"dr_grpo, no KL, {'bf16 compute, f32 adapters' if args.bf16 else 'f32'}, "
              f"micro-batches of {MICRO_ROWS} rows, ours at "
              f"train.width_steps={args.width_steps}, train.skip_zero_advantage="
              f"{not args.no_skip}, train.pack_rows={args.pack}", flush=True)
        trainer.train()  # each TRL step is followed by one of ours (the Clock callback)
    print(f"first step (warm-up): ours {ours.parts[0]['step']:.1f} s (update "
          f"{ours.parts[0]['update']:.1f} s), trl {trl_parts[0]['step']:.1f} s")
    for i, p in enumerate(ours.parts[1:], 1):
        print(f"  ours step {i}: {p['step']:.1f} s, {p['tokens']} real tokens at width "
              f"{p['width']}, mean reward {p['reward']:.3f}, micro-batches computed "
              f"{p['computed']:.0%}; trl step {i}: "
              f"{trl_parts[i]['step']:.1f} s")
    print("where a step goes (after the warm-up):")
    ours_s = print_parts("ours", ours.parts[1:])
    trl_s = print_parts("trl", trl_parts[1:])
    print(f"ours / trl steps/s: {trl_s / ours_s:.2f}x from medians (goal >= 3); "
          f"{args.rounds} alternated rounds after a warm-up step each")
    print_floors(ours.parts[1:], measured, args.bf16)
    common.print_load()


if __name__ == "__main__":
    main()
