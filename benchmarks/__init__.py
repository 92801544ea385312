"""Benchmarks for dpd-router: a load generator, the setups it drives, and one script per scenario.

Run a scenario with `python -m benchmarks.<scenario>`; see benchmarks/README.md.
"""
