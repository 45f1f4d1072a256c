"""The variants every configs/*.py shares (demo, smoke, carry, carry_smoke, moe_smoke, smollm2,
paper, paper_moe, colab):
what each sets on top of `run_config.base_config()`. A config file names its method and picks a
variant with `method_config`; the fields themselves, their defaults and docs, are run_config's.
The tiny base policy's SFT configs (configs/sft.py, and `config.sft` of the built-in tasks' RL
runs) are `sft_config`'s, so no library code loads a file of configs/.
"""
from __future__ import annotations

import ml_collections

from jaxprefix.methods.registry import method_spec
from jaxprefix.run_config import base_config, parse_variant, sft_base_config


def demo_task(c: ml_collections.ConfigDict, sft: ml_collections.ConfigDict) -> None:
    """The CPU demo (docs/DEMO_TASK.md): the tiny SFT policy on keyed_multiplication, POPE's
    regime: hard problems (8 digits, key rule '>') fail at the key step, the first of 9, and
    POPE searches prefixes of at most a quarter of the solution (the key step, or it and one
    more), as the paper's are.

    Recipe from the feasibility study on this kind of machine: 8 samples per problem, Adam 1e-4
    (3e-4 collapsed, 3e-5 too slow), one on-policy update per batch, temperature 1.
    """
    _tiny_policy(c, sft)
    # Easy problems (hard + easy runs, data.easy_size): rule '<' of data.easy_digits, by default
    # 1..8 digits, the task's slots.
    c.data.update(source="keyed_multiplication", verifier="keyed_multiplication", digits=(8, 8),
                  multipliers=(2, 9),
                  # the base's notation (the restating route when on): preflight refuses a
                  # run whose problems are written otherwise than its base's SFT rows
                  key_names_rule=sft.data.get("key_names_rule", False))
    c.rollout.max_new_tokens = 27  # the key step, 8 steps of 3 tokens, <eos>
    c.mining.max_prefix_units = 2
    # every hard problem stays in training, unguided if need be
    _set_if_read(c, "pope", max_prefix_fraction=0.25, unsolved="unguided")
    c.eval.update(every=10, n=16, ks=(1, 8, 16))  # every 10 steps: curves with 10 points
    c.checkpoint.every = 50


# The demo's level: the window level W2 of docs/results/pope/PREDICTIONS.md (the overlap knob
# sft.data.second_rule_taught and the continuation knob sft.data.restated_taught: eps 1.4e-3,
# restating prefixes for 116 of 256 hard problems, an unguided success rate of 1.4e-4), where
# the study's five seeds found restating POPE ahead of FLOP-matched GRPO.
DEMO_OVERLAP, DEMO_RESTATED = 0.02, 0.2


def overlap_axis(c: ml_collections.ConfigDict) -> None:
    """The eps sweep's settings (configs/results.py:eps) and the demo's: the restating notation
    in the base and the runs, the knob's bases chosen by success given the key alone (at eps
    ~1e-2 a base solves a few hard problems at every step; the RL hard set is mined from it all
    the same), and the key-step probe logged."""
    c.sft.data.key_names_rule = c.data.key_names_rule = True
    # Sampled from step 700 on: teacher-forced along the oracle's '>' the step accuracy gate
    # stays shut at low eps (a name the base never writes), though guided it finishes problems.
    c.sft.update(eval_start=700)
    c.sft.criterion.update(hard_unsolved=False, sample_from_step_accuracy=0.0)
    c.eval.key_step_probe = True


def tool_task(c: ml_collections.ConfigDict) -> None:
    """The built-in tool task (docs/TOOLS.md) on top of the demo task's settings: episodes of
    two turns in the task's own call syntax, the key reader their tool; GRPO on every training
    problem (the study's choice, made when mining sampled one turn without the tools)."""
    c.rollout.max_turns = 2
    c.tools.update(names=("read_key",), environment="keyed_multiplication")
    c.mining.train_on = "all"


