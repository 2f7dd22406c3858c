#!/usr/bin/env bash
# Set up everything amqp_locks needs on a fresh Debian/Ubuntu machine (idempotent):
#   1. installs rabbitmq-server if it is missing (the demo and the tests start private
#      throwaway nodes from it; the system service the package may start is left alone);
#   2. installs a headless Java runtime if `java` is missing (PySpark needs one for the
#      amqp_locks.spark tests);
#   3. creates the virtualenv .venv (or $VENV) and installs the project with its test and spark
#      extras (AMQP_LOCKS_EXTRAS=test for a lighter install without PySpark, ~450 MB less).
# Used by scripts/demo.sh and scripts/test.sh; safe to run again.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

export DEBIAN_FRONTEND=noninteractive
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PIP_NO_INPUT=1

have_rabbitmq_server() {
    # Debian's /usr/sbin/rabbitmq-server is a wrapper; the real scripts are here.
    [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || command -v rabbitmq-server >/dev/null 2>&1
}

is_root() {
    [ "$(id -u)" -eq 0 ]
}

apt_install() {
    # Fresh cloud machines often run unattended-upgrades at boot: wait for the dpkg lock.
    apt-get -o DPkg::Lock::Timeout=600 update
    apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "$@"
}

if ! have_rabbitmq_server; then
    if ! is_root; then
        cat >&2 <<'MSG'
.ci/run: rabbitmq-server is not installed and this is not root, so it cannot be installed here.
Install it as root, then run .ci/run again:
    sudo apt-get update && sudo apt-get install -y rabbitmq-server      # Debian/Ubuntu
(The tests start private RabbitMQ nodes from it; the system service is not used.)
MSG
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo ".ci/run: rabbitmq-server is missing and there is no apt-get: install RabbitMQ" \
            "(rabbitmq-server and Erlang) with this system's package manager." >&2
        exit 1
    fi
    echo "+ installing rabbitmq-server"
    if ! apt_install rabbitmq-server; then
        # The package's postinst starts the system service; where no init system runs, that
        # step can fail although the server is unpacked. Private nodes only need the files.
        if have_rabbitmq_server; then
            echo ".ci/run: warning: apt-get reported an error configuring rabbitmq-server," \
                "but the server is installed; continuing" >&2
        else
            echo ".ci/run: installing rabbitmq-server failed" >&2
            exit 1
        fi
    fi
fi

EXTRAS="${AMQP_LOCKS_EXTRAS:-test,spark}"

have_java() {
    command -v java >/dev/null 2>&1 || { [ -n "${JAVA_HOME:-}" ] && [ -x "$JAVA_HOME/bin/java" ]; }
}

case ",$EXTRAS," in
*,spark,*)
    if ! have_java; then
        if is_root && command -v apt-get >/dev/null 2>&1; then
            echo "+ installing default-jre-headless (PySpark needs Java)"
            # Slim Debian images lack the man directory the JRE's postinst links into.
            mkdir -p /usr/share/man/man1
            apt_install default-jre-headless
        else
            echo ".ci/run: warning: no java on PATH: the PySpark tests (tests/test_spark.py) will" \
                "be skipped (or fail under \$CI); as root on Debian/Ubuntu:" \
                "apt-get install -y default-jre-headless" >&2
        fi
    fi
    ;;
esac

if ! command -v python3 >/dev/null 2>&1 || ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
    if is_root && command -v apt-get >/dev/null 2>&1; then
        echo "+ installing python3 and python3-venv"
        apt_install python3 python3-venv
    else
        echo ".ci/run: need python3 (>= 3.10) with the venv module; as root on Debian/Ubuntu:" \
            "apt-get install -y python3 python3-venv" >&2
        exit 1
    fi
fi

python3 -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' || {
    echo ".ci/run: python3 >= 3.10 is required, found $(python3 --version 2>&1)" >&2
    exit 1
}

VENV="${VENV:-.venv}"
stamp="$VENV/.amqp_locks-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "+ python3 -m venv $VENV"
    python3 -m venv "$VENV"
fi
# The stamp records the extras installed: changing them (or pyproject.toml) reinstalls.
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$(cat "$stamp")" != "$EXTRAS" ]; then
    echo "+ pip install -e '.[$EXTRAS]'"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
    echo "$EXTRAS" >"$stamp"
fi
