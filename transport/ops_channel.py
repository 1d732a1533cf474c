"""The ops channel: user requests (``OpsRequest``) on the ops subjects, checked
at the edge and handed to the user API (``ops.userapi.OpsApi``, an ``OpsHandler``).

The subject names the user, and the broker lets each user publish only its own
subjects; the handler refuses a token that is not that user's. An ``events``
long-poll with no long-poll slot free, or while the server stops, is answered
without waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from nats.aio.msg import Msg

from fleetlease.persistence.errors import Unavailable
from fleetlease.transport import wire
from fleetlease.transport.host_handlers import reject_nul
from fleetlease.transport.subjects import IDENTIFY_VERB, Subjects


class OpsHandler(Protocol):
    """The user API behind the ops subjects (``ops.userapi.OpsApi``). ``handle`` returns
    any msgpack-able value or raises a ``RepositoryError`` (typed reply)."""

    async def handle(
        self, verb: str, token: str, args: dict[str, Any], *, user: str | None
    ) -> Any: ...


class OpsChannel:
    """Answers the requests of the ops channel. ``stopping()`` says whether the
    server is stopping (``events`` polls then do not wait)."""

    def __init__(
        self, *, subjects: Subjects, ops: OpsHandler | None, stopping: Callable[[], bool]
    ) -> None:
        self.subjects = subjects
        self.ops = ops
        self._stopping = stopping

    async def handle(self, msg: Msg, may_wait: bool) -> bytes:
        try:
            user, verb = self.subjects.parse_ops_subject(msg.subject)
        except ValueError as exc:
            raise wire.DecodeError("bad_subject", str(exc)) from None
        env = wire.decode(msg.data)
        if not isinstance(env.msg, wire.OpsRequest):
            raise wire.DecodeError(
                "wrong_type", f"ops expects ops_request, got {env.msg.TYPE}", field="t"
            )
        if env.msg.verb != verb:
            raise wire.DecodeError("wrong_verb", "verb does not match the subject", field="verb")
        if user is None and verb != IDENTIFY_VERB:  # parse_ops_subject guarantees it
            raise wire.DecodeError("bad_subject", "name the user in the subject")
        reject_nul(env.msg.args, "args")
        if self.ops is None:
            raise Unavailable("the user API is not served here")
        args = env.msg.args
        if verb == "events" and isinstance(args, dict) and (not may_wait or self._stopping()):
            # No long-poll slot (or stopping): answered without waiting.
            args = {**args, "wait_s": 0.0}
        # The subject names the user (the broker lets each user publish only its
        # own); the handler refuses a token that is not that user's.
        data = await self.ops.handle(verb, env.msg.token, args, user=user)
        return wire.encode_reply(wire.OpsReply(data=data))
