"""The files of a checkpoint location (a directory, a bucket prefix): :class:`CheckpointFiles`,
:class:`LocalFiles`, :func:`as_checkpoint_files` and :class:`RangeReader`."""

from __future__ import annotations

import abc
import io
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Union

__all__ = ["CheckpointFiles", "LocalFiles", "Location", "RangeReader", "as_checkpoint_files"]


class RangeReader(io.RawIOBase):
    """A read-only, seekable file of ``length`` bytes; ``read_at(position, view)`` fills as
    much of the memoryview as it can from that position and returns how many bytes it read."""

    def __init__(self, length: int, read_at: Callable[[int, memoryview], int]) -> None:
        self.length, self.read_at, self.pos = length, read_at, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        if n:
            n = self.read_at(self.pos, view[:n])
            self.pos += n
        return n


class CheckpointFiles(abc.ABC):
    """One location and its direct entries; ``target`` is what ``save``/``load`` take (a
    :class:`Path` or a URL), ``str(self)`` names it in messages."""

    target: Union[Path, str]

    @abc.abstractmethod
    def exists(self) -> bool:
        """The location exists (a directory; any object under a prefix)."""

    @abc.abstractmethod
    def entries(self) -> list[tuple[str, Optional[int]]]:
        """Direct entries: ``(name, size)`` for files, ``(name, None)`` for sub-locations."""

    @abc.abstractmethod
    def size(self, name: str) -> Optional[int]:
        """Size of file ``name``, ``None`` when it does not exist."""

    @abc.abstractmethod
    def open(self, name: str) -> BinaryIO:
        """A seekable binary reader of file ``name`` (``FileNotFoundError`` when missing)."""

    @abc.abstractmethod
    def child(self, name: str) -> CheckpointFiles:
        """The sub-location ``name``."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Delete the location and everything under it."""

    def read(self, name: str) -> bytes:
        with self.open(name) as f:
            return f.read()

    def where(self, name: str) -> str:
        """How a file is named in messages."""
        return f"{self}/{name}"

    def total_size(self) -> int:
        """Bytes of every file under the location (recursively)."""
        return sum(n if n is not None else self.child(name).total_size() for name, n in self.entries())

    def __str__(self) -> str:
        return str(self.target)


class LocalFiles(CheckpointFiles):
    """A directory."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        self.path = Path(path)
        self.target = self.path

    def exists(self) -> bool:
        return self.path.is_dir()

    def entries(self) -> list[tuple[str, Optional[int]]]:
        out: list[tuple[str, Optional[int]]] = []
        for entry in os.scandir(self.path):
            if entry.is_dir():
                out.append((entry.name, None))
            else:
                try:
                    out.append((entry.name, entry.stat().st_size))
                except FileNotFoundError:
                    continue
        return out

    def size(self, name: str) -> Optional[int]:
        try:
            st = (self.path / name).stat()
        except FileNotFoundError:
            return None
        return None if not Path(self.path / name).is_file() else st.st_size

    def open(self, name: str) -> BinaryIO:
        return open(self.path / name, "rb")

    def read(self, name: str) -> bytes:
        return (self.path / name).read_bytes()

    def child(self, name: str) -> LocalFiles:
        return LocalFiles(self.path / name)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def where(self, name: str) -> str:
        return str(self.path / name)


#: a checkpoint's location as callers give it: a path, a URL, or its files
Location = Union[str, os.PathLike, CheckpointFiles]


def as_checkpoint_files(location: Location) -> CheckpointFiles:
    """``location`` as :class:`CheckpointFiles`: as is, or through its URL scheme's backend;
    ``UnknownSchemeError`` for a scheme without one."""
    if isinstance(location, CheckpointFiles):
        return location
    from hyper_parallel_dcp.core.backends import backend_for

    backend = backend_for(location)
    if backend.files is None:
        raise ValueError(f"the storage backend for {os.fspath(location)!r} cannot list or read files")
    return backend.files(location)
