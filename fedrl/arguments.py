"""Command-line argument types shared by `fedrl` and its benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer option that must be >= `minimum`: a count of clients, seeds or steps. Before,
    `--clients 0` fell through `args.clients or default` and silently ran the default."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # what argparse names in its error
    return parse
