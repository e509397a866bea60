"""Entry point: ``python -m hyper_parallel_dcp.benchmarks [--quick | --full] [--help]``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
