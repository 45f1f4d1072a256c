"""The job entry points: each module one job main dispatches (config.job) or a `python -m`
command; what they share lives in run_setup/ and studies/."""
