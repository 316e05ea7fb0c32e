"""How many cores this process may use: its CPU affinity where the OS keeps one (Linux), else
every core (macOS has no sched_getaffinity); and the environment that holds a child process's
math libraries to a number of threads."""

import os


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_env(threads: int) -> dict[str, str]:
    """OpenMP's and MKL's thread counts for a child process (torch reads them as it starts);
    0: none set, the libraries' default (every core)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)} if threads else {}
