"""Command-line argument types shared by `fedrl` and its benchmarks."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import time
from collections.abc import Callable


def number(
    cast: type, minimum: float, maximum: float | None = None, above: bool = False
) -> Callable[[str], float]:
    """A finite option of type `cast` within [minimum, maximum], or (minimum, maximum] with
    `above`. Before, `--clients 0` fell through `args.clients or default` and silently ran the
    default, `--port 99999` ended in a traceback from bind(), `bench methods --buggy 2` ran as if
    every client were buggy, and `bench async --budget-s 0` ran with no budget at all."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if cast is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {value}")
        if not (minimum < value if above else minimum <= value):
            raise argparse.ArgumentTypeError(f"must be {'>' if above else '>='} {minimum}, got {value}")
        if maximum is not None and not value <= maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    return number(int, minimum, maximum)


PORT = integer(0, 65535)  # 0: any free port
SHARE = number(float, 0.0, 1.0)  # a share of the clients
SECONDS = number(float, 0.0)
POSITIVE = number(float, 0.0, above=True)  # a budget, a deadline, a learning rate
ERROR = number(float, 0.0, 1.0)  # a held-out error to reach: a fraction of the problems


def future_time(text: str) -> float:
    """An ISO 8601 time still to come, as a timestamp (a past one would end the work at once)."""
    try:
        when = datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 time such as 2026-11-23T07:00, got {text!r}"
        ) from None
    if when <= time.time():
        raise argparse.ArgumentTypeError(f"{text} is in the past")
    return when


def parse_overrides(items: list[str] | None) -> dict:
    """`--set KEY=VALUE ...` as a dict: values parsed as JSON, else kept as strings; dashes in
    keys read as underscores."""
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes KEY=VALUE, got {item!r}")
        try:
            overrides[key.replace("-", "_")] = json.loads(value)
        except ValueError:  # a bare string such as mode=fedavg-lora
            overrides[key.replace("-", "_")] = value
    return overrides
