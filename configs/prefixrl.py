"""PrefixRL: on-policy RL on continuations of prefixes of successful, rejection-sampled traces.

    python -m jaxprefix.main --config=configs/prefixrl.py --workdir=/tmp/prefixrl    # demo task, CPU
    python -m jaxprefix.main --config=configs/prefixrl.py:smoke --workdir=/tmp/prefixrl_smoke
    python -m jaxprefix.main --config=configs/prefixrl.py:smollm2 --workdir=/tmp/prefixrl_smollm2
    python -m jaxprefix.main --config=configs/prefixrl.py:paper --workdir=gs://BUCKET/prefixrl

The trace pool is mined once (mining/trace_pool.jsonl) and its sampling compute is counted;
`--config.prefixrl.pool_path=traces.jsonl` uses traces from another model instead (fields id and
text, or tokens). Paper settings: 3 cuts per trace in [0.4, 0.8] of its tokens, 3 prefixed : 1
unprefixed, up to 2,500 samples per problem.
"""
from jaxprefix import variants


def get_config(arg: str = ""):
    c, args = variants.method_config(__file__, "prefixrl", arg)
    if args.variant == "demo":
        # 4 contexts per problem (3 prefixed + 1 plain): 16 problems keep 64 groups a step.
        c.train.problems_per_step = 16
        c.prefixrl.update(samples_per_round=64, max_samples=512)
    elif args.variant == "smollm2":
        c.prefixrl.update(samples_per_round=8, max_samples=32)
    elif args.variant == "paper":
        c.train.problems_per_step = 128  # the paper's batch
    return c
