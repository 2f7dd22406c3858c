"""The examples run as users would run them: a script, the broker URL in $AMQP_URL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, rabbitmq_url: str) -> None:
    env = {**os.environ, "AMQP_URL": rabbitmq_url}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3
