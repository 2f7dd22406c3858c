"""The ``amqp-locks`` command line, run for real in subprocesses against a real broker.

Each test talks to the session's broker (``rabbitmq_url``) with ``--url`` and its own
``--namespace``; the ``broker`` round trip starts a node of its own in a temporary state dir.
Every subprocess call has a timeout, and every background process is killed on the way out.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from amqp_locks import PressureQueue, Semaphore, SemaphoreAdmin, errors
from amqp_locks.broker import RECORD_FILE, LocalBroker, LocalBrokerError

CLI = [sys.executable, "-m", "amqp_locks"]

#: Exit statuses documented in docs/cli.md.
OK, ERROR, USAGE, TIMEOUT, NOT_FOUND, BUSY, LOST, EXISTS, UNAVAILABLE = range(9)

Run = Callable[..., subprocess.CompletedProcess[str]]


def _env(state_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AMQP_URL"}
    env["AMQP_LOCKS_STATE_DIR"] = str(state_dir)  # never a developer's own `broker start`
    env.update(extra)
    return env


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def cli(rabbitmq_url: str, amqp_namespace: str, state_dir: Path) -> Run:
    """Run ``amqp-locks --url URL --namespace NS ARGS...``; returns the completed process."""

    def run(
        *args: str,
        timeout: float = 60,
        url: str | None = rabbitmq_url,
        input_text: str | None = None,
        **env: str,
    ) -> subprocess.CompletedProcess[str]:
        prefix = ["--namespace", amqp_namespace] + (["--url", url] if url else [])
        stdin: dict[str, Any] = (
            {"stdin": subprocess.DEVNULL} if input_text is None else {"input": input_text}
        )
        return subprocess.run(
            [*CLI, *prefix, *args],
            env=_env(state_dir, **env),
            **stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def name(rabbitmq_url: str, amqp_namespace: str) -> Iterator[str]:
    """A semaphore name for the test; destroyed afterwards."""
    yield "jobs"
    with SemaphoreAdmin("jobs", url=rabbitmq_url, namespace=amqp_namespace) as admin:
        admin.destroy()


@pytest.fixture
def create(rabbitmq_url: str, amqp_namespace: str, name: str) -> Callable[[int], None]:
    def make(slots: int) -> None:
        with SemaphoreAdmin(name, url=rabbitmq_url, namespace=amqp_namespace) as admin:
            admin.create(slots)

    return make


@pytest.fixture
def semaphore(rabbitmq_url: str, amqp_namespace: str, name: str) -> Iterator[Semaphore]:
    """The test's semaphore as a client in this process (to hold slots)."""
    sem = Semaphore(name, url=rabbitmq_url, namespace=amqp_namespace)
    yield sem
    sem.close()


def _json(proc: subprocess.CompletedProcess[str], code: int = OK) -> Any:
    """The JSON a command wrote, after checking its exit status (stderr shown on failure)."""
    assert proc.returncode == code, f"exit {proc.returncode}: {proc.stderr}"
    try:
        return json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"not JSON: {proc.stdout!r} (stderr: {proc.stderr!r})")


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The stderr of a failed command: exactly one ``amqp-locks: error:`` line."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("amqp-locks: error: "), proc.stderr
    return lines[0]


