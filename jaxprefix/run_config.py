"""Every field a jaxprefix run reads, with its default: the base that each configs/*.py edits.

A config file starts from `base_config()`, sets what its method and variant change, and returns
it; main locks it, so a misspelt `--config.x=...` fails instead of being ignored. Defaults that
are facts about the papers say so; unconfirmed details of a paper are fields with the stated
value (see docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import importlib.util
import os

import ml_collections

from jaxprefix import distributed


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.job = "rl"  # sft | mine | rl | eval | sweep | fit | demo | results | export | compile
    c.method = "grpo"  # grpo | pope | prefixrl
    c.seed = 0
    # Resuming refuses a change to a field that alters the run (run_identity.py) unless it is
    # listed here: 'train.learning_rate,rollout.n' (a block name covers its fields).
    c.allow_changes = ""

    # Where the policy comes from (jobs/policy.py): sft | hf | gguf ('bundled' = SmolLM2).
    # param_dtype: the weights the optimizer updates and its moments (master copy); dtype: the
    # compute dtype of the forward/backward and of the sampler's copy of the weights.
    c.model = ml_collections.ConfigDict(dict(source="sft", path="", param_dtype="float32",
                                             dtype="float32", system_prompt=""))
    # The tiny base model's SFT (source 'sft' only); filled from configs/sft.py by the files.
    c.sft = ml_collections.ConfigDict()

    # Problem sets (jobs/problem_sets.py); split / eval_split: of an 'hf' or 'tfds' dataset.
    c.data = ml_collections.ConfigDict(dict(
        source="carry_multiplication", task="", path="", eval_path="", split="train", eval_split="",
        question_field="question", solution_field="solution", answer_field="answer",
        verifier="math", train_size=256,
        eval_size=128, seed=1, eval_seed=2, digits=(20, 20), multipliers=(6, 9), easy_size=0,
        easy_digits=(1, 10),
        # Bad records and over-long prompts: refused (one line naming file and line), or skipped
        # and counted with skip_invalid. Prompts must fit the model's context less
        # rollout.max_new_tokens, and max_prompt_tokens when set (0: no cap of its own).
        skip_invalid=False, max_prompt_tokens=0))

    # Sampling of training rollouts (and of mining, at the same settings).
    # max_rows_in_flight: rows decoded at once (0: as many as kv_budget_gib holds, all when it
    # binds nothing); kv_budget_gib: KV cache budget over all devices (0: what the accelerators
    # hold beyond memory_headroom of their memory, unbounded on CPU); page_size: tokens per KV
    # page of the continuous decode; kv_reserve: share of a whole row's pages promised to each
    # row it starts (below 1: more rows, the youngest preempted and restarted when pages run
    # out); tensor_parallel: devices the decode splits heads over (0: the widest on TPU, the
    # learner's layout elsewhere). None of these changes the rollouts, only the speed.
    # kv_dtype: the KV pages' dtype ('': the compute dtype; 'int8' halves KV memory and reads,
    # and changes the log-probs a little: see train.old_logprobs).
    # max_turns: assistant turns of an episode with tools (docs/TOOLS.md); only 1 (one turn,
    # no tools) until the RL loop trains on episodes.
    c.rollout = ml_collections.ConfigDict(dict(n=8, temperature=1.0, top_p=1.0, top_k=0,
                                               max_new_tokens=64, max_rows_in_flight=0,
                                               kv_budget_gib=0.0, memory_headroom=0.16,
                                               page_size=128, kv_reserve=1.0, tensor_parallel=0,
                                               kv_dtype='', max_turns=1))

    # The learner (rl/train_step.py TrainConfig fields) and the loop.
    c.train = ml_collections.ConfigDict(dict(
        problems_per_step=32, total_steps=100, advantage="grpo", dynamic_sampling=False,
        max_refill_rounds=2, learning_rate=1e-4, schedule="constant", warmup_steps=0,
        decay_steps=1000, min_lr_ratio=0.0, b1=0.9, b2=0.999, adam_eps=1e-8, weight_decay=0.0,
        max_grad_norm=1.0, num_minibatches=1, num_epochs=1, micro_batch_size=0, eps_low=0.2,
        eps_high=0.2, ratio="token", aggregation="token_mean", max_len=0, kl_coef=0.0,
        kl_kind="k3", logprob_chunk=1024, mask_truncated=False,
        remat=False,  # True: recompute each layer in the backward pass (large models)
        # pi_old of the ratio: 'sampler' (the rollouts' log-probs) or 'learner' (one more forward
        # recomputes them in the learner's numerics; logs rollout/logprob_mismatch_mean, _max).
        # tis_cap > 0 (with 'learner'): truncated importance sampling, each token's
        # policy-gradient term times min(pi_old / pi_sampler, tis_cap) (verl's TIS; 0: off).
        old_logprobs="sampler", tis_cap=0.0,
        # Log-probs and loss of softmax(logits / rollout.temperature) (TRL, verl, Tunix); False
        # scores the raw model (T = 1) whatever the sampling temperature.
        logprobs_at_sampling_temperature=True,
        entropy_coef=0.0,  # > 0: entropy bonus (a baseline POPE reports failing on hard problems)
        pass_k=4,  # the k of advantage='pass_at_k' (Pass@k Training, Chen et al. 2025)
        flops_budget=0.0,  # > 0: stop before a step would pass this many RL FLOPs
        # LoRA (models/lora.py): rank 0 trains every weight; rank r > 0 trains only adapters of
        # rank r on `targets` (scale alpha / r, as PEFT). alpha 32 at any rank, as in "LoRA
        # without regret" (Schulman et al. 2025), and ~10x the full fine-tuning learning rate.
        lora_rank=0,
        # merged_sampling: sample with the adapters folded into the base (faster; a copy of the
        # targeted weights while sampling), else apply them per token.
        lora=dict(alpha=32.0, dropout=0.0, targets=("q", "k", "v", "o", "gate", "up", "down"),
                  merged_sampling=True)))

    # Computed once before RL with the base policy (jobs/mine.py).
    c.mining = ml_collections.ConfigDict(dict(
        train_on="all",        # GRPO's training problems: 'all' or the mined 'hard' set
        k=16,                  # hard = solved 0 of k (paper: k=128 at a 32k budget)
        prefix_samples=8,      # m samples per prefix length in the shortest-prefix search
        max_prefix_units=4,    # longest prefix tried, in oracle steps
        rows_per_call=1024, dir=""))

    c.pope = ml_collections.ConfigDict(dict(
        guidance="instruction",  # or 'solution_prefix' for policies that follow no instruction
        template="default",      # or 'no_restate' (the paper's ablation)
        # The longest prefix searched, as a fraction of the oracle solution (a published summary
        # says the authors' prefixes reach about a quarter; unconfirmed). Never the whole one.
        max_prefix_fraction=0.25,
        unsolved="drop",  # no solvable prefix within the cap: 'drop' it, or 'longest' (tried)
        guided_copies=1, unguided_copies=1, easy_per_step=0))

    c.prefixrl = ml_collections.ConfigDict(dict(
        prefixes_per_problem=3, unprefixed_copies=1, cut_lo=0.4, cut_hi=0.8,
        samples_per_round=64, max_samples=2500,
        pool_path="",     # another model's traces (id + text or tokens), verified on load
        pool_flops=0.0,   # what generating pool_path cost, when declared: charged to the run
        oracle_traces=False))  # True: oracle solutions as the traces, no rejection sampling

    # Prefix-length schedule (methods/schedules.py): fixed | annealed | adaptive.
    # The fields of the chosen kind are in the block of that name.
    c.schedule = ml_collections.ConfigDict(dict(
        kind="fixed",
        annealed=dict(steps=100, start_fraction=1.0, end_fraction=0.0, shape="linear"),
        adaptive=dict(window=16, threshold=0.5, stride=1, lengthen=False)))

    # hard_set: also evaluate on the mined training hard set, unguided (hard_set/* metrics).
    c.eval = ml_collections.ConfigDict(dict(every=25, n=16, ks=(1, 8, 16), hard_set=False))
    # metrics.jsonl and TensorBoard always; wandb=True adds Weights & Biases (rl/wandb_writer.py;
    # wandb_mode 'offline' needs no network, '' leaves it to WANDB_MODE / the logged-in default).
    # segment_rows: rows metrics.jsonl and eval_counts.jsonl (and events a TensorBoard file) hold
    # before they are sealed and the next starts, which bounds what a flush writes (GCS has no
    # append; rl/row_log.py).
    c.metrics = ml_collections.ConfigDict(dict(wandb=False, wandb_project="jaxprefix",
                                               wandb_mode="", segment_rows=1000))
    c.checkpoint = ml_collections.ConfigDict(dict(every=25, keep=3))
    # The export job's HF directory (<workdir>/export): weights in `dtype` ('' = param_dtype).
    c.export = ml_collections.ConfigDict(dict(dtype=""))
    # workers 0: the verifier's default (a process pool for math, in-process for exact match).
    # max_chars: longer completions score 0 unread, counted in reward/too_long (0: no cap).
    # path 'FILE.py:FUNCTION': score with fn(completion, problem) -> float of a Python file
    # instead of data.verifier (rewards/from_file.py), in the same worker pool and timeout.
    # max_memory_mb: the address-space cap of each verifier worker process (0: none); an answer
    # that allocates past it fails in its worker (scored 0, counted) instead of taking the host.
    c.rewards = ml_collections.ConfigDict(dict(timeout_s=10.0, workers=0, max_chars=200_000,
                                               path="", max_memory_mb=8192))
    # GCS (storage_faults.py): a transient failure (429, 5xx, a dropped connection) is retried
    # for up to retry_deadline_s seconds; then, or at a permanent one (403), the run stops in one
    # line and the same command resumes.
    c.storage = ml_collections.ConfigDict(dict(retry_deadline_s=600.0))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))
    # One run per workdir (workdir_lock.py); on gs:// a lock without heartbeat for stale_minutes
    # is taken over.
    c.workdir_lock = ml_collections.ConfigDict(dict(stale_minutes=10.0, heartbeat_s=60.0))
    # The compile job (jobs/compile.py): a TPU type (v6e-8, v5litepod-16, v5p-32), a slice count,
    # the longest context in tokens (prompt plus guidance or prefix), the HBM share kept free,
    # and optionally a config.json to use when the model path's is not readable from here.
    c.compile = ml_collections.ConfigDict(dict(topology="", slices=1, context_length=1024,
                                               headroom=0.1, model_config=""))
    c.distributed = distributed.default_config()
    c.isocompute = ml_collections.ConfigDict(dict(
        # The sweep (jobs/isocompute.py): every (n, B) at each seed, to the largest budget.
        budgets=(2**12, 2**13, 2**14), ns=(2, 4, 8, 16), batches=(8, 16), seeds=(0,), runs_dir="",
        eval_every_rollouts=1024, print_only=False,
        config_arg="",  # the --config its printed commands start from (configs/isocompute.py)
        # Learning rate of a run with R = n * B rollouts a step: train.learning_rate at
        # lr_reference_rollouts, times (R / reference)^(0 | 1/2 | 1) for constant | sqrt | linear.
        lr_rule="sqrt", lr_reference_rollouts=512,
        # An rl run allocated by the rule: budget > 0 sets n, B and M (and the lr by lr_rule) from
        # the fitted curve in frontier_path (a fit job's frontier.json; '' = the default curve).
        budget=0.0, budget_unit="rollouts", frontier_path="", batch=0, n_min=2, n_max=1024))
    return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """'demo' or 'smollm2,seed=1' -> {'variant': ..., 'seed': 1}: a config file's variant string.

    Values are parsed as int, float or bool where they look like one.
    """
    parsed = ml_collections.ConfigDict(defaults)
    for i, part in enumerate(p for p in (arg or "").split(",") if p):
        key, sep, value = part.partition("=")
        if not sep:
            if i:
                raise ValueError(f"config argument {arg!r}: only the first item may be a bare "
                                 f"variant name, got {part!r}")
            key, value = "variant", part
        parsed[key] = _literal(value)
    return parsed


def _literal(text: str):
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def sibling_config(this_file: str, name: str, arg: str = "") -> ml_collections.ConfigDict:
    """`get_config(arg)` of another file in the same configs/ folder (e.g. sft.py for pope.py)."""
    return from_file(os.path.join(os.path.dirname(os.path.abspath(this_file)), name), arg)


def from_file(path: str, arg: str = "") -> ml_collections.ConfigDict:
    """`get_config(arg)` of a config file, as `--config=path:arg` would load it."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"jaxprefix_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


