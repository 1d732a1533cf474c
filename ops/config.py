"""Configuration: flag > environment > context file (written by ``fleetlease up``)
> embedded default."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ENV_DATABASE_URL = "FLEETLEASE_DATABASE_URL"
ENV_NATS_URL = "FLEETLEASE_NATS_URL"
ENV_STATE_DIR = "FLEETLEASE_STATE_DIR"
ENV_PREFIX = "FLEETLEASE_PREFIX"
ENV_TOKEN = "FLEETLEASE_TOKEN"
ENV_USER = "FLEETLEASE_USER"
ENV_JS_REPLICAS = "FLEETLEASE_JS_REPLICAS"
ENV_BROKER_SECURITY = "FLEETLEASE_BROKER_SECURITY"
DEFAULT_PREFIX = "fleetlease"


class ConfigError(Exception):
    """The configuration is unusable (an unwritable state dir, a bad URL)."""


def default_state_dir() -> Path:
    return Path(os.environ.get(ENV_STATE_DIR) or "~/.local/share/fleetlease").expanduser()


@dataclass(frozen=True, kw_only=True)
class Settings:
    state_dir: Path
    database_url: str | None = None
    nats_url: str | None = None
    prefix: str = DEFAULT_PREFIX
    token: str | None = None
    #: The user the token belongs to: the NATS identity on a secured broker.
    user: str | None = None
    debug: bool = False

    @property
    def context_path(self) -> Path:
        return self.state_dir / "context.json"

    def with_context(self) -> Settings:
        """Fill what flags and environment left unset from the context file."""
        ctx = read_context(self.state_dir)
        if not ctx:
            return self
        token, user = self.token, self.user
        if token is None and ctx.get("admin_token_path"):
            try:
                token = Path(ctx["admin_token_path"]).read_text().strip() or None
            except OSError:
                token = None
            admin = ctx.get("admin_user")
            if token is not None and user is None and isinstance(admin, str):
                user = admin  # the context's token is the admin's
        return replace(
            self,
            database_url=self.database_url or ctx.get("database_url"),
            nats_url=self.nats_url or ctx.get("nats_url"),
            prefix=self.prefix if self.prefix != DEFAULT_PREFIX else ctx.get("prefix", self.prefix),
            token=token,
            user=user,
        )


def from_args(args: Any) -> Settings:
    state_dir = Path(getattr(args, "state_dir", None) or default_state_dir()).expanduser()
    return Settings(
        state_dir=state_dir,
        database_url=getattr(args, "database_url", None)
        or os.environ.get(ENV_DATABASE_URL)
        or None,
        nats_url=getattr(args, "nats_url", None) or os.environ.get(ENV_NATS_URL) or None,
        prefix=getattr(args, "prefix", None) or os.environ.get(ENV_PREFIX) or DEFAULT_PREFIX,
        token=_token(args),
        user=getattr(args, "user", None) or os.environ.get(ENV_USER) or None,
        debug=bool(getattr(args, "debug", False)),
    )


def _token(args: Any) -> str | None:
    """``--token``, else ``FLEETLEASE_TOKEN``; an empty one stays empty (a usage
    error for the commands that need a token), never "unset": it must not fall
    back to the context file's admin token."""
    flag = getattr(args, "token", None)
    if flag is not None:
        return str(flag)
    return os.environ.get(ENV_TOKEN)


def ensure_state_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        probe = path / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"state dir {path} is not writable: {exc.strerror or exc}") from exc
    return path


def read_context(state_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((state_dir / "context.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_context(state_dir: Path, data: dict[str, Any]) -> Path:
    path = state_dir / "context.json"
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)
    return path


def js_replicas(flag: int | str | None, env: Any = None) -> int:
    """The JetStream replica count: ``--js-replicas``, else
    ``FLEETLEASE_JS_REPLICAS``, else 1. Raises ``ConfigError`` unless it is an
    integer from 1 to 5 (JetStream's largest replica count)."""
    text = flag if flag is not None else (os.environ if env is None else env).get(ENV_JS_REPLICAS)
    if text is None or text == "":
        return 1
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--js-replicas must be an integer from 1 to 5, got {text!r}") from None
    if not 1 <= value <= 5:
        raise ConfigError(f"--js-replicas must be an integer from 1 to 5, got {value}")
    return value


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def broker_security(flag: bool, env: Any = None) -> bool:
    """``serve --broker-security``, else ``FLEETLEASE_BROKER_SECURITY`` (1, true,
    yes, on; 0, false, no, off or empty), else off. Raises ``ConfigError`` on
    any other value."""
    if flag:
        return True
    text = (os.environ if env is None else env).get(ENV_BROKER_SECURITY)
    value = (text or "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{ENV_BROKER_SECURITY} must be 1 or 0 (true/false), got {text!r}")
