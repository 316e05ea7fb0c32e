"""How many cores this process may use: its CPU affinity where the OS keeps one (Linux), else
every core (macOS has no sched_getaffinity)."""

import os


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
