"""Storage backends by URL scheme (``file`` for plain paths), registered by packages in the
``hyper_parallel_dcp.storage`` entry-point group: which writer/reader a ``checkpoint_id`` gets."""

from __future__ import annotations

import importlib
import os
import re
import threading
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

if TYPE_CHECKING:
    from .storage import StorageReader, StorageWriter

__all__ = [
    "ENTRY_POINT_GROUP",
    "StorageBackend",
    "UnknownSchemeError",
    "backend_for",
    "register_backend",
    "storage_reader_for",
    "storage_writer_for",
    "url_scheme",
]

ENTRY_POINT_GROUP = "hyper_parallel_dcp.storage"
#: Scheme → the distribution that provides it, for the "install this" message.
_PROVIDERS = {
    "file": "hyper-parallel-dcp-storage-fs",
    "s3": "hyper-parallel-dcp-storage-object (pip install 'hyper-parallel-dcp[s3]')",
}
#: Schemes no package provides, and what to do instead.
_NOT_PROVIDED = {
    "gs": "Google Cloud Storage has no native backend; its S3-compatible XML API may serve through the "
          "s3:// backend (AWS_ENDPOINT_URL=https://storage.googleapis.com, HMAC keys in AWS_ACCESS_KEY_ID / "
          "AWS_SECRET_ACCESS_KEY, then s3://BUCKET/...), untested by this project",
    "gcs": "use s3:// through Google Cloud Storage's S3-compatible XML API (see gs://), untested by this project",
    "az": "Azure Blob Storage has no backend here (it has no S3 API); save to a local or mounted path "
          "(e.g. blobfuse2) instead",
    "abfs": "Azure Blob Storage has no backend here (see az://)",
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

CheckpointId = Union[str, os.PathLike]


class UnknownSchemeError(ValueError):
    """A ``checkpoint_id`` URL whose scheme no installed package handles."""


@dataclass(frozen=True)
class StorageBackend:
    """What a storage package registers for a scheme: ``writer(checkpoint_id)``,
    ``reader(checkpoint_id, verify=...)``, ``files(location)`` (its ``CheckpointFiles``) and
    ``steps(root)`` (its ``core.steps.StepStorage``; ``None`` where the scheme has none)."""

    scheme: str
    writer: Callable[[CheckpointId], StorageWriter]
    reader: Callable[..., StorageReader]
    files: Optional[Callable[[CheckpointId], Any]] = None
    steps: Optional[Callable[[CheckpointId], Any]] = None


_registry: dict[str, StorageBackend] = {}
# the group's entry points by lower-case name, listed once, each imported when first asked for
_entry_points: Optional[dict[str, list[Any]]] = None
# local paths go to the filesystem backend without listing every entry point first
_BUNDLED = {"file": ("hyper_parallel_dcp.storage_fs.backend", "BACKEND")}
# scheme -> why its installed backend could not be imported (for the error message)
_failures: dict[str, str] = {}
_lock = threading.Lock()


def url_scheme(checkpoint_id: CheckpointId) -> str:
    """The lower-case URL scheme of ``checkpoint_id``; ``"file"`` for a plain path."""
    match = _SCHEME.match(os.fspath(checkpoint_id)) if isinstance(checkpoint_id, str) else None
    return match.group(1).lower() if match else "file"


def register_backend(backend: StorageBackend) -> None:
    """Register (or replace) the backend for ``backend.scheme`` in this process."""
    with _lock:
        _registry[backend.scheme.lower()] = backend


def _load_backend(scheme: str) -> Optional[StorageBackend]:
    """The backend an installed package registered for ``scheme``, imported now (only that one);
    ``None`` when there is none or it fails to import (why is kept in ``_failures``)."""
    global _entry_points
    bundled = _BUNDLED.get(scheme)
    if bundled is not None:
        try:
            backend = getattr(importlib.import_module(bundled[0]), bundled[1])
        except ImportError:
            pass  # not installed: an entry point may still provide the scheme
        else:
            with _lock:
                return _registry.setdefault(scheme, backend)
    if _entry_points is None:
        with _lock:
            if _entry_points is None:
                found: dict[str, list[Any]] = {}
                for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
                    found.setdefault(ep.name.lower(), []).append(ep)
                _entry_points = found
    for ep in _entry_points.get(scheme, ()):
        try:
            backend = ep.load()
        except Exception as exc:  # noqa: BLE001 - reported by backend_for, naming the entry point
            _failures[scheme] = f"{ep.value}: {type(exc).__name__}: {exc}"
            continue
        with _lock:
            return _registry.setdefault(scheme, backend)
    return None


def backend_for(checkpoint_id: CheckpointId) -> StorageBackend:
    """The registered backend for ``checkpoint_id``'s scheme; raises :class:`UnknownSchemeError`
    naming the scheme and its package (or the error the installed package raised on import).
    """
    scheme = url_scheme(checkpoint_id)
    backend = _registry.get(scheme) or _load_backend(scheme)
    if backend is None:
        failure = _failures.get(scheme)
        if failure is not None:
            raise UnknownSchemeError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: the installed storage backend "
                                     f"for '{scheme}://' failed to import ({failure})")
        if scheme in _NOT_PROVIDED:
            raise UnknownSchemeError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: hyper-parallel-dcp has no "
                                     f"storage backend for '{scheme}://'; {_NOT_PROVIDED[scheme]}")
        provider = _PROVIDERS.get(scheme)
        hint = f"install {provider}" if provider else "no hyper-parallel-dcp package supports it"
        raise UnknownSchemeError(f"checkpoint_id {os.fspath(checkpoint_id)!r}: no storage backend for "
                                 f"'{scheme}://' is installed; {hint}")
    return backend


def storage_writer_for(checkpoint_id: Optional[CheckpointId], storage_writer: Optional[StorageWriter],
                       *, caller: str = "save") -> StorageWriter:
    """``storage_writer`` (reset to ``checkpoint_id`` when both are given), else the backend's
    writer; raises ``ValueError`` when neither is given, :class:`UnknownSchemeError`."""
    if storage_writer is None:
        if checkpoint_id is None:
            raise ValueError(f"{caller} needs checkpoint_id or storage_writer")
        return backend_for(checkpoint_id).writer(checkpoint_id)
    if checkpoint_id is not None:
        storage_writer.reset(checkpoint_id)
    return storage_writer


def storage_reader_for(checkpoint_id: Optional[CheckpointId], storage_reader: Optional[StorageReader],
                       *, verify: Optional[bool] = None, caller: str = "load") -> StorageReader:
    """``storage_reader`` (reset to ``checkpoint_id``, ``verify`` set when given), else the
    backend's reader; raises ``ValueError`` when neither is given or the reader has no
    ``verify``, :class:`UnknownSchemeError`."""
    if storage_reader is None:
        if checkpoint_id is None:
            raise ValueError(f"{caller} needs checkpoint_id or storage_reader")
        return backend_for(checkpoint_id).reader(checkpoint_id, verify=verify)
    if checkpoint_id is not None:
        storage_reader.reset(checkpoint_id)
    if verify is not None:
        if not hasattr(storage_reader, "verify"):
            raise ValueError(f"verify={verify} given but {type(storage_reader).__name__} has no 'verify' setting")
        storage_reader.verify = verify  # type: ignore[attr-defined]
    return storage_reader

