"""The actor system: a Scheduler, one Lease actor per active task and a Reaper
(pykka), behind the asyncio facade :class:`ControlPlane` that the transport
calls. Its long-poll broker (:class:`LongPollBroker`) parks hosts' claims until
an assignment wakes them.

The names below are the package's public surface; the submodules hold the rest
(``messages`` the actor messages, ``failpoints`` the chaos tests' fail points).
"""

from fleetlease.actors.base import NotDelivered
from fleetlease.actors.bridge import Bridge, Reply
from fleetlease.actors.failpoints import FailPointError
from fleetlease.actors.longpoll import LongPollBroker
from fleetlease.actors.runtime import DEFAULT_STACK_SIZE, ControlPlane

__all__ = [
    "DEFAULT_STACK_SIZE",
    "Bridge",
    "ControlPlane",
    "FailPointError",
    "LongPollBroker",
    "NotDelivered",
    "Reply",
]
