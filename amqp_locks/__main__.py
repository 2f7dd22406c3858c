"""``python -m amqp_locks``: the ``amqp-locks`` command line (see docs/cli.md)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
