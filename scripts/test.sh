#!/usr/bin/env bash
# Set up (scripts/setup.sh), then lint, type-check and test amqp_locks in the virtualenv.
#
#   bash scripts/test.sh                 # ruff + mypy + the whole pytest suite
#   bash scripts/test.sh -m 'not slow'   # extra arguments go to pytest
#   VENV=/path/to/venv bash scripts/test.sh
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"

echo "+ ruff check amqp_locks tests examples benchmarks"
"$PY" -m ruff check amqp_locks tests examples benchmarks

echo "+ mypy amqp_locks"
"$PY" -m mypy amqp_locks

echo "+ pytest -q -ra $*"
status=0
"$PY" -m pytest -q -ra "$@" || status=$?
if [ "$status" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests (exit code 5); treating that as a failure" >&2
fi
exit "$status"
