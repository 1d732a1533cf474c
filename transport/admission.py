"""Admission control of the control plane's NATS side: what one principal may
have in flight on one channel, and how many long-polls it may park.

A request is admitted or shed the moment it is taken off the subscription,
before anything is decoded: a shed request is answered at once with a typed
``busy`` error and costs the control plane one small reply. The subscription's
delivery task therefore never waits for a worker, so the connection is always
read as fast as nats-server writes to it (nats-server closes a connection it
cannot write to as a *slow consumer*, losing every request in flight on it).

Three bounds, all per channel:

* ``principal_requests`` / ``principal_bytes``: requests (and their bytes) of one
  principal taken off NATS and not yet answered, queued for a worker or being
  served. A host needs one heartbeat in flight, a few claims, one message per
  lease; a flood of one principal hits this bound and nobody else's.
* ``backlog_requests`` / ``backlog_bytes``: the same over all principals (many
  principals, or a principal that keeps changing its name): beyond it every new
  request is shed until the backlog drains.
* ``principal_polls``: parked long-polls (host claims, ops ``events``) of one
  principal; the channel's long-poll pool (``long_poll``) can then never be
  taken by one principal. A long-poll over this cap is answered ``busy``.

Who the principal is: a host request's host id is in its subject (and the
secured broker lets a host publish under its own id only). An ops request's
principal is :func:`ops_principal`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fleetlease.transport.subjects import Subjects

#: The principal of ops requests whose reply subject says nothing useful.
UNKNOWN_OPS_PRINCIPAL = "ops:?"


@dataclass(frozen=True, kw_only=True)
class Budget:
    """The bounds of one channel (see the module docstring)."""

    principal_requests: int
    principal_bytes: int
    principal_polls: int
    backlog_requests: int
    backlog_bytes: int

    def __post_init__(self) -> None:
        for name in (
            "principal_requests",
            "principal_bytes",
            "principal_polls",
            "backlog_requests",
            "backlog_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")


class Admission:
    """The in-flight accounting of one channel. Pure bookkeeping, single-threaded
    (the server's event loop): ``admit`` / ``release`` bracket every request that
    is admitted, ``park`` / ``unpark`` every long-poll slot taken."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._requests: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._polls: Counter[str] = Counter()
        self.backlog_requests = 0
        self.backlog_bytes = 0
        #: Requests refused so far (over a principal's budget / over the backlog).
        self.shed_principal = 0
        self.shed_backlog = 0
        self.shed_polls = 0

    def admit(self, principal: str, size: int) -> str | None:
        """Count the request in and return None, or return why it is refused
        (nothing counted)."""
        b = self.budget
        if (
            self.backlog_requests >= b.backlog_requests
            or self.backlog_bytes + size > b.backlog_bytes
        ):
            self.shed_backlog += 1
            return "the control plane is overloaded; retry later"
        if (
            self._requests[principal] >= b.principal_requests
            or self._bytes[principal] + size > b.principal_bytes
        ):
            self.shed_principal += 1
            return "too many requests in flight from this principal; retry later"
        self._requests[principal] += 1
        self._bytes[principal] += size
        self.backlog_requests += 1
        self.backlog_bytes += size
        return None

    def release(self, principal: str, size: int) -> None:
        self.backlog_requests -= 1
        self.backlog_bytes -= size
        _decrement(self._requests, principal, 1)
        _decrement(self._bytes, principal, size)

    def park(self, principal: str) -> bool:
        """Take one of ``principal``'s long-poll slots; False over its cap."""
        if self._polls[principal] >= self.budget.principal_polls:
            self.shed_polls += 1
            return False
        self._polls[principal] += 1
        return True

    def unpark(self, principal: str) -> None:
        _decrement(self._polls, principal, 1)

    def in_flight(self, principal: str) -> int:
        return self._requests[principal]

    def parked(self, principal: str) -> int:
        return self._polls[principal]


def _decrement(counter: Counter[str], key: str, amount: int) -> None:
    left = counter[key] - amount
    if left > 0:
        counter[key] = left
    else:
        del counter[key]


def host_principal(subjects: Subjects, subject: str) -> str:
    """The host a host subject names (``{prefix}.host.{id}.{channel}.{verb}``),
    without validating the rest: the gate does that once admitted. Anything
    unparsable shares one principal."""
    head = f"{subjects.prefix}.host."
    if subject.startswith(head):
        host_id, _, _ = subject[len(head) :].partition(".")
        if host_id:
            return f"host:{host_id}"
    return "host:?"


def ops_principal(subjects: Subjects, subject: str, reply: str) -> str:
    """Who an ops request is charged to, before it is decoded: the user its
    subject names (``{prefix}.ops.<user>.<verb>``, which a secured broker lets
    only that user publish on). A request naming no user (the identify request
    of a client on an open broker) is charged to the connection that made it
    (nats-py's reply subjects are ``{inbox}.{nuid}.{token}``: the reply subject
    without its last token); with no reply subject at all, to one shared
    principal."""
    inbox = subjects.reply_inbox(subject)
    if inbox is not None and inbox.principal.startswith("user:"):
        return inbox.principal
    if not reply:
        return UNKNOWN_OPS_PRINCIPAL
    connection, dot, _ = reply.rpartition(".")
    if not dot or not connection:
        return UNKNOWN_OPS_PRINCIPAL
    return f"conn:{connection}"
