"""One declaration per field, both directions from it.

A wire record is a frozen dataclass whose fields are declared with
:func:`wired`: the field's *kind* says how its value is read from a decoded
map (validated strictly by :class:`~fleetlease.transport.wire.base.Reader`,
every error naming the field) and how it is written. :class:`Record` derives
``to_body()`` and ``from_body()`` from those declarations, so the encoder and
the decoder of a message cannot disagree about its fields, their order or
their wire names.

Rules the codec applies to every field:

- the body map lists the fields in declaration order, under the field's name
  (or the ``key`` it declares); ``omit_none`` leaves a None value out;
- a field absent from the body takes its dataclass default, unless it is
  declared ``required`` (or has no default): then the body is refused;
- a field whose default is None also reads an explicit nil as None;
- unknown keys are ignored, so that a newer peer can add optional fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Self, TypeVar, dataclass_transform

from fleetlease.transport.wire.base import (
    INT64_MAX,
    MAX_NAME_LEN,
    MAX_TEXT_LEN,
    MISSING,
    DecodeError,
    Reader,
    out_of_range,
)

# -- kinds ---------------------------------------------------------------------------------


class Kind:
    """How one field's value is read from a decoded map and written to one."""

    def read(self, r: Reader, key: str) -> Any:
        raise NotImplementedError

    def write(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Text(Kind):
    min_len: int = 0
    max_len: int = MAX_TEXT_LEN
    choices: frozenset[str] | None = None

    def read(self, r: Reader, key: str) -> Any:
        return r.text(key, min_len=self.min_len, max_len=self.max_len, choices=self.choices)


@dataclass(frozen=True)
class Choice(Kind):
    """A member of a ``StrEnum``, sent as its plain value."""

    enum: type[StrEnum]

    def read(self, r: Reader, key: str) -> Any:
        return self.enum(r.text(key, choices=frozenset(m.value for m in self.enum)))

    def write(self, value: Any) -> Any:
        return value.value


class Name(Kind):
    """A non-empty identifier or name, without control characters."""

    def read(self, r: Reader, key: str) -> Any:
        return r.name(key)


class Token(Kind):
    """A value that may become a subject token (host ids, verbs)."""

    def read(self, r: Reader, key: str) -> Any:
        return r.token(key)


class Uuid(Kind):
    """A UUID, read in its canonical spelling."""

    def read(self, r: Reader, key: str) -> Any:
        return r.uuid(key)


class Hex64(Kind):
    """64 lowercase hex characters (credentials, SHA-256 digests)."""

    def read(self, r: Reader, key: str) -> Any:
        return r.hex64(key)


@dataclass(frozen=True)
class Integer(Kind):
    """An integer in ``lo..hi`` (never a bool)."""

    lo: int = 0
    hi: int = INT64_MAX

    def read(self, r: Reader, key: str) -> Any:
        return r.integer(key, lo=self.lo, hi=self.hi)


@dataclass(frozen=True)
class Number(Kind):
    """A finite number in ``lo..hi``, read as a float (ints accepted, bools not)."""

    lo: float = 0.0
    hi: float = float(INT64_MAX)

    def read(self, r: Reader, key: str) -> Any:
        return r.number(key, lo=self.lo, hi=self.hi)


class Flag(Kind):
    def read(self, r: Reader, key: str) -> Any:
        return r.flag(key)


@dataclass(frozen=True)
class Blob(Kind):
    """Bytes, ``min_len..max_len`` long."""

    max_len: int
    min_len: int = 0

    def read(self, r: Reader, key: str) -> Any:
        return r.blob(key, min_len=self.min_len, max_len=self.max_len)


@dataclass(frozen=True)
class StrList(Kind):
    """A list of strings; ``max_bytes`` also bounds each one's UTF-8 length."""

    max_items: int
    max_len: int = MAX_NAME_LEN
    max_bytes: int | None = None

    def read(self, r: Reader, key: str) -> Any:
        items = r.str_list(key, max_items=self.max_items, max_len=self.max_len)
        limit = self.max_bytes
        if limit is not None:
            for i, item in enumerate(items):
                # Characters take up to 4 bytes each: encode only what might be over.
                if len(item) * 4 > limit and len(item.encode("utf-8", "surrogatepass")) > limit:
                    raise out_of_range(f"{r.path}{key}[{i}]", f"must be at most {limit} bytes")
        return items


class StrMap(Kind):
    """A map of short strings to strings (device capabilities)."""

    def read(self, r: Reader, key: str) -> Any:
        return r.str_map(key)


class Doc(Kind):
    """A free-form JSON-compatible map (payload, result, args)."""

    def read(self, r: Reader, key: str) -> Any:
        return r.doc(key)


class AnyValue(Kind):
    """Any msgpack value (the user API's replies)."""

    def read(self, r: Reader, key: str) -> Any:
        return r.any(key)


@dataclass(frozen=True)
class Records(Kind):
    """A list of records, each decoded with its own declarations; errors name
    the item (``devices[3].state``)."""

    record: type[Record]
    max_items: int

    def read(self, r: Reader, key: str) -> Any:
        items = r.seq(key, max_items=self.max_items)
        return [self.record.from_body(x, f"{r.path}{key}[{i}].") for i, x in enumerate(items)]

    def write(self, value: Any) -> Any:
        return [item.to_body() for item in value]


# -- declarations --------------------------------------------------------------------------


@dataclass(frozen=True)
class Wired:
    """A field's wire declaration (the dataclass field's metadata)."""

    kind: Kind
    key: str | None = None
    required: bool = False
    omit_none: bool = False


def wired(
    kind: Kind,
    *,
    key: str | None = None,
    required: bool = False,
    omit_none: bool = False,
    default: Any = dataclasses.MISSING,
    default_factory: Callable[[], Any] | Any = dataclasses.MISSING,
    repr: bool = True,
) -> Any:
    """A dataclass field read and written as ``kind`` (see the module doc)."""
    meta = {"wire": Wired(kind, key, required, omit_none)}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, repr=repr, metadata=meta)
    return dataclasses.field(default=default, repr=repr, metadata=meta)


