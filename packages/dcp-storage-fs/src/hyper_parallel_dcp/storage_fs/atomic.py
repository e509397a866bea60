"""Atomic file writes shared by every writer of the project.

One atomic write — temp name, fsync, rename — for the checkpoint files, the Hugging Face
export and the async mailbox: a reader of ``path`` sees the old file or the complete new
one, never a part.  Temp files end in :data:`TMP_SUFFIX`, so a commit or a cleanup
recognises what a killed writer left behind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO, Callable, Union

__all__ = ["TMP_SUFFIX", "fsync_dir", "write_file_atomic"]

TMP_SUFFIX = ".hp-dcp-tmp"


def write_file_atomic(path: Union[str, os.PathLike], write: Callable[[BinaryIO], object], sync: bool = True, *,
                      unique_temp: bool = False) -> int:
    """Write ``path`` through ``write(f)`` into a temp file, fsync it (``sync``), rename it
    over ``path``; returns the file's size.

    ``unique_temp`` puts the process id into the temp name, for a file that several
    processes may write at once (the last rename wins).  On any failure the temp file is
    removed and ``path`` is untouched; an ``OSError`` (disk full, quota, I/O error) is
    re-raised as one of the same class whose message names ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TMP_SUFFIX}" if unique_temp else path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.errno is not None:
            raise type(exc)(exc.errno, f"writing checkpoint file {path} failed: {exc.strerror}") from exc
        raise
    return size


def fsync_dir(path: Union[str, os.PathLike]) -> None:
    """fsync the directory ``path``, so that renames and new names in it are durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
