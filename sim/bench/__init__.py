"""Benchmarks that drive the whole system: overlap, async rounds, scale."""
