"""pytest plugin giving tests a RabbitMQ broker (pytest11 entry point ``amqp_locks``).

Fixtures:

``rabbitmq_url`` (session)
    AMQP URL of a broker for the whole session, the first that applies of:

    1. ``$AMQP_URL`` if set (nothing is started or stopped);
    2. a ``rabbitmq:3.13-management`` container via testcontainers, if a Docker engine answers
       a ping within a few seconds;
    3. a private :class:`~amqp_locks.broker.LocalBroker` node, if ``rabbitmq-server`` is
       installed.

    Set ``AMQP_LOCKS_TEST_BROKER=local`` or ``=docker`` to force 3 or 2 (``$AMQP_URL`` still
    wins). With no broker at all, tests using it are skipped -- or fail when ``$CI`` is set,
    so a CI job cannot pass without running them.

``local_broker`` (session)
    A :class:`~amqp_locks.broker.LocalBroker` of its own (never the ``rabbitmq_url`` broker),
    for tests that restart, stop or kill the broker. Skipped (also under ``$CI``) when
    ``rabbitmq-server`` is not installed. It is shared by the session: a test that stops or
    kills it must ``start()`` it again (for example in a ``finally``) before it returns.

``amqp_namespace`` (function)
    A unique prefix for queue and exchange names, ``t-<test name, 40 chars max>-<8 hex>.``,
    so tests (and parallel sessions on one broker) never collide.

Example::

    def test_declare(rabbitmq_url, amqp_namespace):
        conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        conn.channel().queue_declare(amqp_namespace + "jobs", exclusive=True)
        conn.close()
"""

from __future__ import annotations

import importlib
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NoReturn

import pytest

from amqp_locks import redact_url
from amqp_locks.broker import LocalBroker, find_rabbitmq_server

__all__ = ["RABBITMQ_IMAGE", "amqp_namespace", "local_broker", "rabbitmq_url"]

#: Image used when a Docker engine is available. Pinned: keep in step with CI.
RABBITMQ_IMAGE = "rabbitmq:3.13-management"

_DOCKER_PING_TIMEOUT = 3.0
_BACKEND_ENV = "AMQP_LOCKS_TEST_BROKER"


@dataclass(frozen=True)
class _BrokerChoice:
    kind: Literal["env", "docker", "local", "none"]
    description: str
    url: str | None = None


_choice_key = pytest.StashKey[_BrokerChoice]()


def _docker_reachable(timeout: float = _DOCKER_PING_TIMEOUT) -> bool:
    """True if a Docker engine answers a ping within ``timeout`` seconds."""
    try:
        docker = importlib.import_module("docker")
    except ImportError:
        docker = None
    if docker is not None:
        try:
            client = docker.from_env(timeout=timeout)
        except Exception:
            return False
        try:
            return bool(client.ping())
        except Exception:
            return False
        finally:
            client.close()
    if shutil.which("docker") is None:
        return False
    try:
        subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return True


def _choose_broker(config: pytest.Config) -> _BrokerChoice:
    """Decide (once per session) where ``rabbitmq_url`` comes from."""
    cached = config.stash.get(_choice_key, None)
    if cached is not None:
        return cached
    url = os.environ.get("AMQP_URL", "").strip()
    forced = os.environ.get(_BACKEND_ENV, "").strip().lower()
    server = find_rabbitmq_server()
    choice: _BrokerChoice
    if url:
        choice = _BrokerChoice("env", f"$AMQP_URL = {redact_url(url)}", url)
    elif forced not in ("", "auto", "docker", "local"):
        choice = _BrokerChoice("none", f"unknown ${_BACKEND_ENV}={forced!r} (docker|local)")
    elif forced != "local" and _docker_reachable():
        choice = _BrokerChoice("docker", f"testcontainers {RABBITMQ_IMAGE} (Docker engine found)")
    elif forced != "docker" and server is not None:
        choice = _BrokerChoice("local", f"private LocalBroker node ({server})")
    elif forced == "docker":
        choice = _BrokerChoice("none", f"${_BACKEND_ENV}=docker but no Docker engine answers")
    else:
        choice = _BrokerChoice(
            "none",
            "no broker: set AMQP_URL, run a Docker engine, or install rabbitmq-server "
            "(as root on Debian/Ubuntu: apt-get install -y rabbitmq-server)",
        )
    config.stash[_choice_key] = choice
    return choice


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say which broker ``rabbitmq_url`` uses and whether ``local_broker`` can run."""
    choice = _choose_broker(config)
    server = find_rabbitmq_server()
    local = f"LocalBroker ({server})" if server else "skipped (rabbitmq-server not installed)"
    return [
        f"amqp_locks: rabbitmq_url -> {choice.description}",
        f"amqp_locks: local_broker -> {local}",
    ]


def _no_broker(reason: str) -> NoReturn:
    message = f"amqp_locks: {reason}"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(message + " ($CI is set: refusing to skip broker tests)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def rabbitmq_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """AMQP URL of the session's broker: ``$AMQP_URL``, a Docker container or a LocalBroker."""
    choice = _choose_broker(request.config)
    if choice.kind == "env":
        assert choice.url is not None
        yield choice.url
    elif choice.kind == "docker":
        yield from _docker_broker_url()
    elif choice.kind == "local":
        with LocalBroker() as broker:
            yield broker.url
    else:
        _no_broker(choice.description)


def _docker_broker_url() -> Iterator[str]:
    from testcontainers.community.rabbitmq import RabbitMqContainer

    container = RabbitMqContainer(
        RABBITMQ_IMAGE, port=5672, username="guest", password="guest", vhost="/"
    )
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(5672)
        yield f"amqp://guest:guest@{host}:{port}/%2F"
    finally:
        container.stop()


@pytest.fixture(scope="session")
def local_broker() -> Iterator[LocalBroker]:
    """A private LocalBroker node for tests that restart, stop or kill the broker."""
    if not LocalBroker.available():
        pytest.skip(
            "amqp_locks: local_broker needs rabbitmq-server installed "
            "(as root on Debian/Ubuntu: apt-get install -y rabbitmq-server)"
        )
    with LocalBroker() as broker:
        yield broker


@pytest.fixture
def amqp_namespace(request: pytest.FixtureRequest) -> str:
    """A unique name prefix for this test: ``t-<test name>-<8 hex>.``."""
    name = re.sub(r"[^A-Za-z0-9_]+", "-", request.node.name).strip("-")[:40].strip("-")
    return f"t-{name or 'test'}-{secrets.token_hex(4)}."
