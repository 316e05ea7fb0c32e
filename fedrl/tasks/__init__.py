"""Tasks with verifiable rewards, looked up by name."""

from __future__ import annotations

from fedrl.tasks.addition import AdditionTask
from fedrl.tasks.base import Problem, Task, error_rate
from fedrl.tasks.digits import DigitsBandit
from fedrl.tasks.reversal import ReversalTask

TASKS = {"reversal": ReversalTask, "addition": AdditionTask, "digits": DigitsBandit}


def get_task(name: str, **params) -> Task:
    """`get_task("reversal", length=10, num_symbols=2)`; unknown names or params raise ValueError."""
    try:
        cls = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known: {sorted(TASKS)}") from None
    try:
        return cls(**params)
    except TypeError as err:
        raise ValueError(f"bad parameters for task {name!r}: {err}") from None


__all__ = [
    "AdditionTask",
    "DigitsBandit",
    "Problem",
    "ReversalTask",
    "Task",
    "TASKS",
    "error_rate",
    "get_task",
]
