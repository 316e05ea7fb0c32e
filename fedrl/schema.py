"""Validated records: messages, configs, profiles and scenarios are pydantic models.

Every schema is strict (no silent coercion of "3" to 3 or True to 1), frozen and closed
(unknown keys are errors). `parse` turns any validation failure into one line naming every
bad field, so a wrong type anywhere is a clear error, never a traceback.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, ClassVar

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
    what: ClassVar[str | None] = None  # how errors name the record (default: the class name)

    @classmethod
    def parse(cls, data: Mapping[str, Any], what: str | None = None):
        what = what or cls.what or cls.__name__
        if not isinstance(data, Mapping):
            raise SchemaError(f"{what}: expected a table of fields, got {type(data).__name__}")
        try:
            return cls.model_validate(dict(data))
        except ValidationError as err:
            raise SchemaError(one_line(what, err)) from None

    def to_record(self) -> dict:
        return self.model_dump()

    def replace(self, **changes):
        """A validated copy with `changes` applied."""
        return type(self).parse({**self.model_dump(), **changes})

    # Packed records carry the fields by position, one list per type, behind a layout id: a
    # message sent every round then costs a third of its named form on the wire, and a peer
    # with another field list, or of another protocol, is refused by name instead of read wrong.
    @classmethod
    def layout(cls) -> str:
        return f"{PROTOCOL}.{hashlib.sha256(cls.layout_source().encode()).hexdigest()[:8]}"

    @classmethod
    def layout_source(cls) -> str:
        """What the layout id stands for: the fields by position and type."""
        fields = ",".join(f"{n}:{PACKED_GROUPS[f.annotation]}" for n, f in cls.model_fields.items())
        return f"{cls.__name__}({fields})"

    @classmethod
    def pack(cls, fields: Mapping[str, Any]) -> dict:
        """`fields` (every one of this schema's, as named) as a packed record; not validated, so a
        test can pack what a dishonest peer would send."""
        record: dict = {"layout": cls.layout()}
        for name, info in cls.model_fields.items():
            record.setdefault(PACKED_GROUPS[info.annotation], []).append(fields[name])
        return record

    def to_packed(self) -> dict:
        return self.pack(self.model_dump())

    @classmethod
    def unpack(cls, record: Mapping[str, Any], what: str | None = None) -> dict:
        """The named fields of a packed record (SchemaError when it is not one of this layout)."""
        what = what or cls.__name__
        if not isinstance(record, Mapping):
            raise SchemaError(f"{what}: expected a packed record, got {type(record).__name__!r}")
        if record.get("layout") != cls.layout():
            raise SchemaError(f"{what}: {layout_mismatch(record.get('layout'), cls.layout())}")
        groups = {g: record.get(g, []) for g in set(PACKED_GROUPS.values())}
        if not all(isinstance(values, list) for values in groups.values()):
            raise SchemaError(f"{what}: a packed record's groups are lists")
        groups = {g: list(values) for g, values in groups.items()}
        fields = {}
        for name, info in cls.model_fields.items():
            group = groups[PACKED_GROUPS[info.annotation]]
            if not group:
                raise SchemaError(f"{what}: too few values for layout {cls.layout()!r}")
            fields[name] = group.pop(0)
        if any(groups.values()) or set(record) - {"layout", *groups}:
            raise SchemaError(f"{what}: more values than layout {cls.layout()!r} has")
        return fields

    @classmethod
    def from_packed(cls, record: Mapping[str, Any], what: str | None = None):
        return cls.parse(cls.unpack(record, what), what)


PACKED_GROUPS = {int: "i", float: "f", str: "s"}  # a packed record's list of each field type

# The wire protocol of packed records (the messages between coordinator and nodes), in every
# layout id. Bump it whenever what a message or a patch means changes without its fields
# changing, so that peers of two fedrl versions refuse each other by name instead of failing
# later on what they read: 3, patch format 8 (joint entries of small tensors); 2, every upload
# in the wire dtype (1: before protocol numbers, when dense and whole-adapter uploads were
# float32 whatever the wire dtype).
PROTOCOL = 3
OTHER_VERSION = "another fedrl version"  # in every layout refusal: the peer must be upgraded (or this node)


def layout_mismatch(got, expected: str) -> str:
    """Why a record of layout `got` is refused, naming the peer's protocol where it has one."""
    number = got.partition(".")[0] if isinstance(got, str) else ""
    if number.isdigit() and int(number) != PROTOCOL:
        return (
            f"the peer speaks fedrl protocol {int(number)}, this fedrl protocol {PROTOCOL} "
            f"({OTHER_VERSION}: upgrade the older side)"
        )
    if isinstance(got, str) and "." not in got:
        return (
            f"layout {got!r} is from a fedrl before protocol numbers, this fedrl speaks protocol "
            f"{PROTOCOL} ({OTHER_VERSION}: upgrade it)"
        )
    return f"layout {got!r} is not {expected!r} ({OTHER_VERSION}?)"