# --- settings shared by the configs' variants -----------------------------------------------

def demo_task(c: ml_collections.ConfigDict, sft: ml_collections.ConfigDict) -> None:
    """The CPU demo (docs/DEMO_TASK.md): the tiny SFT policy on keyed_multiplication, POPE's
    regime: hard problems (8 digits, key rule '>') fail at the key step, the first of 9, and
    POPE searches prefixes of at most a quarter of the solution (the key step, or it and one
    more), as the paper's are.

    Recipe from the feasibility study on this kind of machine: 8 samples per problem, Adam 1e-4
    (3e-4 collapsed, 3e-5 too slow), one on-policy update per batch, temperature 1.
    """
    _tiny_policy(c, sft)
    # Easy problems (hard + easy runs, data.easy_size): rule '<' of 1..8 digits, the task's slots.
    c.data.update(source="keyed_multiplication", verifier="keyed_multiplication", digits=(8, 8),
                  multipliers=(2, 9), easy_digits=(1, 8))
    c.rollout.max_new_tokens = 27  # the key step, 8 steps of 3 tokens, <eos>
    c.mining.max_prefix_units = 2
    c.pope.max_prefix_fraction = 0.25
    c.pope.unsolved = "unguided"  # every hard problem stays in training, unguided if need be
    c.eval.update(every=10, n=16, ks=(1, 8, 16))  # every 10 steps: curves with 10 points
    c.checkpoint.every = 50


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
    c.pope.max_prefix_fraction = 1.0
    c.eval.update(every=50, n=16, ks=(1, 8, 16))
    c.checkpoint.every = 50


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
    # The untrained smoke policy solves no prefix: guide by the longest tried, so POPE still runs.
    c.pope.unsolved = "longest"
    # The smoke policy is untrained: it finds no trace, so the oracle solutions stand in.
    c.prefixrl.update(samples_per_round=4, max_samples=8, oracle_traces=True)
    c.eval.update(every=2, n=4, ks=(1, 4))
    c.checkpoint.every = 1


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


