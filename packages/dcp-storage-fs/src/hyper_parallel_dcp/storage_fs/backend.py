"""The filesystem backend of the scheme registry (:data:`BACKEND`): plain paths and
``file://`` URLs; reader and writer load on first use."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional, Union

from hyper_parallel_dcp.core.backends import StorageBackend

from .files import LocalFiles

if TYPE_CHECKING:
    from hyper_parallel_dcp.core.storage import StorageReader, StorageWriter

__all__ = ["BACKEND", "local_files", "local_path", "local_storage_reader", "local_storage_writer"]


def local_path(checkpoint_id: Union[str, os.PathLike]) -> str:
    """``checkpoint_id`` as a filesystem path (``file:///a/b`` → ``/a/b``)."""
    text = os.fspath(checkpoint_id)
    if isinstance(text, str) and text[:7].lower() == "file://":
        return text[7:]
    return str(text)


def local_storage_writer(checkpoint_id: Union[str, os.PathLike]) -> StorageWriter:
    from .writer import FileSystemWriter  # on first use (see the module docstring)

    return FileSystemWriter(local_path(checkpoint_id))


def local_storage_reader(checkpoint_id: Union[str, os.PathLike], *, verify: Optional[bool] = None) -> StorageReader:
    """The :class:`~.torch_dcp.DirectoryReader` of a local checkpoint directory (ours or torch DCP)."""
    from .torch_dcp import DirectoryReader  # on first use (see the module docstring)

    path = local_path(checkpoint_id)
    return DirectoryReader(path) if verify is None else DirectoryReader(path, verify=verify)


def local_files(location: Union[str, os.PathLike]) -> LocalFiles:
    return LocalFiles(local_path(location))


BACKEND = StorageBackend("file", local_storage_writer, local_storage_reader, local_files)