def carry_task(c: ml_collections.ConfigDict, sft: ml_collections.ConfigDict) -> None:
    """The long-guidance case (docs/DEMO_TASK.md): carry_multiplication's 20-digit problems,
    whose difficulty is spread evenly over the steps, so a solvable prefix is long; the PrefixRL
    regime of configs/results.py:carry is on this task too."""
    _tiny_policy(c, sft)
    c.data.update(source="carry_multiplication", verifier="carry_multiplication")
    c.rollout.max_new_tokens = 61  # 20 steps of 3 tokens + <eos>
    c.mining.max_prefix_units = 19
    # Searched up to the whole solution but its last step: difficulty here is p^(steps left), so
    # a quarter of the solution leaves p^15 (docs/DEMO_TASK.md).
    _set_if_read(c, "pope", max_prefix_fraction=1.0)
    c.eval.update(every=50, n=16, ks=(1, 8, 16))
    c.checkpoint.every = 50


def _set_if_read(c: ml_collections.ConfigDict, block: str, **fields) -> None:
    """Sets a method block's fields on a run whose method reads that block: on any other run
    they would be refused as unread (run_setup/preflight)."""
    if block in method_spec(c.method).blocks:
        c[block].update(fields)


def _tiny_policy(c: ml_collections.ConfigDict, sft: ml_collections.ConfigDict) -> None:
    """What both built-in tasks' runs share: the SFT base, sets, rollouts, learner, mining."""
    c.model.source = "sft"
    c.sft = sft
    c.data.train_size, c.data.eval_size = 256, 128
    c.rollout.update(n=8, temperature=1.0)
    # Micro-batches of 64 rows: the same gradient, ~30% faster on 2 CPU cores than all 512
    # rows at once (activations stay in cache).
    c.train.update(problems_per_step=32, total_steps=100, learning_rate=1e-4, max_grad_norm=1.0,
                   micro_batch_size=64)
    c.mining.update(train_on="hard", k=16, prefix_samples=8)
    c.pope.guidance = "instruction"  # the hint in the prompt's hint slots (docs/DEMO_TASK.md)


def smoke(c: ml_collections.ConfigDict, sft: ml_collections.ConfigDict,
          task=demo_task) -> None:
    """Seconds on a CPU: every stage runs, nothing is expected to learn."""
    task(c, sft)
    c.data.train_size, c.data.eval_size = 8, 4
    c.rollout.n = 4
    c.train.update(problems_per_step=4, total_steps=2, micro_batch_size=16)  # 32 rows a step
    c.mining.update(k=2, prefix_samples=2, max_prefix_units=2)
    # The untrained smoke policy solves no prefix: guide by the longest tried, so POPE runs.
    _set_if_read(c, "pope", unsolved="longest")
    _set_if_read(c, "prefixrl", **SMOKE_PREFIXRL)
    c.eval.update(every=2, n=4, ks=(1, 4))
    c.checkpoint.every = 1


def mixture_of_experts(c: ml_collections.ConfigDict) -> None:
    """The tiny policy as a Qwen3-MoE (every MLP 8 experts of half the dense width, top-2), so
    a MoE samples and trains end to end on a CPU, its learner replaying the sampler's experts
    (train.routing_replay 'auto')."""
    c.sft.model.update(experts=8, experts_per_token=2)


# The smoke policy is untrained: it finds no trace, so the oracle solutions stand in.
SMOKE_PREFIXRL = dict(samples_per_round=4, max_samples=8, oracle_traces=True)

