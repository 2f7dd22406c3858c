"""Child processes for the failure-injection tests (tests/test_concurrency.py,
tests/test_pressure_failures.py): started with ``spawn``, talking to the test only through
files, and always killed and reaped, even when a test fails."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

SPAWN = multiprocessing.get_context("spawn")


@contextlib.contextmanager
def children() -> Iterator[list[Any]]:
    """A list to append started processes to; all are killed and reaped on exit."""
    procs: list[Any] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.pid is not None and proc.exitcode is None:
                # Not reaped yet, so the pid is still ours. A stopped child needs SIGCONT to die
                # promptly of anything but SIGKILL; SIGKILL works either way.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(10)


def start(procs: list[Any], target: Callable[..., None], *args: Any) -> Any:
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


def join_all(procs: Sequence[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [proc.pid for proc in procs if proc.exitcode is None]
    assert not hung, f"child processes {hung} still running after {timeout} s"


def read_json(path: Path) -> Any:
    assert path.exists(), f"worker wrote no report {path.name}"
    return json.loads(path.read_text())


def wait_paths(paths: list[Path], timeout: float, procs: Sequence[Any] = ()) -> None:
    """Wait until every path in ``paths`` exists; fail early if a worker died first."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        dead = [p.pid for p in procs if p.exitcode is not None]
        if dead and not all(p.exists() for p in paths):
            folder = paths[0].parent
            reports = {
                f.name: f.read_text()[:3000]
                for f in folder.iterdir()
                if f.suffix == ".json" or "out" in f.name
            }
            pytest.fail(f"workers {dead} exited before getting ready; reports: {reports}")
        assert time.monotonic() < deadline, "workers did not get ready in time"
        time.sleep(0.01)
