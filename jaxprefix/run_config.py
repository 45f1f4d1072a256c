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

from jaxprefix import config_fields, distributed
from jaxprefix.config_fields import Field
from jaxprefix.study_fields import (PREREG_DOCS, RESULTS_DOCS, SFT_FIELDS, SFT_KEYED_DOCS,
                                    TOOL_STUDY_DOCS)


F = Field

# The blocks of every run, each field with its default and one line of what it does (the
# describe job prints them: --config.job=describe). Longer explanations are comments above.
FIELDS = {
    "job": F("rl", "sft | mine | rl | eval | sweep | fit | prereg | demo | results | export | "
                   "compile | tools | serve | describe"),
    "method": F("grpo", "grpo | pope | prefixrl"),
    "seed": F(0, "seed of the run's sampling and initialisation"),
    # Resuming refuses a change to a field that alters the run (run_identity.py) unless listed.
    "allow_changes": F("", "fields a resumed run may change, e.g. 'train.learning_rate,rollout.n'"
                           " (a block name covers its fields)"),
    # Where the policy comes from (run_setup/policy.py). param_dtype: the master copy the optimizer
    # updates; dtype: the forward/backward's and the sampler's copy of the weights.
    "model": {
        "source": F("sft", "where the policy comes from: sft (the tiny demo base) | hf | gguf"),
        "path": F("", "HF directory or GGUF file, local or gs:// ('bundled' with gguf: SmolLM2)"),
        "param_dtype": F("float32", "dtype of the trained weights and optimizer moments"),
        "dtype": F("float32", "compute dtype of forward, backward and sampling"),
        "system_prompt": F("", "system message of the chat template ('' : none)"),
        "user_template": F("{question}", "the user turn of a chat model: {question} in it"),
    },
    # The tiny base model's SFT (model.source 'sft' only): configs/sft.py's fields (SFT_FIELDS).
    "sft": {},
    # Problem sets (run_setup/problem_sets.py). Bad records and over-long prompts are refused (one
    # line naming file and line), or skipped and counted with skip_invalid.
    "data": {
        "source": F("carry_multiplication", "problems from: file | hf | tfds | reasoning_gym | "
                                            "a built-in task name"),
        "task": F("", "the reasoning_gym task (e.g. gsm_symbolic)"),
        "task_config": F("", "the reasoning_gym generator's settings: a JSON object of "
                             "create_dataset keywords ('': its defaults)"),
        "path": F("", "training problems: a JSON-lines / JSON / parquet file or directory, or "
                      "a dataset directory"),
        "eval_path": F("", "evaluation problems ('' with file: none; with hf/tfds: path's "
                           "eval_split)"),
        "split": F("train", "split of an hf or tfds dataset to train on"),
        "eval_split": F("", "split of an hf or tfds dataset to evaluate on"),
        "question_field": F("question", "record field holding the problem text"),
        "solution_field": F("solution", "record field holding a worked solution (POPE's and "
                                        "PrefixRL's oracle)"),
        "answer_field": F("answer", "record field holding the reference answer"),
        "verifier": F("math", "reward: math | math_lenient | exact | format | reasoning_gym | "
                              "a task name"),
        "train_size": F(256, "training problems used (0: all of the file)"),
        "eval_size": F(128, "evaluation problems used (0: all)"),
        "seed": F(1, "seed of the training set's order (and generation for built-in tasks)"),
        "eval_seed": F(2, "seed of the evaluation set"),
        "digits": F((20, 20), "built-in tasks: the hard problems' digit range"),
        "multipliers": F((6, 9), "built-in tasks: the multiplier range"),
        "easy_size": F(0, "built-in tasks: easy problems added (POPE's hard + easy runs)"),
        "easy_digits": F((1, 8), "built-in tasks: the easy problems' digit range"),
        "key_names_rule": F(False, "keyed_multiplication: key steps name the rule they read the "
                                   "key by (the restating route; the SFT base's notation)"),
        "key_given": F(False, "keyed_multiplication: every problem's key step given in the "
                              "prompt's hint slots (the tool study's control)"),
        "skip_invalid": F(False, "skip and count bad records instead of refusing the file"),
        "max_prompt_tokens": F(0, "refuse (or skip) longer prompts (0: the model's context less "
                                  "rollout.max_new_tokens)"),
    },
    # Sampling of training rollouts (and of mining, at the same settings). None of
    # max_rows_in_flight .. tensor_parallel changes the rollouts, only the speed.
    "rollout": {
        "n": F(8, "samples per problem (the group size)"),
        "temperature": F(1.0, "sampling temperature"),
        "top_p": F(1.0, "nucleus sampling (1: off)"),
        "top_k": F(0, "top-k sampling (0: off)"),
        "max_new_tokens": F(64, "longest completion in tokens"),
        "max_rows_in_flight": F(0, "rows decoded at once (0: as many as kv_budget_gib holds)"),
        "kv_budget_gib": F(0.0, "KV cache budget over all devices (0: accelerator memory less "
                                "memory_headroom; unbounded on CPU)"),
        "memory_headroom": F(0.16, "share of accelerator memory kept free by the KV budget"),
        "page_size": F(128, "tokens per KV page of the continuous decode"),
        "kv_reserve": F(1.0, "share of a row's pages promised at its start (< 1: more rows, the "
                             "youngest preempted when pages run out)"),
        "tensor_parallel": F(0, "devices the decode splits heads over (0: widest on TPU, the "
                                "learner's layout elsewhere)"),
        "kv_dtype": F("", "KV pages' dtype ('': compute dtype; 'int8' halves KV memory, changes"
                          " log-probs a little)"),
        "max_turns": F(1, "assistant turns of an episode (> 1: episodes with config.tools; "
                          "docs/TOOLS.md)"),
        # Sampler and learner on disjoint devices (docs/OVERLAP.md): with train.max_staleness > 0
        # they run at once, new weights copied to the sampler's devices after each update.
        "devices": F(0, "devices the sampler holds, the learner the rest (0: all, time-shared)"),
        "inflight_kv": F("", "new weights into a running decode, with train.max_staleness > 0 "
                             "('': a step decodes with one version; 'keep' / 'recompute': the "
                             "next chunk takes the newest, the KV written so far kept / computed "
                             "again by it)"),
        "partial_tokens": F(0, "partial rollouts (rl/partial.py): tokens a row samples a round; "
                               "a group not ended is carried into the next step (0: off)"),
    },
    # Multi-turn episodes (docs/TOOLS.md), read where rollout.max_turns > 1 and refused where it
    # is 1. The verifier scores an episode's last turn; observation tokens carry no loss.
    "tools": {
        "names": F((), "tools the policy may call: calculator | read_key | python (opt-in) | "
                       "'FILE.py:FUNCTION'"),
        "environment": F("chat", "how turns meet tools: chat (the chat template's call format "
                                 "and tool turn) | keyed_multiplication | 'FILE.py:NAME'"),
        "format": F("", "chat's call format ('': the template's; hermes | llama3)"),
        "episode_token_budget": F(0, "tokens an episode may hold, prompt and observations "
                                     "included (0: the model's context)"),
        "max_observation_chars": F(2000, "an observation's cap in characters (cut, marked)"),
        "workers": F(1, "a turn's tool calls run at once (threads; python's are processes)"),
        "rollout": F("kv_kept", "the episode rollout: kv_kept (one in-graph decode, every "
                                "turn's KV kept) or reference (one generate() per turn, the "
                                "conversation re-prefilled; the same episodes)"),
        # Model-written code in a fresh sandbox per call, capped (docs/TOOLS.md, "The sandbox").
        "python": {
            "enabled": F(False, "allow the python tool (runs model-written code; opt-in)"),
            "cpu_s": F(2, "a call's CPU seconds"),
            "memory_mb": F(512, "a call's address space in MiB"),
            "wall_s": F(5.0, "a call's wall-clock seconds (then all its processes are killed)"),
            "output_bytes": F(16384, "a call's stdout and stderr, in bytes"),
            "processes": F(32, "a call's processes and threads at once (the sandbox's cap)"),
            "isolation": F("sandbox", "sandbox (bubblewrap: no network, read-only filesystem, "
                                      "own pids; refused where none starts) | "
                                      "capped_subprocess (the caps alone, no sandbox)"),
            "bwrap": F("bwrap", "the bubblewrap binary the sandbox runs (a name on PATH or a "
                                "path)"),
        },
    },
    # An external environment the rl job's rollouts run in (docs/TOOLS.md, "Environments of
    # other frameworks"): each round serves the current policy on 127.0.0.1 (serving/live.py)
    # and the environment runs n episodes of each problem against it over the OpenAI API.
    "environment": {
        "source": F("", "'FILE.py:NAME': NAME(tokenizer) returns the environment (an object with "
                        "async run_episode(client, model, problem, sampling_args)); '': the "
                        "run's own sampler and verifier"),
        "max_concurrent": F(0, "episodes in flight at once (0: every episode of a round)"),
        "max_batch_rows": F(64, "sample rows one sampler call of the live server takes at most"),
        "timeout_s": F(600.0, "seconds one request to the live server may take"),
        "episode_timeout_s": F(3600.0, "seconds one episode may take before the run stops (a "
                                       "hung environment)"),
    },
    # The learner (rl/train_step.py TrainConfig fields) and the loop.
    "train": {
        "problems_per_step": F(32, "problems (contexts) sampled per RL step"),
        "total_steps": F(100, "RL steps"),
        "advantage": F("grpo", "grpo | dr_grpo | rloo | pass_at_k"),
        "dynamic_sampling": F(False, "DAPO: drop zero-variance groups and refill"),
        "max_refill_rounds": F(2, "dynamic sampling's refill rounds per step"),
        "learning_rate": F(1e-4, "peak learning rate (AdamW)"),
        "schedule": F("constant", "learning-rate schedule: constant | cosine"),
        "warmup_steps": F(0, "linear warmup steps"),
        "decay_steps": F(1000, "steps of the schedule's decay"),
        "min_lr_ratio": F(0.0, "final learning rate as a share of the peak"),
        "b1": F(0.9, "Adam beta1"),
        "b2": F(0.999, "Adam beta2"),
        "adam_eps": F(1e-8, "Adam epsilon"),
        "weight_decay": F(0.0, "AdamW weight decay"),
        "max_grad_norm": F(1.0, "gradient clipping by global norm (0: off)"),
        "num_minibatches": F(1, "optimizer updates per step's batch"),
        "num_epochs": F(1, "passes over each step's batch"),
        "micro_batch_size": F(0, "rows per gradient-accumulation micro-batch (0: all at once)"),
        "eps_low": F(0.2, "PPO clip below 1"),
        "eps_high": F(0.2, "PPO clip above 1 (DAPO clip-higher: 0.28)"),
        "ratio": F("token", "importance ratio per token, or per sequence (GSPO)"),
        "aggregation": F("token_mean", "token_mean | seq_mean_token_mean | seq_mean_token_sum_norm"),
        "max_len": F(0, "seq_mean_token_sum_norm's normaliser (0: the batch width)"),
        "kl_coef": F(0.0, "KL penalty to the reference policy (0: off, no reference kept)"),
        "kl_kind": F("k3", "KL estimator: k1 | k3"),
        "logprob_chunk": F(1024, "tokens per chunk of the log-prob computation (no [B, T, V] "
                                 "logits)"),
        "mask_truncated": F(False, "exclude completions cut at max_new_tokens from the loss"),
        "remat": F(False, "recompute each layer in the backward pass (large models)"),
        "skip_zero_advantage": F(True, "skip micro-batches whose every row has advantage 0 (the "
                                       "same gradient; only without KL, entropy or router "
                                       "losses)"),
        "width_steps": F(1, "micro-batches sorted by length, each cut to the shortest of this "
                            "many steps of the batch width that holds it (1: full width)"),
        "pack_rows": F(False, "pack each minibatch's rows one after another into rows of the "
                              "batch width and skip the micro-batches left empty (the same "
                              "gradient; ratio 'token', no seq_mean_token_mean)"),
        # tis_cap > 0 (with 'learner'): each token's policy-gradient term times
        # min(pi_old / pi_sampler, tis_cap) (verl's TIS).
        "old_logprobs": F("sampler", "pi_old of the ratio: 'sampler' (rollouts' log-probs) or "
                                     "'learner' (recomputed)"),
        "tis_cap": F(0.0, "truncated importance sampling cap (with old_logprobs='learner'; 0: "
                          "off)"),
        # IcePop: a token whose pi_old / pi_sampler leaves [1/c, c] gets no gradient.
        "ratio_mask": F(0.0, "mask tokens whose pi_old / pi_sampler leaves [1/c, c] (with "
                             "old_logprobs='learner'; 0: off)"),
        # Off-policy steps (docs/OVERLAP.md): step t trains on rollouts sampled with the weights
        # of max(0, t - max_staleness) updates, sampled while the learner works.
        "max_staleness": F(0, "updates the sampler may run ahead of the learner (0: "
                              "synchronous)"),
        # The overlapped loop's watchdog (docs/OVERLAP.md): no wait between its two threads is
        # open-ended, so a stuck side stops the run in one line instead of hanging it.
        "wait_timeout_s": F(1800.0, "seconds the learner waits for a step's rollouts and the "
                                    "sampler for new weights before the run stops (with "
                                    "max_staleness > 0)"),
        # A mixture of experts (docs/ARCHITECTURE.md, routing replay): the sampler records each
        # token's experts and the learner's forwards (old log-probs, ratio, loss) use them, gate
        # weights from the current router over them. auto: on for a MoE; a dense model refuses
        # any other value. router_aux_coef: the Switch / Qwen3-MoE load-balancing loss.
        "routing_replay": F("auto", "replay the sampler's experts in the learner: auto (on for "
                                    "a mixture of experts) | on | off"),
        "router_aux_coef": F(0.0, "a MoE's router load-balancing loss coefficient (0: off)"),
        "logprobs_at_sampling_temperature": F(True, "score softmax(logits / temperature) (TRL, "
                                                    "verl, Tunix); False: T = 1"),
        "entropy_coef": F(0.0, "> 0: entropy bonus"),
        "pass_k": F(4, "the k of advantage='pass_at_k' (Pass@k Training)"),
        "flops_budget": F(0.0, "> 0: stop before a step would pass this many RL FLOPs"),
        # LoRA (models/lora.py): scale alpha / r as PEFT; alpha 32 at any rank and ~10x the full
        # fine-tuning learning rate, as in "LoRA without regret" (Schulman et al. 2025).
        "lora_rank": F(0, "0: train every weight; r > 0: only LoRA adapters of rank r"),
        "lora": {
            "alpha": F(32.0, "LoRA scale numerator (scale alpha / rank)"),
            "dropout": F(0.0, "LoRA dropout"),
            "targets": F(("q", "k", "v", "o", "gate", "up", "down"), "projections given "
                                                                     "adapters"),
            "merged_sampling": F(True, "sample with adapters folded into the base (faster), "
                                       "else per token"),
        },
    },
    # Computed once before RL with the base policy (run_setup/mining.py).
    "mining": {
        "train_on": F("all", "GRPO's training problems: 'all' or the mined 'hard' set"),
        "k": F(16, "samples per problem; hard = solved 0 of k (paper: 128 at a 32k budget)"),
        "prefix_samples": F(8, "samples per prefix length in the shortest-prefix search"),
        "max_prefix_units": F(4, "longest prefix tried, in oracle steps"),
        "rows_per_call": F(1024, "rows per sampler call while mining"),
        "dir": F("", "where mining results are kept ('': <workdir>/mining)"),
    },
    "pope": {
        "guidance": F("instruction", "'instruction', or 'solution_prefix' for policies that "
                                     "follow no instruction"),
        "template": F("default", "guided prompt: 'default' or 'no_restate' (the paper's "
                                 "ablation)"),
        # A published summary says the authors' prefixes reach about a quarter (unconfirmed).
        "max_prefix_fraction": F(0.25, "longest prefix searched, as a share of the oracle "
                                       "solution (never all of it)"),
        "unsolved": F("drop", "hard problems with no solvable prefix in the cap: drop | longest "
                              "| unguided"),
        "guided_copies": F(1, "guided contexts per hard problem a step"),
        "unguided_copies": F(1, "unguided contexts per hard problem a step"),
        "easy_per_step": F(0, "easy problems mixed in per step (with data.easy_size)"),
    },
    "prefixrl": {
        "prefixes_per_problem": F(3, "prefixed contexts per problem"),
        "unprefixed_copies": F(1, "unprefixed contexts per problem"),
        "cut_lo": F(0.4, "shortest cut point, as a share of the trace"),
        "cut_hi": F(0.8, "longest cut point, as a share of the trace"),
        "samples_per_round": F(64, "rejection-sampling samples per round"),
        "max_samples": F(2500, "rejection-sampling samples per problem at most"),
        "pool_path": F("", "another model's traces (id + text or tokens), verified on load"),
        "pool_flops": F(0.0, "what generating pool_path cost, when declared: charged to the run"),
        "oracle_traces": F(False, "oracle solutions as the traces, no rejection sampling"),
    },
    # Prefix-length schedule (methods/prefix_schedules.py); the chosen kind's fields are its block.
    "schedule": {
        "kind": F("fixed", "prefix-length schedule: fixed | annealed | adaptive"),
        "annealed": {
            "steps": F(100, "steps from start_fraction to end_fraction"),
            "start_fraction": F(1.0, "prefix share of the cap at the start"),
            "end_fraction": F(0.0, "prefix share of the cap at the end"),
            "shape": F("linear", "linear | cosine"),
        },
        "adaptive": {
            "window": F(16, "recent guided attempts per problem considered"),
            "threshold": F(0.5, "guided success rate that shortens the prefix"),
            "stride": F(1, "prefix units moved at a time"),
            "lengthen": F(False, "also lengthen a prefix that stops being solved"),
        },
    },
    "eval": {
        "every": F(25, "steps between evaluations (unguided, on the eval set)"),
        "n": F(16, "samples per evaluation problem"),
        "ks": F((1, 8, 16), "the k of pass@k reported"),
        "before_train": F(False, "also evaluate before the first step (step 0)"),
        "greedy": F(False, "also evaluate greedily, one sample a problem (<set>_greedy/*)"),
        "hard_set": F(False, "also evaluate on the mined training hard set (hard_set/*)"),
        "key_step_probe": F(False, "built-in tasks: also log the teacher-forced key-step probe "
                                   "of the eval set (probe/*: eps, the rule's name, its read, "
                                   "success given the key; jaxprefix/key_step_probe.py)"),
    },
    # metrics.jsonl and TensorBoard always (rl/metrics.py, rl/row_log.py: GCS has no append).
    "metrics": {
        "wandb": F(False, "also log to Weights & Biases (rl/wandb_writer.py)"),
        "wandb_project": F("jaxprefix", "the W&B project"),
        "wandb_mode": F("", "W&B mode: 'offline' needs no network ('': WANDB_MODE / default)"),
        "segment_rows": F(1000, "rows a metrics file holds before it is sealed and the next "
                                "starts"),
    },
    "checkpoint": {
        "every": F(25, "steps between checkpoints"),
        "keep": F(3, "checkpoints kept"),
    },
    "export": {"dtype": F("", "the export job's HF weights dtype ('': param_dtype)"),
               "step": F(0, "the checkpoint step exported (0: the latest)")},
    # The OpenAI-compatible server (jobs/serve.py, docs/SERVING.md) over the policy of `model`;
    # the sampler's memory settings (rows in flight, KV budget, pages) are rollout's.
    "serve": {
        "host": F("127.0.0.1", "address the server listens on"),
        "port": F(8000, "port the server listens on"),
        "model_name": F("", "the model name clients ask for ('': model.path's file name)"),
        "max_batch_rows": F(64, "sample rows one sampler call takes at most (more wait)"),
        "batch_window_ms": F(10.0, "how long a request waits for others to share its call"),
        "max_context": F(0, "prompt plus max_tokens a request may ask for (0: the model's)"),
        "max_tokens": F(1024, "most new tokens a request may ask for; its default too"),
        "max_top_logprobs": F(20, "most alternatives a request's logprobs may list"),
        "api_key": F("", "the key requests must send as 'Authorization: Bearer KEY' ('': "
                         "$JAXPREFIX_API_KEY, else none; needed off the loopback)"),
        "max_body_bytes": F(8 * 2**20, "largest request body, in bytes (larger: a 413)"),
        "max_in_flight": F(256, "requests in flight at once, streams until their end (more: "
                                "a 429; 0: no cap)"),
        "stream_chunk_tokens": F(16, "decode steps a call with a stream takes between handing "
                                     "out the tokens drawn"),
    },
    # Verifiers (rewards/): in worker processes with timeouts.
    "rewards": {
        "timeout_s": F(10.0, "seconds a verifier may take per completion"),
        "workers": F(0, "verifier worker processes (0: the verifier's default)"),
        "max_chars": F(200_000, "longer completions score 0 unread (reward/too_long; 0: no "
                                "cap)"),
        "path": F("", "'FILE.py:FUNCTION' scoring fn(completion, problem) -> float instead of "
                      "data.verifier"),
        "max_memory_mb": F(8192, "address-space cap of each verifier worker (0: none)"),
    },
    # GCS (storage/faults.py): then, or at a permanent failure (403), one line; rerun resumes.
    "storage": {"retry_deadline_s": F(600.0, "seconds a transient GCS failure is retried")},
    "mesh": {
        "data": F(-1, "data-parallel mesh axis (-1: the devices left)"),
        "fsdp": F(1, "fully-sharded mesh axis (-1: the devices left)"),
        "tensor": F(1, "tensor-parallel mesh axis"),
    },
    # One run per workdir (storage/workdir_lock.py).
    "workdir_lock": {
        "stale_minutes": F(10.0, "a gs:// lock without heartbeat this long is taken over"),
        "heartbeat_s": F(60.0, "seconds between the lock's heartbeats"),
    },
    # The compile job (jobs/compile.py): does a run fit a TPU slice, compiled from this machine.
    "compile": {
        "topology": F("", "TPU slice type: v6e-8, v5litepod-16, v5p-32, ..."),
        "slices": F(1, "slices (multi-slice over DCN)"),
        "context_length": F(1024, "longest context in tokens (prompt plus guidance or prefix)"),
        "headroom": F(0.1, "share of HBM kept free"),
        "model_config": F("", "a config.json to use when the model path's is not readable "
                              "from here"),
        "search_split": F(False, "also cost each power-of-two rollout.devices and report the "
                                 "fastest pipelined split"),
    },
    "distributed": distributed.FIELDS,
    "isocompute": {
        # The sweep (jobs/isocompute.py; its points: run_setup/sweep_points.py): every (n, B)
        # at each seed, to the largest budget.
        "budgets": F((2**12, 2**13, 2**14), "the sweep's compute budgets (isocompute.budget_unit)"),
        "ns": F((2, 4, 8, 16), "the sweep's samples per problem"),
        "batches": F((8, 16), "the sweep's problems per step"),
        "seeds": F((0,), "the sweep's seeds"),
        "runs_dir": F("", "where the sweep's runs go ('': under the workdir)"),
        "eval_every_rollouts": F(1024, "rollouts between a sweep run's evaluations"),
        "print_only": F(False, "print the sweep's commands instead of running them"),
        "config_arg": F("", "the --config its printed commands start from"),
        # A run with R = n * B rollouts a step: train.learning_rate at lr_reference_rollouts,
        # times (R / reference)^(0 | 1/2 | 1) for constant | sqrt | linear.
        "lr_rule": F("sqrt", "learning rate vs rollouts a step: constant | sqrt | linear"),
        "lr_reference_rollouts": F(512, "rollouts a step at which train.learning_rate holds"),
        # An rl run allocated by the rule: n, B, M (and the lr by lr_rule) from a fitted curve.
        "budget": F(0.0, "> 0: set n, B and M from the fitted frontier for this budget"),
        "budget_unit": F("rollouts", "unit of budget and budgets: rollouts | flops"),
        "frontier_path": F("", "a fit job's frontier.json ('': the default curve)"),
        "batch": F(0, "problems per step of an allocated run (0: the rule's)"),
        "n_min": F(2, "smallest n an allocation may pick"),
        "n_max": F(1024, "largest n an allocation may pick"),
    },
}

