"""Resident memory of a process from /proc (Linux): current, peak, and resetting the peak."""

from __future__ import annotations


def status_bytes(field: str = "VmRSS", pid: int | str = "self") -> int:
    """`VmRSS` (now) or `VmHWM` (peak since start or `reset_peak`) in bytes; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def reset_peak(pid: int | str = "self") -> None:
    """Start `VmHWM` again from the current resident size (where the kernel allows it)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
