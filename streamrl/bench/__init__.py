"""Benchmarks behind ``streamrl bench ...``: medians over repeats, baseline in the same run."""
