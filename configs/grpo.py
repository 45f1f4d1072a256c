"""Plain on-policy GRPO: the baseline every method is compared with at equal compute.

    python -m jaxprefix.main --config=configs/grpo.py --workdir=/tmp/grpo          # demo task, CPU
    python -m jaxprefix.main --config=configs/grpo.py:smoke --workdir=/tmp/grpo_smoke
    python -m jaxprefix.main --config=configs/grpo.py:moe_smoke --workdir=/tmp/grpo_moe  # a MoE
    python -m jaxprefix.main --config=configs/grpo.py:smollm2 --workdir=/tmp/grpo_smollm2
    python -m jaxprefix.main --config=configs/grpo.py:paper --workdir=gs://BUCKET/grpo

Loss family as fields: `--config.train.advantage=dr_grpo|rloo`, `--config.train.eps_high=0.28`
(DAPO clip-higher), `--config.train.dynamic_sampling=True`, `--config.train.ratio=sequence`
(GSPO), `--config.train.aggregation=seq_mean_token_mean`, `--config.train.kl_coef=0.001`.
"""
from jaxprefix import variants


def get_config(arg: str = ""):
    c, _ = variants.method_config(__file__, "grpo", arg)
    return c
