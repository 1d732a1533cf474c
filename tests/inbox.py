"""Raw requests from a test connection that stands in for any principal.

The control plane answers a request only into the inbox of the principal its
subject names (``Subjects.reply_inbox``), so a bare ``nc.request`` (whose reply
subject is under ``_INBOX.``) gets no answer. :func:`request` picks a fresh reply
subject inside the right inbox for each request.
"""

from __future__ import annotations

import asyncio
import secrets

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError

from fleetlease.transport.subjects import Subjects


def reply_subject(subjects: Subjects, subject: str) -> str:
    """A fresh reply subject in the inbox of the principal ``subject`` names (the
    anonymous inbox if it names none: such a request is never answered)."""
    inbox = subjects.reply_inbox(subject)
    prefix = inbox.prefix if inbox is not None else subjects.anon_inbox_prefix()
    return f"{prefix}.{secrets.token_hex(8)}"


async def request(
    nc: NatsClient, subjects: Subjects, subject: str, data: bytes, timeout: float = 10.0
) -> Msg:
    """``nc.request`` with the reply inside the requester's own inbox; raises
    nats' TimeoutError when no answer comes."""
    reply = reply_subject(subjects, subject)
    future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_reply(msg: Msg) -> None:
        if not future.done():
            future.set_result(msg)

    sub = await nc.subscribe(reply, cb=on_reply, max_msgs=1)
    try:
        await nc.publish(subject, data, reply=reply)
        try:
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise NatsTimeoutError from None
    finally:
        if not future.done():
            await sub.unsubscribe()