def paper(c: ml_collections.ConfigDict) -> None:
    """Paper scale on a TPU slice: Qwen3-4B-Instruct-2507 from an HF directory (paths as fields).

    The authors' settings (papers.md; unconfirmed as the paper's): lr 1e-6 cosine, grad clip 0.3,
    weight decay 0.01, no KL, 8 rollouts per prompt, advantages not divided by std.
    """
    # f32 master weights, bf16 compute: an AdamW step of 1e-6 is below bf16's resolution (a bf16
    # weight of 0.02 moves by steps of 1.2e-4), so bf16 weights would never change.
    c.model.update(source="hf", path="gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507",
                   param_dtype="float32", dtype="bfloat16", system_prompt=BOXED_ANSWER_PROMPT)
    c.data.update(source="file", path="gs://YOUR_BUCKET/hard_problems.jsonl",
                  eval_path="gs://YOUR_BUCKET/aime25.jsonl", verifier="math", train_size=0,
                  eval_size=0)
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


VARIANTS = ("demo", "smoke", "carry", "carry_smoke", "smollm2", "paper", "colab")


def method_config(config_file: str, method: str, arg: str, *, extra_variants=()):
    """(config, args) of `method` for the variant named first in `arg` (default 'demo').

    demo / smoke use the demo task, keyed_multiplication (smoke: seconds); carry / carry_smoke
    carry_multiplication (the long-guidance case); smollm2 a real model on CPU; paper a TPU
    run; colab LoRA on one free TPU chip.
    `extra_variants` are names a config file handles itself on top of one of these.
    """
    args = parse_arg(arg, variant="demo")
    known = VARIANTS + tuple(extra_variants)
    if args.variant not in known:
        raise ValueError(f"{os.path.basename(config_file)}: unknown variant {args.variant!r}; "
                         f"expected one of {known}")
    c = base_config()
    c.method = method
    if args.variant == "carry_smoke":
        smoke(c, sibling_config(config_file, "sft.py", "carry_smoke"), task=carry_task)
    elif args.variant == "smoke" or args.variant.endswith("_smoke"):
        smoke(c, sibling_config(config_file, "sft.py", "smoke"))
    elif args.variant == "carry":
        carry_task(c, sibling_config(config_file, "sft.py", "carry"))
    elif args.variant == "smollm2":
        smollm2(c)
    elif args.variant == "paper":
        paper(c)
    elif args.variant == "colab":
        colab(c)
    else:
        demo_task(c, sibling_config(config_file, "sft.py", "demo"))
    if "seed" in args:
        c.seed = args.seed
    return c, args
