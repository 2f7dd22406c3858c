#!/usr/bin/env bash
# Set up (scripts/setup.sh), then run the demo: a private RabbitMQ node, a 3-slot semaphore,
# 8 worker processes contending for it while it is resized to 5 and then to 2.
#   bash scripts/demo.sh [--url amqp://…] [--workers N]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh >&2
exec "${VENV:-.venv}/bin/amqp-locks" demo "$@"
