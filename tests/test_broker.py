"""Tests of amqp_locks.broker.LocalBroker against real private RabbitMQ nodes.

The quick tests share the session's ``local_broker`` (from the amqp_locks pytest plugin);
the ones marked ``slow`` start nodes of their own (a few seconds each).
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pika
import pika.exceptions
import pytest

from amqp_locks import broker as broker_mod
from amqp_locks.broker import LocalBroker, LocalBrokerError

needs_server = pytest.mark.skipif(
    not LocalBroker.available(),
    reason="rabbitmq-server is not installed (as root: apt-get install -y rabbitmq-server)",
)


def _connect(url: str) -> pika.BlockingConnection:
    params = pika.URLParameters(url)
    params.socket_timeout = 5
    params.blocked_connection_timeout = 30
    return pika.BlockingConnection(params)


def _node_pids(node_name: str) -> list[int]:
    """Live processes started for ``node_name`` (found by RABBITMQ_NODENAME in their env)."""
    needle = f"RABBITMQ_NODENAME={node_name}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry))
    return pids


def _assert_no_node_processes(node_name: str, within: float = 10.0) -> None:
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + within
    while (pids := _node_pids(node_name)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids == [], f"processes of {node_name} still alive: {pids}"


def _assert_connection_dies(conn: pika.BlockingConnection, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    with pytest.raises(pika.exceptions.AMQPConnectionError):
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.2)
    assert not conn.is_open


def _message_count(url: str, queue: str) -> int:
    conn = _connect(url)
    try:
        frame = conn.channel().queue_declare(queue, passive=True)
        return int(frame.method.message_count)
    finally:
        conn.close()


def _publish_durable(url: str, queue: str, body: bytes) -> None:
    conn = _connect(url)
    try:
        ch = conn.channel()
        ch.queue_declare(queue, durable=True)
        ch.confirm_delivery()
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2), mandatory=True)
    finally:
        conn.close()


# ---------------------------------------------------------------- shared broker (fast)


def test_url_ports_and_node_name(local_broker: LocalBroker) -> None:
    assert local_broker.is_running()
    assert local_broker.url == f"amqp://guest:guest@127.0.0.1:{local_broker.amqp_port}/%2F"
    assert re.fullmatch(r"amqp_locks_\d+_[0-9a-f]{8}@localhost", local_broker.node_name)
    assert local_broker.amqp_port != 5672  # never the system broker's port
    assert local_broker.dist_port not in (local_broker.amqp_port, 25672)
    assert local_broker.management_url is None
    assert local_broker.state_dir is not None and local_broker.state_dir.is_dir()
    assert "running" in repr(local_broker)


def test_accepts_pika_connection_and_queue_declare(
    local_broker: LocalBroker, amqp_namespace: str
) -> None:
    conn = _connect(local_broker.url)
    try:
        ch = conn.channel()
        queue = amqp_namespace + "q"
        ch.queue_declare(queue, exclusive=True)
        ch.basic_publish("", queue, b"hello")
        deadline = time.monotonic() + 5
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        while method is None and time.monotonic() < deadline:
            time.sleep(0.02)
            method, _props, body = ch.basic_get(queue, auto_ack=True)
        assert body == b"hello"
    finally:
        conn.close()


def _listen_addresses(port: int) -> list[str]:
    """Hex local addresses of LISTEN sockets on ``port`` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, _, port_hex = fields[1].rpartition(":")
            if int(port_hex, 16) == port and fields[3] == "0A":
                found.append(address)
    return found


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs Linux /proc/net/tcp")
def test_listens_on_loopback_only(local_broker: LocalBroker) -> None:
    for port in (local_broker.amqp_port, local_broker.dist_port):
        assert _listen_addresses(port) == ["0100007F"]  # 127.0.0.1, nothing else


def test_restart_keeps_durable_queue_and_closes_connections(
    local_broker: LocalBroker, amqp_namespace: str
) -> None:
    durable = amqp_namespace + "durable"
    _publish_durable(local_broker.url, durable, b"survives")
    conn = _connect(local_broker.url)
    conn.channel().queue_declare(amqp_namespace + "exclusive", exclusive=True)
    url_before = local_broker.url

    local_broker.restart()

    assert local_broker.is_running()
    assert local_broker.url == url_before
    _assert_connection_dies(conn)
    assert _message_count(local_broker.url, durable) == 1
    fresh = _connect(local_broker.url)
    try:
        ch = fresh.channel()
        # The exclusive queue died with its connection: a mandatory publish comes back.
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish("", amqp_namespace + "exclusive", b"", mandatory=True)
        ch.queue_delete(durable)
    finally:
        fresh.close()


def test_restart_of_a_stopped_broker_fails() -> None:
    with pytest.raises(LocalBrokerError, match="not running"):
        LocalBroker().restart()


# ---------------------------------------------------------------- lookup (no server needed)


