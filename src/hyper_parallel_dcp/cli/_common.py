"""Shared pieces of the ``hp-dcp`` commands: exit codes, errors, output and progress."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence, TypeVar

__all__ = [
    "EXIT_OK",
    "EXIT_PROBLEM",
    "EXIT_USAGE",
    "UsageError",
    "existing_dir",
    "format_bytes",
    "print_json",
    "print_table",
    "progress",
]

#: Nothing wrong was found.
EXIT_OK = 0
#: The command ran and found a problem (incomplete or corrupt checkpoint, a difference, ...).
EXIT_PROBLEM = 1
#: The command line or an input file given on it is wrong (argparse uses 2 as well).
EXIT_USAGE = 2

T = TypeVar("T")


class UsageError(Exception):
    """A wrong argument: a path that does not exist, an invalid target spec, ...

    ``main`` prints the message and exits with :data:`EXIT_USAGE`.
    """


def existing_dir(path: str, what: str = "checkpoint") -> Any:
    """``path`` as a :class:`Path`, or as is when it is a URL (``s3://...``: the storage
    backend checks it); raises :class:`UsageError` when a path is not a directory or no
    backend handles the URL's scheme."""
    from hyper_parallel_dcp.core.backends import UnknownSchemeError, backend_for, url_scheme

    if url_scheme(path) != "file":
        try:
            backend_for(path)
        except UnknownSchemeError as exc:
            raise UsageError(str(exc)) from None
        return path
    from hyper_parallel_dcp.storage_fs.backend import local_path

    p = Path(local_path(path))
    if not p.exists():
        raise UsageError(f"{what} directory {p} does not exist")
    if not p.is_dir():
        raise UsageError(f"{what} path {p} is not a directory")
    return p


def format_bytes(n: float) -> str:
    """A short human size: ``512 B``, ``1.50 KiB``, ``3.00 GiB``."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            return f"{n:.2f} {unit}"
    raise AssertionError("unreachable")


def print_json(doc: Any) -> None:
    """One JSON object on stdout (sorted keys are left to the caller's dict order)."""
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[int] = ()) -> None:
    """A plain aligned text table; columns whose index is in ``right`` are right-aligned."""
    text_rows = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    print(line(list(headers)))
    for row in text_rows:
        print(line(row))


def progress(iterable: Iterable[T], *, total: Optional[int] = None, desc: str = "", unit: str = "it",
             enabled: bool = True) -> Iterator[T]:
    """Wrap ``iterable`` in a tqdm bar on stderr when stderr is a terminal.

    The bar never writes to stdout (``--json`` output stays parseable) and disappears when
    stderr is not a terminal or tqdm is not installed.
    """
    if not enabled or not sys.stderr.isatty():
        yield from iterable
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield from iterable
        return
    yield from tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
