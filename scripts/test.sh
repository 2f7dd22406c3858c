#!/usr/bin/env bash
# Lint, type-check and test amqp_locks, all inside the project's virtualenv.
#
#   bash scripts/test.sh                 # ruff + mypy + the whole pytest suite
#   bash scripts/test.sh -m 'not slow'   # extra arguments go to pytest
#   VENV=/path/to/venv bash scripts/test.sh
#
# Set up the virtualenv once with:
#   python3 -m venv .venv && .venv/bin/pip install -e '.[test]'
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"

if [ ! -x "$PY" ]; then
    echo "scripts/test.sh: no virtualenv at $VENV; create it with:" >&2
    echo "  python3 -m venv $VENV && $VENV/bin/pip install -e '.[test]'" >&2
    exit 1
fi

echo "+ ruff check amqp_locks tests"
"$PY" -m ruff check amqp_locks tests

echo "+ mypy amqp_locks"
"$PY" -m mypy amqp_locks

echo "+ pytest -q -ra $*"
status=0
"$PY" -m pytest -q -ra "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests (exit code 5); treating that as a failure" >&2
fi
exit "$status"
