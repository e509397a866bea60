"""Atomic file writes (temp name ending in :data:`TMP_SUFFIX`, fsync, rename) for every
writer of the project: a reader sees the old file or the complete new one."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import BinaryIO, Callable, Union

from .layout import TMP_SUFFIX

__all__ = ["TMP_SUFFIX", "PendingFile", "fsync_dir", "write_file_atomic", "write_file_pending"]


def write_file_atomic(path: Union[str, os.PathLike], write: Callable[[BinaryIO], object], sync: bool = True, *,
                      unique_temp: bool = False) -> int:
    """Write ``path`` through ``write(f)`` into a temp file (the process id in its name with
    ``unique_temp``), fsync it (``sync``), rename it over ``path``; returns its size.  On
    failure the temp file is removed and an ``OSError`` re-raised naming ``path``."""
    pending = write_file_pending(path, write, unique_temp=unique_temp)
    pending.finish(sync)
    return pending.size


class PendingFile:
    """A file written under its temp name, still open, not yet in place: :meth:`finish`
    fsyncs it (or not), closes it and renames it over its path; :meth:`discard` removes it."""

    def __init__(self, path: Path, tmp: Path, file: BinaryIO, size: int) -> None:
        self.path = path
        self.tmp = tmp
        self.size = size
        self._file = file

    def finish(self, sync: bool = True) -> None:
        """fsync (``sync``), close and rename into place; fails as :func:`write_file_atomic`."""
        try:
            if sync:
                os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp, self.path)
        except BaseException as exc:
            self.discard()
            _raise_naming(exc, self.path)
            raise

    def discard(self) -> None:
        """Close and remove the temp file (nothing of it stays)."""
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def write_file_pending(path: Union[str, os.PathLike], write: Callable[[BinaryIO], object], *,
                       unique_temp: bool = False) -> PendingFile:
    """The first half of :func:`write_file_atomic`: the temp file written through
    ``write(f)``, as a :class:`PendingFile`; fails as :func:`write_file_atomic` does."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}" if unique_temp else path.name + TMP_SUFFIX)
    f = None
    try:
        f = open(tmp, "wb")
        write(f)
        f.flush()
        return PendingFile(path, tmp, f, f.tell())
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the write's own error is the one to report
            if f is not None:
                f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        _raise_naming(exc, path)
        raise


def _raise_naming(exc: BaseException, path: Path) -> None:
    if isinstance(exc, OSError) and exc.errno is not None:
        raise type(exc)(exc.errno, f"writing checkpoint file {path} failed: {exc.strerror}") from exc


def fsync_dir(path: Union[str, os.PathLike]) -> None:
    """fsync the directory ``path``, so that renames and new names in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
