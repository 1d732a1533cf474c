"""Every NATS subject, built in one place.

Nothing else in the code base formats a subject: handlers, clients and (later)
broker permissions all ask a :class:`Subjects` instance, so the trees cannot
drift apart. Host subjects carry the host id as their own token
(``{prefix}.host.{host_id}.{channel}.{verb}``) so that broker permissions can
be granted per host, and each channel has its own subtree so that the server
can serve it from its own queue group (a stuck log upload never delays a lease
renewal).
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

DEFAULT_PREFIX = "fleetlease"

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)*")
_PREFIX_MAX_LEN = 128


class Channel(enum.StrEnum):
    CONTROL = "control"
    JOBS = "jobs"
    LOGS = "logs"
    ARTIFACTS = "artifacts"
    OPS = "ops"


#: The verbs each host channel accepts; a subject with any other verb is refused.
HOST_VERBS: dict[Channel, frozenset[str]] = {
    Channel.CONTROL: frozenset({"register", "heartbeat", "reconcile"}),
    Channel.JOBS: frozenset({"claim", "ack", "renew", "progress", "result", "cancel_poll"}),
    Channel.LOGS: frozenset({"append"}),
    Channel.ARTIFACTS: frozenset({"chunk", "commit"}),
}

#: The user API verbs known today. ``Subjects.ops`` accepts any valid token so
#: that the API can grow without touching this module; this set is for help
#: texts and tests.
OPS_VERBS: frozenset[str] = frozenset(
    {
        "submit",
        "tasks",
        "task_show",
        "cancel",
        "logs",
        "artifacts",
        "hosts",
        "devices",
        "fleet_counts",
        "fleet_history",
        "host_add",
        "host_revoke",
        "host_list",
        "host_drain",
        "host_undrain",
        "device_drain",
        "device_undrain",
        "user_add",
        "project_add",
        "project_set_retention",
        "gc",
        "whoami",
    }
)

QUEUE_CONTROL = "fleetlease-control"
QUEUE_JOBS = "fleetlease-jobs"
QUEUE_LOGS = "fleetlease-logs"
QUEUE_ARTIFACTS = "fleetlease-artifacts"
QUEUE_OPS = "fleetlease-ops"

QUEUES: dict[Channel, str] = {
    Channel.CONTROL: QUEUE_CONTROL,
    Channel.JOBS: QUEUE_JOBS,
    Channel.LOGS: QUEUE_LOGS,
    Channel.ARTIFACTS: QUEUE_ARTIFACTS,
    Channel.OPS: QUEUE_OPS,
}


def is_valid_token(value: object) -> bool:
    """Whether ``value`` may be inserted as one subject token: 1..64 characters of
    ``[A-Za-z0-9_-]`` (so never ``.``, ``*``, ``>`` or whitespace)."""
    return isinstance(value, str) and _TOKEN_RE.fullmatch(value) is not None


def validate_token(value: object, name: str) -> str:
    """Return ``value`` if it is a valid subject token, else raise ValueError naming
    the parameter ``name``."""
    if not is_valid_token(value):
        raise ValueError(f"{name} must be 1..64 characters of [A-Za-z0-9_-], got {value!r}")
    assert isinstance(value, str)
    return value


class HostSubject(NamedTuple):
    host_id: str
    channel: Channel
    verb: str


class OpsSubject(NamedTuple):
    #: None only for the identify request of a client that does not know its user.
    user: str | None
    verb: str


class ReplyInbox(NamedTuple):
    #: ``host:<id>``, ``user:<name>`` or ``anonymous`` (for logs).
    principal: str
    prefix: str


#: The only verb a client that does not name its user may send.
IDENTIFY_VERB = "whoami"


class Subjects:
    """Subject builders under one prefix (default ``fleetlease``)."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if (
            not isinstance(prefix, str)
            or len(prefix) > _PREFIX_MAX_LEN
            or _PREFIX_RE.fullmatch(prefix) is None
        ):
            raise ValueError(
                "prefix must be dot-separated non-empty tokens of [A-Za-z0-9_-] "
                f"(at most {_PREFIX_MAX_LEN} characters), got {prefix!r}"
            )
        self.prefix = prefix
        self._prefix_tokens = prefix.split(".")

    def __repr__(self) -> str:
        return f"Subjects(prefix={self.prefix!r})"

    # -- host subjects -------------------------------------------------------

    def host(self, host_id: str, channel: Channel, verb: str) -> str:
        """``{prefix}.host.{host_id}.{channel}.{verb}``; the verb must belong to the
        channel."""
        validate_token(host_id, "host_id")
        channel = Channel(channel)
        verbs = HOST_VERBS.get(channel)
        if verbs is None:
            raise ValueError(f"channel must be a host channel, got {channel.value!r}")
        if verb not in verbs:
            raise ValueError(f"verb {verb!r} is not a {channel.value} verb")
        return f"{self.prefix}.host.{host_id}.{channel.value}.{verb}"

    def register(self, host_id: str) -> str:
        return self.host(host_id, Channel.CONTROL, "register")

    def heartbeat(self, host_id: str) -> str:
        return self.host(host_id, Channel.CONTROL, "heartbeat")

    def reconcile(self, host_id: str) -> str:
        return self.host(host_id, Channel.CONTROL, "reconcile")

    def claim(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "claim")

    def ack(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "ack")

    def renew(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "renew")

    def progress(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "progress")

    def result(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "result")

    def cancel_poll(self, host_id: str) -> str:
        return self.host(host_id, Channel.JOBS, "cancel_poll")

    def log_append(self, host_id: str) -> str:
        return self.host(host_id, Channel.LOGS, "append")

    def artifact_chunk(self, host_id: str) -> str:
        return self.host(host_id, Channel.ARTIFACTS, "chunk")

    def artifact_commit(self, host_id: str) -> str:
        return self.host(host_id, Channel.ARTIFACTS, "commit")

    def parse_host_subject(self, subject: str) -> HostSubject:
        """Split a host subject into (host_id, channel, verb); ValueError on anything
        that is not exactly a subject :meth:`host` could have built."""
        if not isinstance(subject, str):
            raise ValueError(f"subject must be a str, got {type(subject).__name__}")
        tokens = subject.split(".")
        n = len(self._prefix_tokens)
        if len(tokens) != n + 4 or tokens[:n] != self._prefix_tokens or tokens[n] != "host":
            raise ValueError(f"not a host subject under {self.prefix!r}: {subject!r}")
        host_id, channel_name, verb = tokens[n + 1 :]
        if not is_valid_token(host_id):
            raise ValueError(f"bad host id in subject {subject!r}")
        try:
            channel = Channel(channel_name)
        except ValueError:
            raise ValueError(f"unknown channel in subject {subject!r}") from None
        if verb not in HOST_VERBS.get(channel, frozenset()):
            raise ValueError(f"unknown {channel_name} verb in subject {subject!r}")
        return HostSubject(host_id, channel, verb)

    # -- server-side wildcards ----------------------------------------------

    def channel_wildcard(self, channel: Channel) -> str:
        channel = Channel(channel)
        if channel is Channel.OPS:
            return self.ops_wildcard()
        return f"{self.prefix}.host.*.{channel.value}.>"

    def control_wildcard(self) -> str:
        return self.channel_wildcard(Channel.CONTROL)

    def jobs_wildcard(self) -> str:
        return self.channel_wildcard(Channel.JOBS)

    def logs_wildcard(self) -> str:
        return self.channel_wildcard(Channel.LOGS)

    def artifacts_wildcard(self) -> str:
        return self.channel_wildcard(Channel.ARTIFACTS)

    def ops_wildcard(self) -> str:
        return f"{self.prefix}.ops.>"

    def ops_user_wildcard(self, user: str) -> str:
        """Every ops subject of one user (what the broker lets that user publish)."""
        return f"{self.prefix}.ops.{validate_token(user, 'user')}.>"

    # -- user API and events -------------------------------------------------
    # The user is a token of every ops subject (``{prefix}.ops.{user}.{verb}``),
    # as the host is of every host subject: the broker lets each user publish
    # only its own, and the server answers only into that user's inbox with a
    # token of that user.

    def ops(self, user: str, verb: str) -> str:
        """``{prefix}.ops.{user}.{verb}``."""
        return f"{self.prefix}.ops.{validate_token(user, 'user')}.{validate_token(verb, 'verb')}"

    def ops_identify(self) -> str:
        """``{prefix}.ops.whoami``: the one request of a client that does not know
        its user yet (an open broker only; the reply goes into the anonymous
        inbox tree, see :meth:`anon_inbox_prefix`)."""
        return f"{self.prefix}.ops.{IDENTIFY_VERB}"

    def parse_ops_subject(self, subject: str) -> OpsSubject:
        """(user, verb) of an ops subject, user None for :meth:`ops_identify`;
        ValueError on anything else."""
        head = f"{self.prefix}.ops."
        if not isinstance(subject, str) or not subject.startswith(head):
            raise ValueError(f"not an ops subject under {self.prefix!r}: {subject!r}")
        tokens = subject[len(head) :].split(".")
        if tokens == [IDENTIFY_VERB]:
            return OpsSubject(None, IDENTIFY_VERB)
        if len(tokens) != 2:
            raise ValueError(f"not an ops subject under {self.prefix!r}: {subject!r}")
        user, verb = tokens
        if not is_valid_token(user):
            raise ValueError(f"bad user in subject {subject!r}")
        if not is_valid_token(verb):
            raise ValueError(f"bad ops verb in subject {subject!r}")
        return OpsSubject(user, verb)

    def events_task(self) -> str:
        return f"{self.prefix}.events.task"

    # -- reply inboxes -------------------------------------------------------
    # Hosts and users get disjoint inbox trees (``.host.`` / ``.ops.``) so a
    # per-host permission on ``{inbox}.>`` can never cover a user's replies,
    # whatever the host is called.

    def host_inbox_prefix(self, host_id: str) -> str:
        """An ``inbox_prefix`` for a host's nats-py connection."""
        return f"_INBOX_{self.prefix}.host.{validate_token(host_id, 'host_id')}"

    def ops_inbox_prefix(self, user: str) -> str:
        """An ``inbox_prefix`` for a CLI user's nats-py connection."""
        return f"_INBOX_{self.prefix}.ops.{validate_token(user, 'user')}"

    def anon_inbox_prefix(self) -> str:
        """The ``inbox_prefix`` of a client that does not know its user yet; only
        :meth:`ops_identify` is answered there."""
        return f"_INBOX_{self.prefix}.anon"

    def client_inbox_wildcards(self) -> list[str]:
        """Every client inbox of the fleet: what the control plane's serving
        connections may publish to (its replies), and nothing else of clients."""
        return [
            f"_INBOX_{self.prefix}.host.*.>",
            f"_INBOX_{self.prefix}.ops.*.>",
            f"_INBOX_{self.prefix}.anon.>",
        ]

    def reply_inbox(self, subject: str) -> ReplyInbox | None:
        """Who sent a request on ``subject`` and the inbox prefix its reply must
        fall under; None if the subject names no principal. Judged by position
        alone, as the broker's permissions are (a host publishes only under
        ``{prefix}.host.<its id>.``, a user only under ``{prefix}.ops.<its
        name>.``), so that a subject with an unknown verb still gets its typed
        error in the sender's own inbox."""
        if not isinstance(subject, str):
            return None
        tokens = subject.split(".")
        n = len(self._prefix_tokens)
        if tokens[:n] != self._prefix_tokens or len(tokens) < n + 2:
            return None
        kind, name, rest = tokens[n], tokens[n + 1], tokens[n + 2 :]
        if kind == "host" and rest and is_valid_token(name):
            return ReplyInbox(f"host:{name}", self.host_inbox_prefix(name))
        if kind == "ops" and not rest:
            return ReplyInbox("anonymous", self.anon_inbox_prefix())
        if kind == "ops" and is_valid_token(name):
            return ReplyInbox(f"user:{name}", self.ops_inbox_prefix(name))
        return None

    def reply_allowed(self, subject: str, reply: str) -> bool:
        """Whether a request on ``subject`` may be answered on ``reply``: only
        inside the requesting principal's own inbox (one token or more below its
        prefix, no wildcard)."""
        inbox = self.reply_inbox(subject)
        if inbox is None or not isinstance(reply, str):
            return False
        head = inbox.prefix + "."
        if not reply.startswith(head) or len(reply) == len(head):
            return False
        rest = reply[len(head) :].split(".")
        return all(t and t not in ("*", ">") and not any(c.isspace() for c in t) for t in rest)


def queue_group(channel: Channel) -> str:
    return QUEUES[Channel(channel)]
