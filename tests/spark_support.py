"""What the PySpark test modules share: a local-mode SparkSession whose Python workers run
this interpreter (the one with amqp_locks installed), and a stand-in for a SparkConf.

PySpark is imported only inside :func:`local_session`, so importing this module never needs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest


class FakeConf:
    """Stands in for a SparkConf (``get(key, default)``)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


def require_java() -> None:
    """Skip without Java, except under $CI, where a missing Java is a failure."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        message = "PySpark needs Java (as root: apt-get install -y default-jre-headless)"
        if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
            pytest.fail(message + " ($CI is set: refusing to skip)", pytrace=False)
        pytest.skip(message)


@contextlib.contextmanager
def local_session(master: str, app: str, conf: dict[str, str]) -> Iterator[Any]:
    """A SparkSession on ``master`` (``local[...]``) with ``conf``; stopped, and the
    environment restored, on exit."""
    require_java()
    from pyspark.sql import SparkSession

    env = {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    builder = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.pyspark.python", sys.executable)
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
    )
    for key, value in conf.items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
