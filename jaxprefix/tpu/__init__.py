"""Cloud TPU slices from a CPU machine: their chips and devices (topology), what a program
compiled for them needs (compiled_stats) and costs (costing, the rules launch/capacity_plan.py
shares). The compile job (jobs/compile.py) uses them."""