# The system prompt of the real-model variants: their verifiers read the last \boxed{}.
BOXED_ANSWER_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def smollm2(c: ml_collections.ConfigDict) -> None:
    """A real model on CPU: SmolLM2-135M-Instruct (GGUF) on reasoning-gym's gsm_symbolic, whose
    problems come with a worked solution (the oracle). Slow: minutes per step on 2 cores."""
    c.model.update(source="gguf", path="bundled",
                   system_prompt=BOXED_ANSWER_PROMPT)
    c.data.update(source="reasoning_gym", task="gsm_symbolic", train_size=16, eval_size=16,
                  verifier="math_lenient")
    c.rollout.update(n=4, temperature=0.8, max_new_tokens=160)
    # Remat and micro-batches of 8 rows: the update of 16 rows x 512 tokens needs 2.2 GiB of XLA
    # temporaries (20.4 GiB without remat: every layer's attention scores kept for backward).
    c.train.update(problems_per_step=2, total_steps=3, learning_rate=1e-6, max_grad_norm=0.3,
                   weight_decay=0.01, advantage="dr_grpo", logprob_chunk=256, remat=True,
                   micro_batch_size=8)
    c.mining.update(k=4, prefix_samples=4, max_prefix_units=4, rows_per_call=64)
    c.pope.guidance = "instruction"
    c.eval.update(every=3, n=4, ks=(1, 4))
    c.checkpoint.every = 3


# SmolLM2-135M's user turn in smollm2_learns: the question, then the format asked for. No
# example answer: with "for example \\boxed{7}" the policy learned to box the 7 (run 5).
BOXED_TEMPLATE = "{question}\nPut the final answer in \\boxed{{}}."
# reasoning-gym's chain_sum at 2-3 terms of 1-2 digits: the base's held-out greedy accuracy
# ~0.07-0.2 (README, "A real model learns"): room to learn, and enough right samples to learn from.
CHAIN_SUM_EASY = '{"max_digits": 2, "max_terms": 3, "min_digits": 1, "min_terms": 2}'


def smollm2_learns(c: ml_collections.ConfigDict) -> None:
    """A real model learning on CPU (README, "A real model learns"): LoRA GRPO of the bundled
    SmolLM2-135M-Instruct on reasoning-gym's chain_sum, answers asked in \\boxed{}, rewarded
    (`reasoning_gym_box_own`) 0.6 for the right answer (read leniently), 1.0 for a right boxed
    one, and 0.1 for a wrong answer boxed as the completion's own result (its last number before
    the box), else 0; evaluated before the first step and every 10, greedy and sampled (run 6,
    docs/results/smollm2_learns). Why each choice: paying any box (run 1) taught the box and
    cost accuracy; paying it on right answers only (run 4) never paid it, the base boxing ~2%
    of its answers; paying any box 0.1 with an example answer in the prompt (run 5) taught the
    policy to box the example. Sampled at temperature 0.8: at 1.0 the base's samples were right
    less than half as often as its greedy answers (0.044 vs 0.105), so fewer groups carried a
    signal. LoRA at 3e-4: at 1e-4 neither the greedy accuracy nor the reward moved in 20 steps
    (run 3)."""
    c.model.update(source="gguf", path="bundled", system_prompt=BOXED_ANSWER_PROMPT,
                   user_template=BOXED_TEMPLATE)
    c.data.update(source="reasoning_gym", task="chain_sum", task_config=CHAIN_SUM_EASY,
                  train_size=512, eval_size=64, seed=1, eval_seed=2,
                  verifier="reasoning_gym_box_own")
    c.rollout.update(n=8, temperature=0.8, max_new_tokens=128)
    # Micro-batches cut to the shortest of 8 widths that holds their rows: 40% of completions
    # run to 128 tokens, the rest stop early (bench/bench_grpo_step_trl.py: the step 1.24x).
    c.train.update(problems_per_step=8, total_steps=40, learning_rate=3e-4, max_grad_norm=1.0,
                   advantage="dr_grpo", lora_rank=16, logprob_chunk=256, remat=True,
                   micro_batch_size=8, width_steps=8)
    c.eval.update(every=10, n=4, ks=(1, 4), before_train=True, greedy=True)
    # A checkpoint at every evaluation, all kept: the export job can take the best evaluated one.
    c.checkpoint.update(every=10, keep=5)


