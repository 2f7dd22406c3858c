"""The examples run as users would run them: a script, the broker URL in $AMQP_URL."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


def _spark_example(script: Path) -> bool:
    return script.name.startswith("spark_")


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, marks=[pytest.mark.spark, pytest.mark.slow] if _spark_example(p) else [])
        for p in EXAMPLES
    ],
    ids=lambda p: p.name,
)
def test_example_runs(script: Path, rabbitmq_url: str) -> None:
    if _spark_example(script):  # PySpark examples: skipped as tests/test_spark.py is
        pytest.importorskip("pyspark")
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            message = "PySpark needs Java (as root: apt-get install -y default-jre-headless)"
            if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
                pytest.fail(message + " ($CI is set: refusing to skip)", pytrace=False)
            pytest.skip(message)
    env = {**os.environ, "AMQP_URL": rabbitmq_url}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3
