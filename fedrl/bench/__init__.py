"""Benchmarks: each is `fedrl bench NAME [--quick] [--out FILE]` and writes JSON (+ a PNG)."""
