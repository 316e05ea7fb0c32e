"""Bounded waits for the tests that drive real processes."""

import time


def wait_for(predicate, timeout_s: float, what: str, every_s: float = 0.3):
    """The first truthy value of `predicate()`; AssertionError naming `what` after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
