"""What a job starts from, before any work: its settings resolved and checked (preflight,
method_settings, allocation, sweep_points, study_arms), the policy (policy, sft_base), the
problem sets and the mined artifacts (mining: set_up is the one sequence every sampling job
starts with)."""
