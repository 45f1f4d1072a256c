"""Capacity plan: memory, FLOPs and the smallest TPU slice for one RL step of a model and run shape.

    python launch/capacity_plan.py --preset=pope
    python launch/capacity_plan.py --config=configs/pope.py:paper --model=qwen3-4b
    python launch/capacity_plan.py --model=/path/to/hf_dir --n=16 --problems=32 \
        --prompt_len=1024 --response_len=4096

Memory is counted per component and spread evenly over the chips (FSDP for parameters and
optimizer state, data parallelism for the KV cache and activations). One RL step holds the
training state throughout (master weights, gradients and AdamW moments, all in param_dtype);
sampling adds the KV cache of every rollout of the step (the sampler decodes the whole batch in
one call, prompts shared per context) and, when the compute dtype differs, the sampler's copy of
the weights in it; training adds the activations of one micro-batch per chip. FLOPs use ModelConfig.flops_per_token (2N per token plus attention
against the context), forward only for sampling and x3 (x4 with remat) for the update.
A slice fits when every chip's share is within HEADROOM of its HBM: XLA temporaries,
fragmentation and compiled programs take the rest.

This is a first look by formula, for every generation at once and in a second. It gives way to
the compile job (jobs/compile.py; `launch/tpu.sh check --type=v6e-8 --config=...`), which
compiles the run's actual programs for a slice with the TPU compiler and reads their memory and
cost back: where the two disagree, the compile job is right. Chip figures come from the same
table (jaxprefix/tpu/topology.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxprefix import storage  # noqa: E402
from jaxprefix.models import published  # noqa: E402
from jaxprefix.models.config import ModelConfig  # noqa: E402
from jaxprefix.sampling.budget import page_bytes_per_token  # noqa: E402
from jaxprefix.tpu import costing  # noqa: E402
from jaxprefix.tpu.topology import CHIPS, Chip  # noqa: E402

GiB = 2**30
HEADROOM = 0.85
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Qwen3-4B's published config.json (the fields the plan needs).
QWEN3_4B = dict(model_type="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1_000_000)
SMOLLM2_135M = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    tie_word_embeddings=True, rope_theta=100_000)
MODELS = {"qwen3-4b": QWEN3_4B, "smollm2-135m": SMOLLM2_135M}


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """A TPU generation under gcloud's type name; its chip's figures (cited there) from
    jaxprefix.tpu.topology."""
    name: str
    chip: Chip

    @property
    def hbm_gib(self) -> float:
        return self.chip.hbm_bytes / GiB

    @property
    def sizes(self) -> tuple[int, ...]:  # chip counts of the slice shapes on offer
        return tuple(sorted(self.chip.shapes))

    def slice_name(self, chips: int) -> str:  # v5p slice names count TensorCores (2 per chip)
        return f"{self.name}-{chips * self.chip.cores_per_chip}"

    def hosts(self, chips: int) -> int:
        return 1 if chips <= self.chip.single_host_chips else chips // self.chip.chips_per_host


ACCELERATORS = tuple(Accelerator(name, CHIPS[generation]) for name, generation in
                     (("v5litepod", "v5e"), ("v6e", "v6e"), ("v5p", "v5p")))


@dataclasses.dataclass(frozen=True)
class RunShape:
    """One RL step: `problems` contexts, `n` rollouts each, lengths in tokens."""
    n: int = 8
    problems: int = 64
    prompt_len: int = 1024           # question plus any guidance / prefix tokens
    response_len: int = 16384
    param_dtype: str = "float32"      # master weights; the gradients and AdamW moments follow it
    compute_dtype: str = "bfloat16"   # forward/backward, the sampler's copy of the weights
    kv_dtype: str = "bfloat16"
    micro_batch: int = 1              # training sequences per chip per micro-step
    remat: bool = True
    reference_model: bool = False     # a frozen copy for the KL penalty
    # Scores [heads, T, T] materialised per layer: what the learner did before its attention
    # became blockwise (CPU/GPU) and splash (TPU); kept to show what that cost.
    full_attention_scores: bool = False

    def __post_init__(self):
        for field in ("n", "problems", "prompt_len", "response_len", "micro_batch"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field}={getattr(self, field)}: expected >= 1")
        for field in ("param_dtype", "compute_dtype", "kv_dtype"):
            if getattr(self, field) not in BYTES:
                raise ValueError(f"{field}={getattr(self, field)!r}: expected one of {sorted(BYTES)}")

    @property
    def rollouts(self) -> int:
        return self.n * self.problems


PRESETS = {  # the paper-scale settings; prompt lengths include guidance or prefix tokens
    "pope": ("qwen3-4b", RunShape(n=8, problems=64, prompt_len=2048, response_len=16384)),
    "prefixrl": ("qwen3-4b", RunShape(n=8, problems=128, prompt_len=8192, response_len=16384)),
    "isocompute-n8": ("qwen3-4b", RunShape(n=8, problems=512, prompt_len=1024, response_len=8192)),
    "isocompute-n64": ("qwen3-4b", RunShape(n=64, problems=64, prompt_len=1024, response_len=8192)),
    "isocompute-n512": ("qwen3-4b", RunShape(n=512, problems=8, prompt_len=1024, response_len=8192)),
    "smoke": ("smollm2-135m", RunShape(n=4, problems=8, prompt_len=256, response_len=256,
                                       compute_dtype="float32")),
}


def bytes_per_param(run: RunShape) -> dict[str, int]:
    """Bytes per parameter of each copy of the weights a step holds (docs/SCALING.md's table)."""
    p, c = BYTES[run.param_dtype], BYTES[run.compute_dtype]
    return {"params": p, "gradients": p, "AdamW mu + nu": 2 * p,
            "sampler copy": c if run.param_dtype != run.compute_dtype else 0,
            "reference params": p * run.reference_model}  # the KL reference: initial weights


def memory(config: ModelConfig, run: RunShape) -> dict[str, float]:
    """Bytes of each component of one RL step, summed over the whole slice."""
    n_params = config.num_params()
    per_param = bytes_per_param(run)
    kv_per_token = page_bytes_per_token(config, run.kv_dtype)
    seq = run.prompt_len + run.response_len
    d, f = config.hidden_size, config.intermediate_size
    # Remat keeps each layer's input; one layer at a time holds its full working set in f32.
    residuals = config.num_layers * seq * d * BYTES[run.compute_dtype] if run.remat else 0
    layer = seq * (4 * d + 3 * f + 2 * config.num_heads * config.head_dim) * 4
    if not run.remat:
        layer *= config.num_layers
    scores = config.num_heads * seq * seq * 4 if run.full_attention_scores else 0
    return {
        "params": n_params * per_param["params"],
        "reference params": n_params * per_param["reference params"],
        "gradients": n_params * per_param["gradients"],
        "optimizer (AdamW mu, nu)": n_params * per_param["AdamW mu + nu"],
        "sampler copy (compute dtype)": n_params * per_param["sampler copy"],
        # Shared prompts: each context's KV once, each rollout's completion KV on its own.
        "KV cache (sampling)": kv_per_token * (run.problems * run.prompt_len
                                               + run.rollouts * run.response_len),
        "activations per chip (training)": run.micro_batch * (residuals + layer + scores),
    }


def flops(config: ModelConfig, run: RunShape) -> dict[str, float]:
    """FLOPs of one step: sampling (prefill + decode) and the update (forward + backward)."""
    p, r = run.prompt_len, run.response_len
    prefill = run.problems * p * config.flops_per_token(p // 2)
    decode = run.rollouts * r * config.flops_per_token(p + r // 2)
    passes = 3 + run.remat + run.reference_model / 3  # fwd + bwd (2x) + remat's second forward
    update = run.rollouts * (p + r) * config.flops_per_token((p + r) // 2) * passes
    n = config.num_params(embeddings=False) + config.vocab_size * config.hidden_size
    return {"sampling": prefill + decode, "update": update,
            "sampling (2ND)": 2 * n * (run.problems * p + run.rollouts * r),
            "update (6ND)": 6 * n * run.rollouts * (p + r)}


STATE = ("params", "reference params", "gradients", "optimizer (AdamW mu, nu)")
KV, ACTIVATIONS = "KV cache (sampling)", "activations per chip (training)"
SAMPLER_COPY = "sampler copy (compute dtype)"


def per_chip_bytes(mem: dict[str, float], chips: int, *, with_kv: bool = True) -> float:
    """Peak bytes on one chip: the training state always; then either sampling (the step's KV
    cache and the sampler's copy of the weights) or one micro-batch of activations (training),
    never both at once."""
    state = sum(mem[k] for k in STATE) / chips
    sampling = (mem[KV] if with_kv else 0.0) + mem.get(SAMPLER_COPY, 0.0)
    return state + max(sampling / chips, mem[ACTIVATIONS])


def smallest_slice(mem: dict[str, float], accel: Accelerator, *, with_kv: bool = True):
    """Fewest chips on which every chip's share fits in HEADROOM of its HBM (None: none)."""
    for chips in accel.sizes:
        if per_chip_bytes(mem, chips, with_kv=with_kv) <= HEADROOM * accel.hbm_gib * GiB:
            return chips
    return None


def rollouts_per_wave(mem: dict[str, float], run: RunShape, accel: Accelerator, chips: int) -> int:
    """Rollouts whose KV fits at once on `chips` next to the training state."""
    free = (chips * HEADROOM * accel.hbm_gib * GiB - sum(mem[k] for k in STATE)
            - mem.get(SAMPLER_COPY, 0.0))
    per_rollout = mem[KV] / run.rollouts  # its completion plus its share of the prompt
    return max(0, min(run.rollouts, int(free // per_rollout)))


def plan(hf_config: dict, run: RunShape) -> dict:
    """Everything the report prints, as plain numbers (bytes, FLOPs, chips)."""
    config = ModelConfig.from_hf(hf_config, param_dtype=run.param_dtype, dtype=run.compute_dtype)
    mem, fl = memory(config, run), flops(config, run)
    slices = {}
    for accel in ACCELERATORS:
        row = dict(train_only=None, whole_step=None)
        train_chips = smallest_slice(mem, accel, with_kv=False)
        if train_chips is not None:
            row["train_only"] = dict(slice=accel.slice_name(train_chips), chips=train_chips,
                                     hosts=accel.hosts(train_chips),
                                     rollouts_per_wave=rollouts_per_wave(mem, run, accel, train_chips))
        chips = smallest_slice(mem, accel)
        if chips is not None:
            # Decode is bandwidth-bound: each step, every chip reads all the weights (data-parallel
            # decode) and, on average, half of its share of the KV cache.
            weights = mem[SAMPLER_COPY] or mem["params"]  # what the sampler reads
            decode_s = costing.hbm_seconds(run.response_len * (weights + mem[KV] / 2 / chips),
                                           accel.chip)
            row["whole_step"] = dict(
                slice=accel.slice_name(chips), chips=chips, hosts=accel.hosts(chips),
                per_chip_gib=per_chip_bytes(mem, chips) / GiB,
                update_s_at_40pct_mfu=costing.compute_seconds(fl["update"], chips, accel.chip,
                                                              utilization=0.4),
                sampling_s_at_40pct_mfu=costing.compute_seconds(fl["sampling"], chips, accel.chip,
                                                                utilization=0.4),
                decode_s_bandwidth_bound=decode_s)
        slices[accel.name] = row
    return dict(params=config.num_params(), memory=mem, flops=fl, slices=slices)


def report(name: str, hf_config: dict, run: RunShape) -> str:
    result = plan(hf_config, run)
    per_param = bytes_per_param(run)
    lines = [f"## {name}", "",
             f"{hf_config.get('model_type')} {result['params'] / 1e9:.2f}B params; "
             f"n={run.n} x {run.problems} problems = {run.rollouts} rollouts, prompt "
             f"{run.prompt_len} + response {run.response_len} tokens; master weights, gradients "
             f"and AdamW state {run.param_dtype}, compute {run.compute_dtype}, KV {run.kv_dtype}, "
             f"micro-batch {run.micro_batch}/chip, remat {run.remat}, full attention scores "
             f"{run.full_attention_scores}",
             "", "Bytes per parameter: " + " + ".join(
                 f"{k} {v}" for k, v in per_param.items() if v) + f" = {sum(per_param.values())}",
             "", "| memory (whole slice) | GiB |", "|---|---:|"]
    lines += [f"| {k} | {v / GiB:,.1f} |" for k, v in result["memory"].items() if v]
    lines += ["", "| FLOPs per step | with attention | 2ND / 6ND |", "|---|---:|---:|",
              f"| sampling | {result['flops']['sampling']:.3g} | "
              f"{result['flops']['sampling (2ND)']:.3g} |",
              f"| update | {result['flops']['update']:.3g} | {result['flops']['update (6ND)']:.3g} |",
              "", "| generation | whole step at once | hosts | GiB/chip | update s | sampling s "
              "| decode s (HBM) | training only | rollouts per wave there |",
              "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for accel in ACCELERATORS:
        row = result["slices"][accel.name]
        largest = f"none up to {accel.slice_name(accel.sizes[-1])}"
        whole, train = row["whole_step"], row["train_only"]
        cells = [accel.name]
        cells += ([whole["slice"], whole["hosts"], f"{whole['per_chip_gib']:.1f}",
                   f"{whole['update_s_at_40pct_mfu']:,.0f}",
                   f"{whole['sampling_s_at_40pct_mfu']:,.0f}",
                   f"{whole['decode_s_bandwidth_bound']:,.0f}"] if whole
                  else [largest, "", "", "", "", ""])
        cells += [train["slice"], train["rollouts_per_wave"]] if train else [largest, ""]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "Times are lower bounds for one step on the whole-step slice: FLOPs at 40% of "
              "peak bf16, decode at full HBM bandwidth. Before renting, compile the run for the "
              "slice: launch/tpu.sh check --type=<slice> --config=<config> (the compile job)."]
    return "\n".join(lines)


def load_hf_config(model: str) -> dict:
    """A named model's config (one of MODELS or a shipped published one), or an HF directory's
    (or config.json's), local or on gs://."""
    if model in MODELS:
        return MODELS[model]
    if "/" not in model and published.hf_config(model):
        return published.hf_config(model)
    path = storage.join(model, "config.json") if storage.isdir(model) else model
    if not storage.isfile(path):
        raise SystemExit(f"--model={model!r}: expected one of {sorted(MODELS)}, an HF model "
                         "directory or a config.json path (local or gs://)")
    return storage.read_json(path)


def from_run_config(spec: str, run: RunShape) -> tuple[str | None, RunShape]:
    """(model, run shape) read from a jaxprefix config 'configs/x.py[:variant]' (base_config fields).

    The model is known when the config names one this script can read: the bundled SmolLM2 GGUF,
    an HF model on gs:// named as a shipped config.json is (models/published.py: read offline, so
    a placeholder bucket works too), or an HF directory, local or on gs://.
    """
    import importlib.util
    path, _, arg = spec.partition(":")
    if not os.path.isfile(path):
        raise SystemExit(f"--config={spec!r}: no such file {path!r}")
    module_spec = importlib.util.spec_from_file_location("capacity_plan_config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    c = module.get_config(arg)
    run = dataclasses.replace(
        run, n=c.rollout.n, problems=c.train.problems_per_step,
        response_len=c.rollout.max_new_tokens, param_dtype=c.model.param_dtype,
        compute_dtype=c.model.dtype, kv_dtype=c.model.dtype, reference_model=c.train.kl_coef > 0)
    model = None
    if c.model.source == "gguf" and c.model.path == "bundled":
        model = "smollm2-135m"
    elif c.model.source == "hf" and storage.is_remote(c.model.path) \
            and published.hf_config(c.model.path):
        model = c.model.path.rstrip("/").rsplit("/", 1)[-1]
    elif c.model.source == "hf" and storage.isdir(c.model.path):
        model = c.model.path
    return model, run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), help="paper-scale settings")
    parser.add_argument("--config", help="a jaxprefix config, configs/x.py[:variant]: n, problems "
                        "per step, response length, dtype (flags below still override)")
    parser.add_argument("--model", help=f"{sorted(MODELS)}, an HF directory or config.json")
    for field in dataclasses.fields(RunShape):
        if field.type == "bool":
            parser.add_argument(f"--{field.name}", type=lambda s: s.lower() in ("1", "true", "yes"))
        else:
            parser.add_argument(f"--{field.name}", type=int if field.type == "int" else str)
    args = parser.parse_args(argv)
    model, run = PRESETS[args.preset] if args.preset else ("qwen3-4b", RunShape())
    name = args.preset or args.config
    if args.config:
        model, run = from_run_config(args.config, run)
        if not (model or args.model):
            raise SystemExit(f"--config={args.config}: its model is not readable from here; "
                             f"pass --model (one of {sorted(MODELS)}, an HF directory or config.json)")
    model = args.model or model
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunShape)
               if getattr(args, f.name) is not None}
    try:
        run = dataclasses.replace(run, **changes)
    except ValueError as e:
        raise SystemExit(f"capacity_plan: {e}") from None
    print(report(name or model, load_hf_config(model), run))


if __name__ == "__main__":
    main()
