"""Storage backends by URL scheme (``file`` for plain paths), registered by packages in the
``hyper_parallel_dcp.storage`` entry-point group: which writer/reader a ``checkpoint_id`` gets;
and the vocabulary of a checkpoint-manager root (``root/step_N``): :class:`StepStorage`, its
logic once over the primitives each backend provides as the ``steps`` of its :class:`StorageBackend`."""

from __future__ import annotations

import abc
import concurrent.futures as cf
import functools
import importlib
import json
import logging
import os
import re
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Union

from .errors import CheckpointNotFoundError, ConcurrentSaveError

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

logger = logging.getLogger(__name__)

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
_METADATA = ".metadata"
#: the save machinery's entries beside a step: staging and replaced directories, lock files and reader marks
_HIDDEN = re.compile(r"^\.step_(0|[1-9][0-9]*)\.hp-dcp-(staging|old|lock|readlock)(-.*)?$")
_RANK_METADATA = re.compile(r"^\d+\.metadata$")  # a rank-local save (use_collectives=False): loadable, not ours
_MAILBOX = re.compile(r"^((LOCAL_PLAN|STORAGE_DATA)_\d+\.pkl(\.done)?|\.hp-dcp-mailbox-.*|.*\.hp-dcp-tmp)$")


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


#: ``(name relative to a location, size, modified)`` of each file (and, on a filesystem, directory) under it
Tree = list[tuple[str, int, float]]