@pytest.fixture
def background(
    rabbitmq_url: str, amqp_namespace: str, state_dir: Path
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``amqp-locks [--url URL] --namespace NS ARGS...`` in the background (as ``cli``);
    every one still running is killed at teardown."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str, url: str | None = rabbitmq_url) -> subprocess.Popen[str]:
        prefix = ["--namespace", amqp_namespace] + (["--url", url] if url else [])
        proc = subprocess.Popen(
            [*CLI, *prefix, *args],
            env=_env(state_dir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def _wait_for_file(path: Path, proc: subprocess.Popen[str], within: float = 30) -> str:
    deadline = time.monotonic() + within
    while not path.exists() or not path.read_text():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    time.sleep(0.05)  # the writer may still be filling it
    return path.read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():  # a zombie nobody reaps (PID 1 in a container) is dead too
        try:
            return stat.read_text().rpartition(")")[2].split()[0] != "Z"
        except OSError:
            return False
    return True


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ------------------------------------------------------------------------------ entry points


def test_console_script_is_installed_next_to_the_interpreter() -> None:
    script = Path(sys.executable).parent / "amqp-locks"
    assert script.is_file(), f"{script} missing: pip install -e . installs it"
    proc = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=30, check=False
    )
    assert proc.returncode == OK
    assert proc.stdout.strip() == "amqp-locks 0.1.0"


def test_help_lists_commands_and_exit_codes() -> None:
    proc = subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == OK
    for word in ("create", "ensure", "resize", "status", "wait", "run", "broker", "demo"):
        assert word in proc.stdout
    assert "exit status" in proc.stdout and "lock lost" in proc.stdout


@pytest.mark.parametrize(
    "args",
    [
        [],
        ["frobnicate"],
        ["create", "x"],
        ["create", "x", "--slots", "0"],
        ["resize", "x", "many"],
        ["resize", "x", "2", "--timeout", "1"],  # --timeout without --wait
        ["wait", "x", "--timeout", "-1"],
        ["run", "x"],  # no command
        ["run", "x", "--timeout", "1", "--no-wait", "--", "true"],
        ["broker", "restart"],
    ],
    ids=lambda args: " ".join(args) or "nothing",
)
def test_bad_arguments_exit_2_with_usage(args: list[str]) -> None:
    proc = subprocess.run(
        [*CLI, *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == USAGE, proc.stderr
    assert proc.stderr.startswith("usage: amqp-locks")
    assert "error:" in proc.stderr
    assert proc.stdout == ""


def test_invalid_name_is_a_usage_error_in_one_line(cli: Run) -> None:
    proc = cli("status", "jobs-1-A")
    assert proc.returncode == USAGE
    assert "ends like a slot queue" in _error_line(proc)


# ---------------------------------------------------------------------------- administration


def test_admin_commands_text_output(cli: Run, name: str, amqp_namespace: str) -> None:
    base = amqp_namespace + name  # names are shown as on the broker, namespace included

    def ok(*args: str) -> str:
        proc = cli(*args)
        assert proc.returncode == OK, proc.stderr
        assert proc.stderr == ""
        return proc.stdout.strip()

    assert ok("create", name, "--slots", "2") == f"created semaphore {base!r} with 2 slots"
    assert ok("ensure", name, "--slots", "3") == f"{base!r} has 3 slots"
    assert ok("resize", name, "5") == f"{base!r} now has 5 slots"
    assert ok("add", name, "2") == f"{base!r} now has 7 slots"
    assert ok("remove", name, "6", "--wait", "--timeout", "5") == (
        f"{base!r} now has 1 slot (holders of removed slots have let go)"
    )
    assert ok("status", name) == f"{base!r}: 1 slot, 0 held, 1 free"
    assert ok("destroy", name) == f"destroyed semaphore {base!r}"
    proc = cli("status", name)
    assert proc.returncode == NOT_FOUND
    assert proc.stdout == ""


def test_admin_commands_json_output(cli: Run, name: str, amqp_namespace: str) -> None:
    def data(*args: str) -> Any:
        return _json(cli("--json", *args))

    base = amqp_namespace + name
    assert data("create", name, "--slots", "2") == {"name": base, "slots": 2}
    assert data("ensure", name, "--slots", "2") == {"name": base, "slots": 2}
    assert data("resize", name, "4") == {"name": base, "slots": 4}
    assert data("add", name, "1") == {"name": base, "slots": 5}
    assert data("remove", name, "2") == {"name": base, "slots": 3}
    status = data("status", name)
    assert status["exists"] is True
    assert (status["slots"], status["held"], status["free"]) == (3, [], 3)
    assert data("wait", name, "--timeout", "5") == {"name": base, "released": True, "slots": None}
    # --json also works after the command.
    proc = cli("destroy", name, "--json")
    assert _json(proc) == {"name": base, "destroyed": True, "existed": True}


def test_create_of_an_existing_semaphore_exits_7(cli: Run, name: str, create: Any) -> None:
    create(2)
    proc = cli("create", name, "--slots", "3")
    assert proc.returncode == EXISTS
    assert "already exists with 2 slot(s)" in _error_line(proc)


@pytest.mark.parametrize(
    "args",
    [
        ["resize", "{name}", "2"],
        ["add", "{name}", "1"],
        ["remove", "{name}", "1"],
        ["status", "{name}"],
        ["destroy", "{name}"],
        ["run", "{name}", "--", "true"],
    ],
    ids=lambda args: args[0],
)
def test_unknown_semaphore_exits_4(cli: Run, name: str, args: list[str]) -> None:
    proc = cli(*(a.format(name=name) for a in args))
    assert proc.returncode == NOT_FOUND, proc.stderr
    assert "does not exist" in _error_line(proc)


def test_destroy_missing_ok(cli: Run, name: str) -> None:
    proc = cli("destroy", name, "--missing-ok")
    assert proc.returncode == OK, proc.stderr


def test_status_json_of_unknown_semaphore_still_prints_data(cli: Run, name: str) -> None:
    proc = cli("status", name, "--json")
    assert proc.returncode == NOT_FOUND
    assert _json(proc, NOT_FOUND)["exists"] is False


def test_unreachable_broker_exits_8_in_one_line_and_v_shows_traceback(cli: Run) -> None:
    url = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2F"
    proc = cli("status", "jobs", "--connect-timeout", "2", url=url)
    assert proc.returncode == UNAVAILABLE
    assert "could not connect" in _error_line(proc)
    assert "guest:***@" in proc.stderr  # the password is masked
    verbose = cli("-v", "status", "jobs", "--connect-timeout", "2", url=url)
    assert verbose.returncode == UNAVAILABLE
    assert "Traceback" in verbose.stderr


def test_url_comes_from_amqp_url_and_the_option_wins(
    cli: Run, name: str, create: Any, rabbitmq_url: str
) -> None:
    create(1)
    assert cli("status", name, url=None, AMQP_URL=rabbitmq_url).returncode == OK
    closed = f"amqp://guest:guest@127.0.0.1:{_closed_port()}/%2F"
    assert cli("status", name, AMQP_URL=closed).returncode == OK  # --url given by cli()
    proc = cli("status", name, "--connect-timeout", "2", url=None, AMQP_URL=closed)
    assert proc.returncode == UNAVAILABLE


def test_status_shows_held_slots_without_management(
    cli: Run, name: str, create: Any, semaphore: Semaphore
) -> None:
    create(3)
    first, second = semaphore.acquire(timeout=5), semaphore.acquire(timeout=5)
    second.release()
    nowhere = f"http://127.0.0.1:{_closed_port()}/"
    proc = cli("status", name, "--management-url", nowhere)
    assert proc.returncode == OK, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith(": 3 slots, 1 held, 2 free")
    assert lines[1] == f"  slot {first.slot}: held"
    assert "holders unknown: management API" in lines[2]
    data = _json(cli("status", name, "--json", "--management-url", nowhere))
    assert (data["held"], data["free"]) == ([1], 2)
    assert data["holders"] == [{"slot": 1}]
    assert data["management"]["available"] is False
    first.release()


def test_wait_for_holders_of_removed_slots(
    cli: Run, name: str, create: Any, semaphore: Semaphore
) -> None:
    create(2)
    semaphore.acquire(timeout=5)
    top = semaphore.acquire(timeout=5)
    assert top.slot == 2
    proc = cli("remove", name, "1", "--wait", "--timeout", "0.3")
    assert proc.returncode == TIMEOUT
    assert "slots [2]" in _error_line(proc) and "still held" in proc.stderr
    proc = cli("wait", name, "--timeout", "0.3")
    assert proc.returncode == TIMEOUT
    assert "still held after 0.3 s" in _error_line(proc)
    assert cli("wait", name, "--slot", "2", "--timeout", "0.3").returncode == TIMEOUT
    top.release()
    proc = cli("wait", name, "--timeout", "10")
    assert proc.returncode == OK, proc.stderr
    assert proc.stdout.strip() == f"no holder left on the removed slots of {top.name!r}"


def test_progress_is_shown_on_a_terminal(
    name: str,
    create: Any,
    semaphore: Semaphore,
    rabbitmq_url: str,
    amqp_namespace: str,
    state_dir: Path,
) -> None:
    create(1)
    lease = semaphore.acquire(timeout=5)
    options = ["--url", rabbitmq_url, "--namespace", amqp_namespace]
    master, slave = pty.openpty()
    try:
        proc = subprocess.run(
            [*CLI, *options, "wait", name, "--slot", "1", "--timeout", "2.5"],
            env=_env(state_dir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=slave,
            text=True,
            timeout=30,
        )
        os.close(slave)
        slave = -1
        seen = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the terminal's other side is closed
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
        lease.release()
    assert proc.returncode == TIMEOUT
    assert b"\rwaiting for the holders of slot 1 of" in seen
    assert b"\xe2\x80\xa6 2 s" in seen  # "… 2 s": rewritten every second


# -------------------------------------------------------------------------------------- run


def test_run_passes_the_exit_status_and_the_slot_through(cli: Run, name: str, create: Any) -> None:
    create(1)
    code = "import os, sys; print(os.environ['AMQP_LOCKS_SLOT']); sys.exit(42)"
    proc = cli("run", name, "--timeout", "5", "--", *_py(code))
    assert proc.returncode == 42, proc.stderr
    assert proc.stdout == "1\n"
    assert proc.stderr == ""
    assert cli("run", name, "--", "true").returncode == OK
    killed = cli("run", name, "--", *_py("import os, signal; os.kill(os.getpid(), 9)"))
    assert killed.returncode == 128 + signal.SIGKILL
    missing = cli("run", name, "--", "no-such-command-here")
    assert missing.returncode == 127
    assert "command not found" in _error_line(missing)


def test_run_no_wait_when_busy_exits_5_and_timeout_exits_3(
    cli: Run, name: str, create: Any, semaphore: Semaphore, tmp_path: Path
) -> None:
    create(1)
    lease = semaphore.acquire(timeout=5)
    marker = tmp_path / "ran"
    touch = ["touch", str(marker)]
    proc = cli("run", name, "--no-wait", "--", *touch)
    assert proc.returncode == BUSY
    assert "every slot" in _error_line(proc)
    started = time.monotonic()
    proc = cli("run", name, "--timeout", "0.5", "--", *touch)
    assert proc.returncode == TIMEOUT
    assert time.monotonic() - started < 15
    assert "became free within 0.5 s" in _error_line(proc)
    assert not marker.exists()
    lease.release()
    assert cli("run", name, "--no-wait", "--", *touch).returncode == OK
    assert marker.exists()


@pytest.mark.parametrize("obeys_sigterm", [True, False], ids=["sigterm", "sigkill"])
def test_run_terminates_the_command_when_the_slot_is_lost(
    cli: Run,
    name: str,
    create: Any,
    background: Any,
    amqp_namespace: str,
    tmp_path: Path,
    obeys_sigterm: bool,
) -> None:
    create(1)
    pids = tmp_path / "pids"
    # The command starts a grandchild too: both must die (the whole process group).
    code = (
        "import os, signal, subprocess, sys, time\n"
        + ("" if obeys_sigterm else "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n")
        + "child = subprocess.Popen(['sleep', '120'])\n"
        + f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
        + "time.sleep(120)\n"
    )
    proc = background("run", name, "--verify-interval", "0.2", "--grace", "1", "--", *_py(code))
    command_pid, grandchild_pid = map(int, _wait_for_file(pids, proc).split())

    assert cli("remove", name, "1").returncode == OK
    started = time.monotonic()
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == LOST, err
    assert time.monotonic() - started < 10
    assert f"lost slot 1 of semaphore {amqp_namespace + name!r}" in err
    assert "terminating" in err and "with SIGTERM" in err
    assert ("SIGKILL" in err) is not obeys_sigterm
    deadline = time.monotonic() + 10
    while (_alive(command_pid) or _alive(grandchild_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(command_pid)
    assert not _alive(grandchild_pid)


@pytest.mark.slow
def test_run_terminates_the_command_when_the_connection_dies(
    local_broker: LocalBroker, amqp_namespace: str, background: Any, tmp_path: Path
) -> None:
    url = local_broker.url
    with SemaphoreAdmin("jobs", url=url, namespace=amqp_namespace) as admin:
        admin.create(1)
    ready = tmp_path / "ready"
    code = f"open({str(ready)!r}, 'w').write('x')\nimport time; time.sleep(120)"
    proc = background("run", "jobs", "--", *_py(code), url=url)
    _wait_for_file(ready, proc)

    local_broker.restart()  # closes every client connection: the holder's slot is gone

    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == LOST, err
    assert "lost slot 1 of semaphore" in err and "connection" in err
    with SemaphoreAdmin("jobs", url=url, namespace=amqp_namespace) as admin:
        admin.destroy()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
def test_run_forwards_signals_to_the_command(
    name: str, create: Any, background: Any, tmp_path: Path, signum: int
) -> None:
    create(1)
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(42))\n"
        "signal.signal(signal.SIGINT, lambda *_: sys.exit(43))\n"
        f"open({str(ready)!r}, 'w').write('ready')\n"
        "time.sleep(60)\n"
    )
    proc = background("run", name, "--", *_py(code))
    _wait_for_file(ready, proc)
    proc.send_signal(signum)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == (42 if signum == signal.SIGTERM else 43), err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_run_command_dies_with_amqp_locks(
    name: str, create: Any, background: Any, tmp_path: Path
) -> None:
    # Killed amqp-locks = connection closed = slot freed: COMMAND must not run on unprotected.
    create(1)
    pid_file = tmp_path / "pid"
    code = f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    proc = background("run", name, "--", *_py(code))
    command_pid = int(_wait_for_file(pid_file, proc))
    proc.kill()
    proc.communicate(timeout=30)  # returns once the command is gone too (it holds the pipes)
    deadline = time.monotonic() + 10
    while _alive(command_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(command_pid)


def test_run_waits_for_a_slot_then_runs(
    name: str, create: Any, semaphore: Semaphore, background: Any
) -> None:
    create(1)
    lease = semaphore.acquire(timeout=5)
    proc = background("run", name, "--timeout", "30", "--", *_py("print('ran')"))
    time.sleep(1.0)
    assert proc.poll() is None  # still waiting for the slot
    lease.release()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == OK, err
    assert out == "ran\n"


# ----------------------------------------------------------------------------------- broker


def test_broker_commands_when_none_runs(state_dir: Path) -> None:
    def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, "broker", *args],
            env=_env(state_dir, **env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )

    status = run("status", "--json")
    assert status.returncode == UNAVAILABLE
    assert _json(status, UNAVAILABLE) == {"running": False, "state_dir": str(state_dir)}
    url = run("url")
    assert url.returncode == UNAVAILABLE
    assert "amqp-locks broker start" in _error_line(url)
    assert run("stop").returncode == OK  # nothing to stop is fine
    # No Docker engine answers at a socket that does not exist.
    docker = run("start", "--backend", "docker", DOCKER_HOST="unix:///nonexistent.sock")
    assert docker.returncode == UNAVAILABLE
    assert "Docker" in _error_line(docker)


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs /proc to tell pids apart")
def test_a_stale_broker_record_never_signals_a_recycled_pid(tmp_path: Path) -> None:
    # `broker stop`/`status` trust LocalBroker.attach(): a record whose pid now belongs to
    # another process (here: this one) must read as "not running", and stop() must spare it.
    node_dir = tmp_path / "node"
    node_dir.mkdir()
    record = {"version": 1, "node_name": "ghost@localhost", "pid": os.getpid()}
    record.update(amqp_port=1, dist_port=2, management_port=None, server=None)
    (node_dir / RECORD_FILE).write_text(json.dumps(record))
    broker = LocalBroker.attach(node_dir)
    assert broker.url == "amqp://guest:guest@127.0.0.1:1/%2F"
    assert not broker.is_running()
    assert broker.pid is None
    broker.stop()  # we are still alive to check:
    assert not (node_dir / RECORD_FILE).exists()
    with pytest.raises(LocalBrokerError, match="no LocalBroker record"):
        LocalBroker.attach(node_dir)


def _node_processes(node_name: str) -> list[int]:
    needle = f"RABBITMQ_NODENAME={node_name}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _alive(int(entry)):
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if needle in environ.split(b"\0"):
                found.append(int(entry))
    return found


@pytest.mark.slow
@pytest.mark.skipif(not LocalBroker.available(), reason="rabbitmq-server is not installed")
@pytest.mark.skipif(not Path("/proc/self").exists(), reason="checks processes in /proc")
def test_broker_round_trip_outlives_the_command(
    state_dir: Path, amqp_namespace: str, background: Any, tmp_path: Path
) -> None:
    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args],
            env=_env(state_dir),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    node_name = None
    try:
        start = run("broker", "start")
        assert start.returncode == OK, start.stderr
        url = start.stdout.strip()
        assert url.startswith("amqp://guest:guest@127.0.0.1:")
        status = _json(run("broker", "status", "--json"))
        node_name = status["node"]
        assert status["running"] is True and status["url"] == url
        assert status["management_url"].startswith("http://127.0.0.1:")
        assert run("broker", "url").stdout.strip() == url
        again = run("broker", "start", timeout=30)  # already running: just the URL
        assert again.returncode == OK and again.stdout.strip() == url

        # With neither --url nor $AMQP_URL, commands use this broker (and `status` finds its
        # management API): proven by a holder whose connection the broker names.
        ns = ["--namespace", amqp_namespace]
        assert run(*ns, "create", "dev", "--slots", "1").returncode == OK
        ready = tmp_path / "ready"
        code = f"open({str(ready)!r}, 'w').write('x')\nimport time; time.sleep(60)"
        holder = background("run", "dev", "--", *_py(code), url=None)
        _wait_for_file(ready, holder)
        # The management API lists a new connection after its next stats tick (5 s).
        deadline = time.monotonic() + 20
        while True:
            shown = run(*ns, "--url", url, "status", "dev", "--json")
            data = _json(shown)
            if "connection" in data["holders"][0] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert data["held"] == [1]
        assert data["management"]["available"] is True
        host = socket.gethostname()
        assert data["holders"] == [
            {
                "slot": 1,
                "holder": f"{host}:{holder.pid}:MainThread",
                "connection": f"amqp_locks {host}:{holder.pid}",
                "peer": data["holders"][0]["peer"],
            }
        ]
        assert data["holders"][0]["peer"].startswith("127.0.0.1:")
        holder.kill()
        holder.communicate(timeout=30)

        stop = run("broker", "stop")
        assert stop.returncode == OK, stop.stderr
        assert run("broker", "status").returncode == UNAVAILABLE
        assert _node_processes(node_name) == []
        assert not (state_dir / "node").exists()
    finally:
        # Best effort, and never hiding the test's own failure: leave nothing running.
        with contextlib.suppress(Exception):
            LocalBroker.attach(state_dir / "node").stop()
        if node_name is not None:
            for pid in _node_processes(node_name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------------- demo


@pytest.mark.slow
def test_demo_runs_end_to_end(cli: Run) -> None:
    proc = cli("demo", "--workers", "3", "--phase-seconds", "0.5", timeout=120)
    assert proc.returncode == OK, proc.stdout + proc.stderr
    assert "invariant (never more holders than slots, never two per slot): held" in proc.stdout


# ------------------------------------------------------------------------ pressure queues

CLOSED = 9


@pytest.fixture
def queue_cli(cli: Run, amqp_namespace: str, rabbitmq_url: str) -> Iterator[Run]:
    """``amqp-locks queue ACTION NAME --prefix <test namespace> ...``; deletes it afterwards."""
    prefix = amqp_namespace.rstrip(".")

    def run(action: str, name: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return cli("queue", action, name, *args, "--prefix", prefix, **kw)

    yield run
    with (
        PressureQueue("pipe", url=rabbitmq_url, prefix=prefix) as q,
        contextlib.suppress(errors.QueueDoesNotExistError),
    ):
        q.delete(timeout=10)


def test_queue_commands_round_trip(queue_cli: Run) -> None:
    r = queue_cli("create", "pipe", "--bound", "2")
    assert r.returncode == OK, r.stderr
    assert "bound 2" in r.stdout
    assert queue_cli("create", "pipe").returncode == EXISTS
    r = queue_cli("put", "pipe", "a", "b")
    assert (r.returncode, r.stdout.strip()) == (OK, "put 2 item(s)"), r.stderr
    r = queue_cli("put", "pipe", "c", "--timeout", "0.3")
    assert r.returncode == TIMEOUT and "0.3 s" in r.stderr
    status = json.loads(queue_cli("status", "pipe", "--json").stdout)
    assert status["length"] == 2 and status["bound"] == 2 and not status["closed"]
    assert status["stats"]["produced_messages"] == 2
    r = queue_cli("get", "pipe")
    assert (r.returncode, r.stdout) == (OK, "a\n")
    r = queue_cli("put", "pipe", "--close", input_text="x\n")
    assert r.returncode == OK, r.stderr
    r = queue_cli("get", "pipe", "--all")
    assert (r.returncode, r.stdout) == (OK, "b\nx\n")
    r = queue_cli("get", "pipe")
    assert r.returncode == CLOSED and "closed" in r.stderr
    assert queue_cli("close", "pipe").returncode == CLOSED
    assert queue_cli("put", "pipe", "z").returncode == CLOSED
    status = json.loads(queue_cli("status", "pipe", "--json").stdout)
    assert status["closed"] and status["stats"]["consumed_messages"] == 3
    assert queue_cli("delete", "pipe").returncode == OK
    assert queue_cli("status", "pipe").returncode == NOT_FOUND
    assert queue_cli("delete", "pipe").returncode == NOT_FOUND
    assert queue_cli("delete", "pipe", "--missing-ok").returncode == OK


def test_queue_bad_arguments_exit_2(queue_cli: Run) -> None:
    assert queue_cli("create", "pipe", "--bound", "-1").returncode == USAGE
    r = queue_cli("create", "pipe:space")
    assert r.returncode == USAGE and "rename" in r.stderr
    assert queue_cli("get", "pipe").returncode == NOT_FOUND
