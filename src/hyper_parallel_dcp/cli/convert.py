"""``hp-dcp convert``: the Hugging Face conversion commands of ``hp-dcp-convert``."""

from __future__ import annotations

import sys
from typing import Any, Sequence

from ._common import EXIT_USAGE

__all__ = ["run"]


def run_convert(argv: Sequence[str]) -> int:
    """Hand ``argv`` to ``hyper_parallel_dcp.offline_transform.cli.main``; its exit code is ours.

    Exits 2 with an install hint when the conversion package is not installed.
    """
    try:
        from hyper_parallel_dcp.offline_transform.cli import main as convert_main
    except ImportError:
        print("hp-dcp convert needs the conversion package: pip install hyper-parallel-dcp-hf-convert",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        code = convert_main(list(argv))
    except SystemExit as exc:  # argparse inside the converter exits
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return int(code or 0)


def run(args: Any) -> int:
    return run_convert(args.convert_args)
