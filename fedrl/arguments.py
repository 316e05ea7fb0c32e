"""Command-line argument types shared by `fedrl` and its benchmarks."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer option within [minimum, maximum]: a count of clients, seeds or steps, a port.
    Before, `--clients 0` fell through `args.clients or default` and silently ran the default,
    and `--port 99999` ended in a traceback from bind()."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


PORT = integer(0, 65535)  # 0: any free port
