"""Benchmarks: one script per figure (`python -m benchmarks.<name>`), JSON results in benchmarks/results/."""
