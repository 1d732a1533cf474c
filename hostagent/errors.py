"""The agent's errors: the fatal ones :meth:`Agent.run` raises, and how a
broker's refusal of the host's authorization is recognised."""

from __future__ import annotations

from nats.errors import AuthorizationError as NatsAuthorizationError
from nats.errors import Error as NatsError

__all__ = [
    "Aborted",
    "AgentError",
    "BrokerRefused",
    "RegistrationRefused",
    "is_authorization_refusal",
]


class AgentError(Exception):
    """The agent cannot continue."""

    code = "internal"

    def __init__(self, message: str | None = None) -> None:
        self.message = message or (self.__doc__ or "agent error").strip()
        super().__init__(self.message)


class RegistrationRefused(AgentError):
    """The control plane refused this host's credential."""

    def __init__(self, host_id: str, code: str, detail: str) -> None:
        self.host_id = host_id
        self.remote_code = code
        super().__init__(
            f"registration of host {host_id!r} refused by the control plane ({code}: {detail}); "
            "check --host-id and --token-file (the credential must be the one issued for "
            "this host by `fleetlease host add`)"
        )
        # Exit code mapping of the CLI: unauthorized/forbidden -> 3.
        self.code = "forbidden" if code == "forbidden" else "unauthorized"


class BrokerRefused(AgentError):
    """The NATS server keeps refusing this host's authorization."""

    code = "unauthorized"

    def __init__(self, host_id: str, detail: str, refused_for_s: float) -> None:
        self.host_id = host_id
        self.refused_for_s = refused_for_s
        super().__init__(
            f"the NATS server refuses host {host_id!r} ({detail.strip()}, for "
            f"{refused_for_s:.0f}s): the host was revoked or is unknown to the control "
            "plane, or --token-file is not its credential"
        )


def is_authorization_refusal(exc: BaseException) -> bool:
    """Whether a nats-py error means the server refused the connect's
    authorization (not a network error)."""
    if isinstance(exc, NatsAuthorizationError):
        return True
    return isinstance(exc, NatsError) and "authorization violation" in str(exc).lower()


class Aborted(Exception):
    """An attempt's wait was cut short because its lease was lost."""
