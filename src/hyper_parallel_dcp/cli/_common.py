"""Shared pieces of the ``hp-dcp`` commands: exit codes, usage errors, output, progress bars."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TypeVar

from hyper_parallel_dcp.core.errors import format_bytes

__all__ = ["CLEAN_GRACE_S", "EXIT_OK", "EXIT_PROBLEM", "EXIT_USAGE", "UsageError", "existing_dir", "format_bytes",
           "print_json", "print_table", "progress", "progress_bar"]

#: Exit codes: nothing wrong found; a problem found (incomplete, corrupt, different, ...); a wrong
#: command line or input file (argparse uses 2 as well).
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

#: ``hp-dcp ls`` and ``clean`` leave alone what was modified this recently (a save may be writing it).
CLEAN_GRACE_S = 60.0

T = TypeVar("T")


class UsageError(Exception):
    """A wrong argument (a path that does not exist, an invalid target spec, ...):
    ``main`` prints the message and exits with :data:`EXIT_USAGE`."""


def existing_dir(path: str, what: str = "checkpoint") -> Any:
    """``path`` as a :class:`Path`, or as is when it is a URL (its backend checks it); :class:`UsageError`
    when a path is not a directory or no backend handles the URL's scheme."""
    from hyper_parallel_dcp.core.backends import UnknownSchemeError, backend_for, url_scheme
    from hyper_parallel_dcp.storage_fs.backend import local_path

    if url_scheme(path) != "file":
        try:
            backend_for(path)
        except UnknownSchemeError as exc:
            raise UsageError(str(exc)) from None
        return path
    p = Path(local_path(path))
    if not p.exists():
        raise UsageError(f"{what} directory {p} does not exist")
    if not p.is_dir():
        raise UsageError(f"{what} path {p} is not a directory")
    return p


def print_json(doc: Any) -> None:
    """One JSON object on stdout, keys in the order of ``doc``."""
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def print_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, right: Sequence[int] = ()) -> None:
    """A plain aligned text table; columns whose index is in ``right`` are right-aligned."""
    text_rows = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in text_rows]) for i, h in enumerate(headers)]
    for cells in [list(headers), *text_rows]:
        line = "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        print(line.rstrip())


def progress_bar(enabled: bool = True, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (``kwargs`` as tqdm's), or ``None`` when ``enabled`` is false,
    stderr is not a terminal or tqdm is missing: a bar never writes to stdout, so
    ``--json`` output stays parseable."""
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(file=sys.stderr, leave=False, dynamic_ncols=True, **kwargs)


def progress(iterable: Iterable[T], *, desc: str = "", unit: str = "it", enabled: bool = True) -> Iterator[T]:
    """``iterable``, counted on a :func:`progress_bar` when there is one (of ``len(iterable)`` where it has one)."""
    bar = progress_bar(enabled, iterable=iterable, desc=desc, unit=unit)
    return iter(iterable if bar is None else bar)
