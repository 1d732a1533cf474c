"""Typed repository errors. Each carries a stable ``code`` (also the wire error
code), a message and structured fields saying what was wrong. Driver errors are
translated once, at the repository boundary, with ``raise ... from``."""

from __future__ import annotations

from typing import Any


class RepositoryError(Exception):
    """The repository refused an operation."""

    code = "error"
    retryable = False

    def __init__(self, message: str | None = None, **fields: Any) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.fields = fields
        super().__init__(self.message)

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message}


class NotFound(RepositoryError):
    """No such object."""

    code = "not_found"


class Conflict(RepositoryError):
    """The object is not in a state that accepts this operation (stale attempt,
    wrong lease, already claimed, different terminal fingerprint)."""

    code = "conflict"


class Gone(RepositoryError):
    """The deadline for this operation has passed or the object is terminal."""

    code = "gone"


class Forbidden(RepositoryError):
    """The caller may not act on this object."""

    code = "forbidden"


class Unauthorized(RepositoryError):
    """Missing, invalid, revoked or superseded credentials or session."""

    code = "unauthorized"


class Invalid(RepositoryError):
    """A field has the wrong type or is out of range."""

    code = "bad_request"

    def __init__(self, message: str | None = None, *, field: str, **fields: Any) -> None:
        super().__init__(message or f"invalid value for {field}", field=field, **fields)
        self.field = field


class QuotaExceeded(RepositoryError):
    """A storage quota is used up (a host's share of artifact staging, or the
    staging as a whole). Space comes back as uploads are committed or their
    attempts end; retrying later may succeed."""

    code = "quota"
    retryable = True


class Busy(RepositoryError):
    """The caller already has as many requests of this kind in progress as it
    may; retry once one of them is answered."""

    code = "busy"
    retryable = True


class Unavailable(RepositoryError):
    """The database could not be reached or the outcome of a commit is unknown and
    could not be read back. Safe to retry."""

    code = "unavailable"
    retryable = True
