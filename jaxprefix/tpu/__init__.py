"""Cloud TPU slices from a CPU machine: their chips and devices (topology), and what a program
compiled for them needs and costs (compiled_stats). The compile job (jobs/compile.py) uses both."""