class StepStorage(abc.ABC):
    """What the manager and ``hp-dcp ls``/``clean`` need from a root, written once over the
    primitives each backend supplies (its ``steps``; the abstract one-liners below):

    - ``check_root()``: raise naming the root when it cannot hold steps;
    - ``_check_complete(step)``: the ``storage_fs.integrity.check_complete`` report of the step;
    - ``_root_entries()``: ``(name, location, is a directory)`` of the root's entries (none when missing);
    - ``_tree(location)``: the :data:`Tree` under a step or a hidden entry (empty when gone);
    - ``_names(location)``: the names of a step's direct entries (none when it is gone);
    - ``_modified(step, name)``: the modification time of a step's file, ``None`` when there is none;
    - ``_read(step, name)`` (``None`` when missing), ``_write(step, name, data)`` (creating the step);
    - ``_new_save_lock(step, what)``: ``(acquire, release)`` of the step's save lock for ``what``;
      ``acquire`` never waits: it raises :class:`ConcurrentSaveError` while someone holds it;
    - ``_readers_excluded(step)``: within the save lock, yields whether no :meth:`reading` holds it;
    - ``_read_hold(step)``: holds the step against deletion, yields False where none can be made;
    - ``_delete(step)``: within the save lock, delete the step, ``.metadata`` first; False when gone;
    - ``_lock_held(location)``: the lock or reader mark there has a live holder (changes nothing);
    - ``_remove_beside(item)``: remove a hidden leftover, re-checked; False when in use;
    - ``_remove_files(locations)``: delete those files (ones gone already are skipped).

    A step whose save lock is held is never touched, nor, with ``grace``, anything changed in the
    last ``grace`` seconds; ``remove_step`` never leaves a half-deleted step that looks complete."""

    root: Any
    #: how many completeness probes :meth:`list_steps` keeps in flight (each is a request on an object store)
    _probes_in_flight = 1

    @abc.abstractmethod
    def check_root(self) -> None: ...
    @abc.abstractmethod
    def _check_complete(self, step: int) -> Any: ...
    @abc.abstractmethod
    def _root_entries(self) -> list[tuple[str, str, bool]]: ...
    @abc.abstractmethod
    def _tree(self, location: str) -> Tree: ...
    @abc.abstractmethod
    def _names(self, location: str) -> list[str]: ...
    @abc.abstractmethod
    def _modified(self, step: int, name: str) -> Optional[float]: ...
    @abc.abstractmethod
    def _read(self, step: int, name: str) -> Optional[bytes]: ...
    @abc.abstractmethod
    def _write(self, step: int, name: str, data: bytes) -> None: ...
    @abc.abstractmethod
    def _new_save_lock(self, step: int, what: str) -> tuple[Callable[[], None], Callable[[], None]]: ...
    @abc.abstractmethod
    def _readers_excluded(self, step: int) -> AbstractContextManager[bool]: ...
    @abc.abstractmethod
    def _read_hold(self, step: int) -> AbstractContextManager[bool]: ...
    @abc.abstractmethod
    def _delete(self, step: int) -> bool: ...
    @abc.abstractmethod
    def _lock_held(self, location: str) -> bool: ...
    @abc.abstractmethod
    def _remove_beside(self, item: Leftover) -> bool: ...
    @abc.abstractmethod
    def _remove_files(self, locations: tuple[str, ...]) -> None: ...

    @contextmanager
    def _save_lock(self, step: int, what: str) -> Iterator[bool]:
        """Yields True holding ``step``'s save lock (a new save of it fails meanwhile), False when someone holds it."""
        acquire, release = self._new_save_lock(step, what)
        try:
            acquire()
        except ConcurrentSaveError:
            yield False
            return
        try:
            yield True
        finally:
            release()

    def location(self, step: int) -> str:
        """The ``checkpoint_id`` that ``save``/``load`` use for ``step``: ``root/step_N``."""
        return f"{self.root}/{step_name(step)}"

    def _beside(self, step: int, kind: str) -> str:
        """The hidden root entry ``.step_N.hp-dcp-{kind}`` of ``step`` (its save lock: ``lock``)."""
        return f"{self.root}/.{step_name(step)}.hp-dcp-{kind}"

    def list_steps(self) -> list[StepEntry]:
        """Every ``step_N`` directory, ascending by step; a missing root has none."""
        found = sorted(step for name, _, is_dir in self._root_entries()
                       if is_dir and (step := parse_step_name(name)) is not None)
        if self._probes_in_flight == 1 or len(found) < 2:
            complete = list(map(self.is_complete, found))
        else:
            with cf.ThreadPoolExecutor(min(self._probes_in_flight, len(found)), thread_name_prefix="hp-dcp-steps") as pool:
                complete = list(pool.map(self.is_complete, found))
        return [StepEntry(step, self.location(step), done) for step, done in zip(found, complete)]

    def is_complete(self, step: int) -> bool:
        """The step's save committed its ``.metadata``."""
        return self._modified(step, _METADATA) is not None

    def completeness_problems(self, step: int) -> list[str]:
        """Why ``step`` would not load (metadata and file sizes, no data read); empty when fine."""
        report = self._check_complete(step)
        if report.complete and report.metadata is not None and self.is_complete(step):
            return []
        return report.problems or [f"{self.location(step)} has no {_METADATA}"]

    def size_bytes(self, step: int) -> int:
        """Bytes of every file of ``step``."""
        return sum(size for _, size, _ in self._tree(self.location(step)))

    def saved_at(self, step: int) -> Optional[float]:
        """When the step was committed (``.metadata``'s modification time), else when it last changed."""
        committed = self._modified(step, _METADATA)
        if committed is not None:
            return committed
        times = [modified for _, _, modified in self._tree(self.location(step))]
        return max(times) if times else None

    def read_info(self, step: int) -> Optional[dict[str, Any]]:
        """The step's ``hp-dcp-step.json`` (``{"step", "saved_at", "metrics"}``), or ``None``."""
        try:
            doc = json.loads(self._read(step, INFO_FILE) or b"null")
        except (ValueError, UnicodeDecodeError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_info(self, step: int, info: dict[str, Any]) -> None:
        """Write the step's info file before its save starts (the save keeps it in the new checkpoint)."""
        self._write(step, INFO_FILE, json.dumps(info, sort_keys=True).encode())

    def remove_step(self, step: int) -> bool:
        """Delete ``step``; False (nothing done) while a save into it or a :meth:`reading` of it
        runs, or when it is gone."""
        with self._save_lock(step, "deletion") as held:
            if not held:
                return False
            with self._readers_excluded(step) as free:
                return free and self._delete(step)

    @contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """Hold ``step`` against :meth:`remove_step` while it is loaded (where the root allows a
        hold); :class:`CheckpointNotFoundError` when it is no longer complete once held."""
        with self._read_hold(step) as held:
            if not self.is_complete(step):
                why = "was removed before it could be loaded" if held else "is not complete"
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} {why}")
            yield

    def find_leftovers(self, *, protected: frozenset[int] = frozenset(), older_than: Optional[int] = None,
                       max_step: Optional[int] = None, grace: float = 0.0,
                       check_running: bool = True) -> list[Leftover]:
        """What dead saves left under ``root``, for steps not in ``protected``: hidden staging/old
        directories, unheld locks and reader marks, mailbox/temp files in complete steps, and
        steps without ``.metadata`` below ``older_than`` unless they hold ``{rank}.metadata``
        files.  Skipped: held steps, entries changed in the last ``grace`` s, steps above
        ``max_step``.  ``check_running=False`` probes no lock (and reports none)."""
        now = time.time()

        @functools.cache
        def save_running(step: int) -> bool:
            return self._lock_held(self._beside(step, "lock"))

        def busy(step: int, tree: Tree) -> bool:
            return (step in protected or (grace > 0 and now - max(m for _, _, m in tree) < grace)
                    or (check_running and save_running(step)))

        out: list[Leftover] = []
        for name, location, is_dir in self._root_entries():
            hidden = _HIDDEN.match(name)
            step = int(hidden.group(1)) if hidden else parse_step_name(name)
            if step is None or (max_step is not None and step > max_step):
                continue
            if hidden and hidden.group(2) in ("lock", "readlock"):  # left over once nobody holds it
                if check_running and step not in protected and not self._lock_held(location):
                    out.append(Leftover(step, hidden.group(2), location, 0))
                continue
            if hidden:
                if (tree := self._tree(location)) and not busy(step, tree):
                    out.append(Leftover(step, hidden.group(2), location, sum(size for _, size, _ in tree)))
                continue
            names = self._names(location) if is_dir else []
            if _METADATA in names:
                stray = sorted(n for n in names if _MAILBOX.match(n))
                if stray and not busy(step, tree := self._tree(location)):
                    sizes = {n: size for n, size, _ in tree}
                    out.append(Leftover(step, "mailbox", location, sum(sizes.get(n, 0) for n in stray),
                                        tuple(f"{location}/{n}" for n in stray)))
                continue
            if not is_dir or older_than is None or step >= older_than:
                continue
            tree = self._tree(location)
            if not tree or busy(step, tree):  # gone meanwhile, held or recent
                continue
            rank_local = sorted(n for n in names if _RANK_METADATA.match(n))
            if rank_local:
                logger.warning("%s has no %s but holds a checkpoint saved without collectives (%s); left alone",
                               location, _METADATA, ", ".join(rank_local[:5]))
                continue
            out.append(Leftover(step, "incomplete", location, sum(size for _, size, _ in tree)))
        return sorted(out, key=lambda x: (x.step, x.kind, x.location))

    def remove_leftover(self, item: Leftover) -> bool:
        """Remove ``item`` (re-checked under the step's save lock); False when it is in use or gone."""
        if item.kind not in ("mailbox", "incomplete"):
            return self._remove_beside(item)
        with self._save_lock(item.step, "clean-up") as held:
            if not held:
                return False
            if item.kind == "mailbox":
                self._remove_files(item.paths)
                return True
            return not self.is_complete(item.step) and self._delete(item.step)  # not when a save completed it