SFT_DOCS = {**config_fields.docs(SFT_FIELDS), **SFT_KEYED_DOCS}
DOCS = {**config_fields.docs(FIELDS), **{f"sft.{k}": v for k, v in SFT_DOCS.items()},
        **{f"results.{k}": v for k, v in RESULTS_DOCS.items()},
        **{f"isocompute.prereg.{k}": v for k, v in PREREG_DOCS.items()},
        **{f"tool_study.{k}": v for k, v in TOOL_STUDY_DOCS.items()}}


def base_config() -> ml_collections.ConfigDict:
    return config_fields.build(FIELDS)


def sft_base_config() -> ml_collections.ConfigDict:
    return config_fields.build(SFT_FIELDS)


def field_docs(config) -> dict[str, str]:
    """`dotted.name -> doc` of a config: an RL-side config, or configs/sft.py's own."""
    if "method" in config:
        return DOCS
    return SFT_DOCS


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


def parse_variant(arg: str | None, config_file: str, variants, default: str):
    """parse_arg(arg) with its variant (default `default`) checked to be one of `variants`."""
    args = parse_arg(arg, variant=default)
    if args.variant not in variants:
        raise ValueError(f"{os.path.basename(config_file)}: unknown variant {args.variant!r}; "
                         f"expected one of {tuple(variants)}")
    return args


def _literal(text: str):
    if text in ("True", "False", "true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def from_file(path: str, arg: str = "") -> ml_collections.ConfigDict:
    """`get_config(arg)` of a config file, as `--config=path:arg` would load it."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f"jaxprefix_config_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)
