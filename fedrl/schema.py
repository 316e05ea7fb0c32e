"""Validated records: messages, configs, profiles and scenarios are pydantic models.

Every schema is strict (no silent coercion of "3" to 3 or True to 1), frozen and closed
(unknown keys are errors). `parse` turns any validation failure into one line naming every
bad field, so a wrong type anywhere is a clear error, never a traceback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class SchemaError(ValueError):
    """Input that does not fit its schema."""


def one_line(what: str, err: ValidationError) -> str:
    problems = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        message = e["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {message}" if where else message)
    return f"{what}: " + "; ".join(problems)


class Schema(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @classmethod
    def parse(cls, data: Mapping[str, Any], what: str | None = None):
        if not isinstance(data, Mapping):
            raise SchemaError(
                f"{what or cls.__name__}: expected a table of fields, got {type(data).__name__}"
            )
        try:
            return cls.model_validate(dict(data))
        except ValidationError as err:
            raise SchemaError(one_line(what or cls.__name__, err)) from None

    def to_record(self) -> dict:
        return self.model_dump()

    def replace(self, **changes):
        """A validated copy with `changes` applied."""
        return type(self).parse({**self.model_dump(), **changes})