@dataclass(frozen=True)
class _Slot:
    name: str
    key: str
    wire: Wired
    #: The value of an absent field (a fresh one per call), None when required.
    default: Callable[[], Any] | None
    #: The default is None: an explicit nil reads as None too.
    nil_ok: bool


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


_SLOTS: dict[type, tuple[_Slot, ...]] = {}


def _slots(cls: type) -> tuple[_Slot, ...]:
    """The wire declarations of a record class, in field order (computed once)."""
    found = _SLOTS.get(cls)
    if found is None:
        found = _SLOTS[cls] = _declared(cls)
    return found


def _declared(cls: type) -> tuple[_Slot, ...]:
    slots = []
    for f in dataclasses.fields(cls):
        wire = f.metadata.get("wire")
        if not isinstance(wire, Wired):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with wired()")
        default: Callable[[], Any] | None = None
        if not wire.required:
            if f.default is not dataclasses.MISSING:
                default = _constant(f.default)
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory
        nil_ok = default is not None and f.default is None
        slots.append(_Slot(f.name, wire.key or f.name, wire, default, nil_ok))
    return tuple(slots)


T = TypeVar("T")


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(wired,))
def record(cls: type[T]) -> type[T]:
    """Declare a wire record: a frozen, keyword-only dataclass whose fields are
    all declared with :func:`wired` (type checkers read the declarations too)."""
    return dataclass(frozen=True, kw_only=True)(cls)


class Record:
    """A :func:`record` whose body map is derived from its field declarations in
    both directions."""

    def to_body(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for s in _slots(type(self)):
            value = getattr(self, s.name)
            if value is None:
                if not s.wire.omit_none:
                    out[s.key] = None
            else:
                out[s.key] = s.wire.kind.write(value)
        return out

    @classmethod
    def from_body(cls, body: object, path: str = "") -> Self:
        """Decode a body map strictly; DecodeError names the first bad field."""
        r = Reader(body, path)
        values: dict[str, Any] = {}
        for s in _slots(cls):
            raw = r.raw(s.key)
            if raw is MISSING or (raw is None and s.nil_ok):
                if s.default is None:
                    full = path + s.key
                    raise DecodeError("missing_field", f"missing field {full}", field=full)
                values[s.name] = s.default()
            else:
                values[s.name] = s.wire.kind.read(r, s.key)
        cls.check_decoded(values, path)
        return cls(**values)

    @classmethod
    def check_decoded(cls, values: dict[str, Any], path: str) -> None:
        """What no single field can check (a record's fields together); may
        adjust ``values``. DecodeError if the combination is not valid."""


class Message(Record):
    """A wire message: a record with a ``TYPE`` tag (the envelope's "t")."""

    TYPE: ClassVar[str]
