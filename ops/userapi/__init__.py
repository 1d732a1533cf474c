"""The user API behind the ops subjects (``{prefix}.ops.{user}.{verb}``).

``OpsApi`` authenticates and authorizes each request and dispatches it to the
handlers of its area (``tasks``, ``fleet``, ``admin``); ``Args`` checks the
arguments, the ``project_*`` functions are the safe projection every reply
goes through, and ``EventFeed`` keeps the recent task events the ``events``
long-poll serves. The API's client is ``fleetlease.ops.client``.
"""

from fleetlease.ops.userapi.admin import ADMIN_VERBS
from fleetlease.ops.userapi.api import OpsApi
from fleetlease.ops.userapi.args import Args
from fleetlease.ops.userapi.context import ControlPlaneLike
from fleetlease.ops.userapi.events import EventFeed
from fleetlease.ops.userapi.projection import (
    project_artifact,
    project_attempt,
    project_cancel,
    project_device,
    project_host,
    project_log_line,
    project_task,
)

__all__ = [
    "ADMIN_VERBS",
    "Args",
    "ControlPlaneLike",
    "EventFeed",
    "OpsApi",
    "project_artifact",
    "project_attempt",
    "project_cancel",
    "project_device",
    "project_host",
    "project_log_line",
    "project_task",
]
