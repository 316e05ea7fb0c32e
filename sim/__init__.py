"""Simulation: client profiles, links and clocks, scenarios, benchmarks and reports."""