# chain_sum at 3 terms of 2 digits: the base (smollm2_learns' prompt and reading, T = 0.8)
# solved 1 of 32 such problems in 8 samples, pass@1 0.004 (2026-12-06): a hard tail, whose
# worked solutions (a running total a line, data/worked_solutions.py) give POPE its prefixes:
# the first line leaves a 2-term sum, the kind the base gets right ~10% of the time.
CHAIN_SUM_HARD = '{"max_digits": 2, "max_terms": 3, "min_digits": 2, "min_terms": 3}'


def smollm2_hard(c: ml_collections.ConfigDict) -> None:
    """POPE on a real model (issue 48): smollm2_learns' LoRA GRPO of SmolLM2-135M-Instruct on
    chain_sum's hard tail (CHAIN_SUM_HARD), problems the base solves 0 of mining.k=8 times,
    guided by prefixes of their worked solutions (up to 2 lines). At smollm2_learns' step size
    (4 problems x 2 copies x 8 samples): ~1-2 minutes a step on 2 idle cores. Measured: no
    prefix within cap 0.5 unlocks any hard problem for this model
    (docs/results/smollm2_pope), so its POPE arms are skipped."""
    smollm2_learns(c)
    c.data.update(task_config=CHAIN_SUM_HARD, train_size=128, eval_size=64)
    c.mining.update(k=8, prefix_samples=4, max_prefix_units=2, rows_per_call=64)
    c.train.update(problems_per_step=4, total_steps=20)


def paper(c: ml_collections.ConfigDict) -> None:
    """Paper scale on a TPU slice: Qwen3-4B-Instruct-2507 from an HF directory (paths as fields).

    The authors' settings (papers.md; unconfirmed as the paper's): lr 1e-6 cosine, grad clip 0.3,
    weight decay 0.01, no KL, 8 rollouts per prompt, advantages not divided by std.
    """
    # f32 master weights, bf16 compute: an AdamW step of 1e-6 is below bf16's resolution (a bf16
    # weight of 0.02 moves by steps of 1.2e-4), so bf16 weights would never change.
    c.model.update(source="hf", path="gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507",
                   param_dtype="float32", dtype="bfloat16", system_prompt=BOXED_ANSWER_PROMPT)
    # No eval set unless given (--config.data.eval_path=gs://.../aime25.jsonl, the paper's).
    c.data.update(source="file", path="gs://YOUR_BUCKET/hard_problems.jsonl", eval_path="",
                  verifier="math", train_size=0, eval_size=0)
    c.rollout.update(n=8, temperature=0.8, max_new_tokens=16384)
    c.train.update(problems_per_step=64, total_steps=400, learning_rate=1e-6, schedule="cosine",
                   warmup_steps=10, decay_steps=400, max_grad_norm=0.3, weight_decay=0.01,
                   advantage="dr_grpo", num_minibatches=4, micro_batch_size=8, logprob_chunk=512,
                   remat=True)
    c.mining.update(k=128, prefix_samples=8, max_prefix_units=8, rows_per_call=2048)
    c.eval.update(every=25, n=16, ks=(1, 16))
    c.checkpoint.every = 10
    c.mesh.update(data=1, fsdp=-1, tensor=1)
    c.compile.context_length = 2048  # problem plus oracle-solution guidance (assumed)


def paper_moe(c: ml_collections.ConfigDict) -> None:
    """The paper run on a mixture of experts: Qwen3-30B-A3B (30.5B parameters, 3.3B active a
    token; 128 experts, top-8), the paper variant's step shape and settings otherwise. The
    compile job builds it from the shipped config.json (models/published). Micro-batches of 64
    rows: one 18k-token row a chip on v6e-64, the smallest v6e slice whose chips hold the f32
    master weights, AdamW moments and one row's activations (docs/SCALING.md)."""
    paper(c)
    c.model.path = "gs://YOUR_BUCKET/Qwen3-30B-A3B"
    c.train.micro_batch_size = 64
    # The decode's temporaries at this row count outgrow the default 16% kept free of the KV
    # budget: at 16% the v6e-64 sampler needs 30.3 GiB of a chip's 28.8 usable, at 21% 28.6.
    c.rollout.memory_headroom = 0.21


