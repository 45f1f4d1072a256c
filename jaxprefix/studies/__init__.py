"""Method comparisons from one base policy and their reports: the shared base, mining and
held-out evaluation (study), the SFT warm starts and PrefixRL's controls the results study's arms
start from, and the report's tables with their statistics (study_tables, results_report)."""
