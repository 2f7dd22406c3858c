"""Connection settings shared by both drivers: URL resolution, identity, timeouts."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from .errors import InvalidArgumentError

__all__ = ["DEFAULT_URL", "ConnectionSettings", "resolve_url"]

DEFAULT_URL = "amqp://guest:guest@localhost:5672/%2F"


def resolve_url(url: str | None) -> str:
    """``url`` if given, else ``$AMQP_URL``, else the local default broker."""
    if url is None:
        url = os.environ.get("AMQP_URL") or DEFAULT_URL
    if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
        raise InvalidArgumentError(
            f"broker URL must be a str starting with amqp:// or amqps://, got {url!r}"
        )
    return url


def redact(url: str) -> str:
    """``url`` with its password masked, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def default_client_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _positive(value: object, what: str, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgumentError(f"{what} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach the broker and how closely to watch the connection.

    ``heartbeat`` is short by default (10 s) so that a holder that froze or lost its network
    loses its slots to the broker within about two heartbeats, rather than the server's 60 s.
    """

    url: str
    heartbeat: int = 10
    connect_timeout: float = 5.0
    #: Longest wait for any single broker answer before the connection is declared broken.
    operation_timeout: float = 30.0
    #: Period of re-verifying held leases (A and B queues still there); None: the heartbeat.
    verify_interval: float | None = None
    client_id: str = ""

    @classmethod
    def build(
        cls,
        url: str | None,
        *,
        heartbeat: int = 10,
        connect_timeout: float = 5.0,
        operation_timeout: float = 30.0,
        verify_interval: float | None = None,
        client_id: str | None = None,
    ) -> ConnectionSettings:
        if isinstance(heartbeat, bool) or not isinstance(heartbeat, int) or heartbeat < 1:
            raise InvalidArgumentError(
                f"heartbeat must be an int >= 1 (seconds), got {heartbeat!r}"
            )
        _positive(connect_timeout, "connect_timeout")
        _positive(operation_timeout, "operation_timeout")
        _positive(verify_interval, "verify_interval", allow_none=True)
        if client_id is not None and (not isinstance(client_id, str) or not client_id):
            raise InvalidArgumentError(f"client_id must be a non-empty str, got {client_id!r}")
        return cls(
            url=resolve_url(url),
            heartbeat=heartbeat,
            connect_timeout=float(connect_timeout),
            operation_timeout=float(operation_timeout),
            verify_interval=verify_interval,
            client_id=client_id or default_client_id(),
        )

    @property
    def url_for_humans(self) -> str:
        """The URL with its password masked, for messages and logs."""
        return redact(self.url)

    @property
    def connection_name(self) -> str:
        return f"amqp_locks {self.client_id}"

    @property
    def verify_period(self) -> float:
        return float(self.verify_interval if self.verify_interval is not None else self.heartbeat)


def check_timeout(timeout: object, what: str = "timeout") -> float | None:
    """Validate a user timeout: None (forever) or a number >= 0."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise InvalidArgumentError(f"{what} must be None or a number >= 0, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)