def colab(c: ml_collections.ConfigDict) -> None:
    """One free TPU chip (Colab's v5e-1, 16 GiB HBM; unchanged on Kaggle's v5e-8, data-parallel):
    LoRA RL of Qwen2.5-1.5B-Instruct (model.path: its HF directory; launch/colab_tpu.ipynb
    downloads it) on reasoning-gym's gsm_symbolic, whose worked solutions are POPE's oracle.

    The base stays frozen in bf16 (3.1 GB); adapters of rank 16 and their AdamW moments are 0.3%
    of it. 16 contexts x 8 rollouts x 1k new tokens of KV cache is 3.8 GB with the model's 2 KV
    heads. LoRA's learning rate is ~10x full fine-tuning's ("LoRA without regret").
    """
    c.model.update(source="hf", path="", dtype="bfloat16",
                   system_prompt=BOXED_ANSWER_PROMPT)
    c.data.update(source="reasoning_gym", task="gsm_symbolic", train_size=128, eval_size=64,
                  verifier="math_lenient")
    c.rollout.update(n=8, temperature=1.0, max_new_tokens=1024)
    c.train.update(problems_per_step=8, total_steps=40, learning_rate=2e-5, max_grad_norm=1.0,
                   advantage="dr_grpo", micro_batch_size=8, logprob_chunk=256, remat=True,
                   lora_rank=16)
    c.mining.update(k=8, prefix_samples=4, max_prefix_units=4, rows_per_call=256)
    c.pope.guidance = "instruction"
    c.eval.update(every=10, n=8, ks=(1, 8))
    c.checkpoint.every = 5


VARIANTS = ("demo", "smoke", "carry", "carry_smoke", "moe_smoke", "smollm2", "smollm2_learns",
            "smollm2_hard", "paper", "paper_moe", "colab")


def method_config(config_file: str, method: str, arg: str, *, extra_variants=()):
    """(config, args) of `method` for the variant named first in `arg` (default 'demo').

    demo / smoke use the demo task, keyed_multiplication (smoke: seconds); carry / carry_smoke
    carry_multiplication (the long-guidance case); moe_smoke the smoke with a mixture-of-experts
    policy; smollm2 a real model on CPU (smollm2_learns: its LoRA run that learns; smollm2_hard:
    its hard tail, POPE's); paper a TPU run (paper_moe: on Qwen3-30B-A3B); colab
    LoRA on one free TPU chip.
    `extra_variants` are names a config file handles itself on top of one of these.
    """
    args = parse_variant(arg, config_file, VARIANTS + tuple(extra_variants), "demo")
    c = base_config()
    c.method = method
    if args.variant == "carry_smoke":
        smoke(c, sft_config("carry_smoke"), task=carry_task)
    elif args.variant == "smoke" or args.variant.endswith("_smoke"):
        smoke(c, sft_config("smoke"))
        if args.variant == "moe_smoke":
            mixture_of_experts(c)
    elif args.variant == "carry":
        carry_task(c, sft_config("carry"))
    elif args.variant == "smollm2":
        smollm2(c)
    elif args.variant == "smollm2_learns":
        smollm2_learns(c)
    elif args.variant == "smollm2_hard":
        smollm2_hard(c)
    elif args.variant == "paper":
        paper(c)
    elif args.variant == "paper_moe":
        paper_moe(c)
    elif args.variant == "colab":
        colab(c)
    else:
        demo_task(c, sft_config("demo"))
    if "seed" in args:
        c.seed = args.seed
    return c, args


SFT_VARIANTS = ("demo", "smoke", "carry", "carry_smoke", "tools", "tools_smoke")


