"""Storage backends by URL scheme (``file`` for plain paths), registered by packages in the
``hyper_parallel_dcp.storage`` entry-point group: which writer/reader a ``checkpoint_id`` gets;
and the vocabulary of a checkpoint-manager root (``root/step_N``): :class:`StepStorage`, what
each backend provides as the ``steps`` of its :class:`StorageBackend`."""

from __future__ import annotations

import importlib
import os
import re
import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

if TYPE_CHECKING:
    from .storage import StorageReader, StorageWriter

__all__ = [
    "ENTRY_POINT_GROUP",
    "INFO_FILE",
    "Leftover",
    "StepEntry",
    "StepStorage",
    "StorageBackend",
    "UnknownSchemeError",
    "backend_for",
    "parse_step_name",
    "register_backend",
    "step_name",
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
    ``steps(root)`` (its :class:`StepStorage`; ``None`` where the scheme has none)."""

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


#: The manager's per-step JSON (step, time, metrics), written before the save commits.
INFO_FILE = "hp-dcp-step.json"
_STEP_DIR = re.compile(r"^step_(0|[1-9][0-9]*)$")


def step_name(step: int) -> str:
    """The directory name of ``step``: ``step_N``."""
    return f"step_{step}"


def parse_step_name(name: str) -> Optional[int]:
    """``N`` for a directory name ``step_N`` (canonical integer), else ``None``."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class StepEntry:
    """One ``step_N`` directory: where it is and whether its save committed ``.metadata``."""

    step: int
    location: str
    complete: bool


@dataclass(frozen=True)
class Leftover:
    """Something a dead save left: ``kind`` is ``staging``, ``old``, ``lock``, ``readlock``,
    ``mailbox`` (files inside a step directory) or ``incomplete`` (a whole step directory)."""

    step: int
    kind: str
    location: str
    bytes: int
    paths: tuple[str, ...] = field(default=())


class StepStorage(Protocol):
    """What the manager and ``hp-dcp ls``/``clean`` need from a root.  ``remove_step`` never leaves
    a half-deleted step that looks complete, and returns False while a save or a :meth:`reading` runs."""

    root: Any

    def check_root(self) -> None: ...
    def location(self, step: int) -> str: ...
    def list_steps(self) -> list[StepEntry]: ...
    def is_complete(self, step: int) -> bool: ...
    def completeness_problems(self, step: int) -> list[str]: ...
    def size_bytes(self, step: int) -> int: ...
    def saved_at(self, step: int) -> Optional[float]: ...
    def read_info(self, step: int) -> Optional[dict[str, Any]]: ...
    def write_info(self, step: int, info: dict[str, Any]) -> None: ...
    def remove_step(self, step: int) -> bool: ...
    def reading(self, step: int) -> AbstractContextManager[None]: ...
    def find_leftovers(self, *, protected: frozenset[int] = frozenset(), older_than: Optional[int] = None,
                       max_step: Optional[int] = None, grace: float = 0.0,
                       check_running: bool = True) -> list[Leftover]: ...
    def remove_leftover(self, item: Leftover) -> bool: ...