def test_missing_rabbitmq_server_gives_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(broker_mod, "_FALLBACK_DIRS", ())
    assert broker_mod.find_rabbitmq_server() is None
    assert not LocalBroker.available()

    broker = LocalBroker()
    with pytest.raises(LocalBrokerError) as info:
        broker.start()
    message = str(info.value)
    assert "apt-get install -y rabbitmq-server" in message
    assert "Docker" in message
    assert "AMQP_URL" in message
    assert not broker.is_running()
    assert broker.state_dir is None  # no temporary directory was left behind
    broker.stop()  # still fine


def test_lookup_skips_debian_su_wrapper(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Debian: /usr/sbin/rabbitmq-server -> /usr/lib/rabbitmq/bin/rabbitmq-script-wrapper, which
    # runs the real script as the rabbitmq user without our environment.
    libbin = tmp_path / "lib" / "bin"
    sbin = tmp_path / "sbin"
    libbin.mkdir(parents=True)
    sbin.mkdir()
    for name in ("rabbitmq-script-wrapper", "rabbitmq-server", "rabbitmqctl"):
        (libbin / name).write_text("#!/bin/sh\n")
        (libbin / name).chmod(0o755)
    (sbin / "rabbitmq-server").symlink_to(libbin / "rabbitmq-script-wrapper")
    monkeypatch.setenv("PATH", str(sbin))
    monkeypatch.setattr(broker_mod, "_FALLBACK_DIRS", ())
    assert broker_mod.find_rabbitmq_server() == libbin / "rabbitmq-server"


def test_node_name_and_port_validation() -> None:
    assert LocalBroker(node_name="demo").node_name == "demo@localhost"
    with pytest.raises(ValueError):
        LocalBroker(node_name="bad name@localhost")
    with pytest.raises(ValueError):
        LocalBroker(amqp_port=70000)


def test_amqp_namespace_is_unique_and_safe(amqp_namespace: str) -> None:
    assert re.fullmatch(r"t-[A-Za-z0-9_-]{1,40}-[0-9a-f]{8}\.", amqp_namespace)
    assert "test_amqp_namespace_is_unique" in amqp_namespace


# ---------------------------------------------------------------- own nodes (slow)


@pytest.mark.slow
@needs_server
def test_two_brokers_at_once_and_stop_is_idempotent() -> None:
    first = LocalBroker(management=True)
    second = LocalBroker()
    errors: list[BaseException] = []

    def start(broker: LocalBroker) -> None:
        try:
            broker.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(b,)) for b in (first, second)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert errors == []
        assert first.node_name != second.node_name
        ports_first = {first.amqp_port, first.dist_port, first.management_port}
        ports_second = {second.amqp_port, second.dist_port}
        assert len(ports_first) == 3
        assert ports_first.isdisjoint(ports_second)
        for broker in (first, second):
            conn = _connect(broker.url)
            conn.channel().queue_declare("", exclusive=True)
            conn.close()

        assert first.management_url == f"http://127.0.0.1:{first.management_port}/"
        request = urllib.request.Request(first.management_url + "api/overview")
        request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        with urllib.request.urlopen(request, timeout=10) as response:
            overview = json.load(response)
        assert overview["node"] == first.node_name

        state_dir = first.state_dir
        assert state_dir is not None and state_dir.is_dir()
        first.stop()
        assert not first.is_running()
        assert first.pid is None
        assert not state_dir.exists()  # a temporary state dir is removed
        _assert_no_node_processes(first.node_name)
        first.stop()  # idempotent
        first.kill()  # also harmless
        assert second.is_running()  # the other node is unaffected
        _connect(second.url).close()
    finally:
        first.stop()
        second.stop()
    _assert_no_node_processes(second.node_name)


@pytest.mark.slow
@needs_server
def test_kill_then_start_recovers_durable_data(tmp_path: Path) -> None:
    state = tmp_path / "state"
    broker = LocalBroker(state)
    try:
        with broker:
            _publish_durable(broker.url, "kept", b"x")
            conn = _connect(broker.url)
            url = broker.url

            broker.kill()

            assert not broker.is_running()
            _assert_no_node_processes(broker.node_name)
            _assert_connection_dies(conn)
            broker.start()  # same node name, data and ports
            assert broker.url == url
            assert _message_count(broker.url, "kept") == 1
        assert not broker.is_running()
        assert state.is_dir()  # a caller's state dir is kept
        assert (state / "server-output.log").is_file()
    finally:
        broker.stop()


@pytest.mark.slow
@needs_server
def test_failed_start_raises_with_log_and_leaves_no_processes() -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        broker = LocalBroker(amqp_port=port)
        try:
            with pytest.raises(LocalBrokerError) as info:
                broker.start(timeout=60)
            assert "failed to start" in str(info.value)
            assert "eaddrinuse" in str(info.value)  # from the log tail
            assert not broker.is_running()
            _assert_no_node_processes(broker.node_name)
        finally:
            broker.stop()
    assert broker.state_dir is None