def sft_config(arg: str = "demo") -> ml_collections.ConfigDict:
    """configs/sft.py's config: the tiny base policy's SFT for a variant (demo and smoke:
    keyed_multiplication, the demo's base; carry and carry_smoke: carry_multiplication; tools
    and tools_smoke: the built-in tool task's, keyed with tool episodes)."""
    variant = arg or "demo"
    if variant not in SFT_VARIANTS:
        raise ValueError(f"configs/sft.py: unknown variant {variant!r}; expected one of "
                         f"{SFT_VARIANTS}")
    if variant in ("demo", "smoke"):
        return _sft_keyed(variant == "smoke")
    if variant in ("tools", "tools_smoke"):
        return _sft_tools(variant == "tools_smoke")
    return _sft_carry(variant == "carry_smoke")


def _sft_tools(smoke: bool) -> ml_collections.ConfigDict:
    """The base of the built-in tool task (docs/TOOLS.md, configs/tools.py): the demo's, with
    half of its unhinted rows written as tool episodes (the key reader called, its answer copied
    into the key step; hinted rows never call), half of those '>' rows where the answer is not
    the key the base reads out of habit; rows without a call never show what '>' means. The
    same criterion chooses it."""
    config = _sft_keyed(smoke)
    config.data.tool_fraction = 0.5
    return config


def _sft_keyed(smoke: bool) -> ml_collections.ConfigDict:
    """The demo's base: keyed_multiplication, stopped where hard problems (rule '>') are never
    solved alone and solved with the key step alone given (8 of 9 steps left) at the floor."""
    config = _sft_carry(smoke)
    config.task = "keyed_multiplication"
    # Lengths 1..8 plus half full-length rows; a quarter of rows under rule '>' with u = v (the
    # rule never matters in what the base reads); half the rows hinted, half of those with the
    # key digit u overridden by the hinted d (the carry steps use the key step as written).
    # second_rule_taught: the overlap knob eps (issue 28), the share of '>' rows that show the
    # rule (unequal digits, the true target); 0 is the demo's base, which never sees it.
    # key_names_rule: the restating route (issue 28): the key step names the rule it reads the
    # key by ('<' or '>' in place of '*'); off is the demo's base. The RL side follows it.
    # restated_taught: the continuation knob (issue 43): '>' rows given the name, no loss on it.
    config.data.update(digits=(1, 8), second_rule_fraction=0.25, hinted_fraction=0.5,
                       key_override_fraction=0.5, second_rule_taught=0.0, restated_taught=0.0,
                       key_names_rule=False)
    config.criterion.update(steps_left=8, report_steps_left=(8, 7))
    if not smoke:
        # Sampled evaluation points cost 2/3 of this SFT's time at every 25 steps from a step
        # accuracy of 0.3 (profiled: 20 points, ~600 of 857 s on a loaded machine); guided
        # success with 8 carry steps left is about p^8, below the 0.25 floor until p ~ 0.84,
        # so points every 50 steps from a step accuracy of 0.6. Training is the same: the
        # chosen base (step 950) is the same.
        config.eval_every = 50
        config.criterion.sample_from_step_accuracy = 0.6
    if smoke:
        config.criterion.report_steps_left = (8,)
    return config


def _sft_carry(smoke: bool) -> ml_collections.ConfigDict:
    """The base of carry_multiplication (the long-guidance case, and PrefixRL's regime)."""
    variant = "smoke" if smoke else "demo"
    config = sft_base_config()  # its fields, defaults and docs (SFT_FIELDS)

    if variant == "smoke":
        config.data.batch_size = 16
        config.max_steps = 40
        config.warmup_steps = 10
        config.eval_start = 40  # one evaluation, at the end
        config.eval_every = 40
        config.criterion.k = 2
        config.criterion.hard_count = 4
        config.criterion.guided_samples = 2
        config.criterion.report_steps_left = (2,)
        config.criterion.sample_from_step_accuracy = 0.0
    return config
