"""Every storage operation of :class:`CheckpointManager`, ``hp-dcp ls`` and ``hp-dcp clean``.

:class:`FileSystemSteps` is the ``core.backends.StepStorage`` of a filesystem root (``root/step_N``
beside the user's files); :func:`step_storage_for` picks an object store's by URL scheme.
A step whose save lock is held (an ``flock``) is never touched, nor, with ``grace``,
anything modified in the last ``grace`` seconds.
"""

from __future__ import annotations

import fcntl
import functools
import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Iterator, Optional, Union

from hyper_parallel_dcp.core.backends import (
    INFO_FILE,
    Leftover,
    StepEntry,
    StepStorage,
    backend_for,
    parse_step_name,
    step_name,
    url_scheme,
)
from hyper_parallel_dcp.core.errors import CheckpointNotFoundError, ConcurrentSaveError
from hyper_parallel_dcp.storage_fs.atomic import write_file_atomic
from hyper_parallel_dcp.storage_fs.backend import local_path
from hyper_parallel_dcp.storage_fs.commit import SaveLock

__all__ = ["FileSystemSteps", "step_storage_for"]

logger = logging.getLogger(__name__)

_METADATA = ".metadata"
_HIDDEN = re.compile(r"^\.step_(0|[1-9][0-9]*)\.hp-dcp-(staging|old|lock|readlock)(-.*)?$")
_RANK_METADATA = re.compile(r"^\d+\.metadata$")  # a rank-local save (use_collectives=False): loadable, not ours
_MAILBOX = re.compile(r"^((LOCAL_PLAN|STORAGE_DATA)_\d+\.pkl(\.done)?|\.hp-dcp-mailbox-.*|.*\.hp-dcp-tmp)$")


def _tree_bytes(path: str) -> int:
    try:
        if not os.path.isdir(path) or os.path.islink(path):
            return os.lstat(path).st_size
    except FileNotFoundError:
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with suppress(FileNotFoundError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _newest_mtime(path: str) -> float:
    """The newest mtime of ``path`` and its direct entries (a writer touches one of them)."""
    try:
        newest = os.lstat(path).st_mtime
        if os.path.isdir(path) and not os.path.islink(path):
            for entry in os.scandir(path):
                with suppress(FileNotFoundError):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except FileNotFoundError:
        return 0.0
    return newest


@contextmanager
def _exclusive_flock(path: Path, *, unlink: bool = False) -> Iterator[bool]:
    """Yields True holding an exclusive ``flock`` on ``path`` (or when it does not exist), False when
    someone holds one (or it cannot be taken: then nothing is removed).  ``unlink``: remove the file
    while locked (a reader that opened it meanwhile re-opens the new file).  Closing releases it."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            locked = False
        else:
            locked = True
            if unlink:
                with suppress(FileNotFoundError):
                    os.unlink(path)
        yield locked
    finally:
        os.close(fd)


def _lock_free(path: Path) -> bool:
    """Nobody holds a ``flock`` on ``path`` (or it does not exist); a probe that changes nothing."""
    with _exclusive_flock(path) as free:
        return free


def _move_away(path: Union[str, Path], trash: Path) -> bool:
    """Rename ``path`` to the hidden ``trash``, so it is never seen half deleted; False when it is gone."""
    try:
        os.rename(path, trash)
        return True
    except FileNotFoundError:
        return False


class FileSystemSteps:
    """The step directories under a filesystem ``root``; never touches an entry of ``root`` that
    is not ``step_N`` or one of the hidden ``.step_N.hp-dcp-*`` names the save machinery creates."""

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = Path(root)

    def check_root(self) -> None:
        """Raise ``NotADirectoryError`` naming ``root`` when it exists and is not a directory."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"checkpoint manager root {self.root} exists and is not a directory")

    def location(self, step: int) -> str:
        """The ``checkpoint_id`` that ``save``/``load`` use for ``step``."""
        return str(self.root / step_name(step))

    def _hidden(self, step: int, kind: str) -> Path:
        return self.root / f".{step_name(step)}.hp-dcp-{kind}"

    def list_steps(self) -> list[StepEntry]:
        """Every ``step_N`` directory, ascending by step; a missing root has none."""
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = [StepEntry(step, e.path, os.path.isfile(os.path.join(e.path, _METADATA))) for e in entries
               if (step := parse_step_name(e.name)) is not None and e.is_dir(follow_symlinks=False)]
        return sorted(out, key=lambda e: e.step)

    def is_complete(self, step: int) -> bool:
        return os.path.isfile(os.path.join(self.location(step), _METADATA))

    def completeness_problems(self, step: int) -> list[str]:
        """Why ``step`` would not load (metadata and file sizes, no data read); empty when fine."""
        # imported here: parsing metadata needs torch, which hp-dcp ls and clean never import
        from hyper_parallel_dcp.storage_fs.integrity import check_complete

        report = check_complete(self.location(step))
        if report.complete and report.metadata is not None and self.is_complete(step):
            return []
        return report.problems or [f"{self.location(step)} has no {_METADATA}"]

    def size_bytes(self, step: int) -> int:
        return _tree_bytes(self.location(step))

    def saved_at(self, step: int) -> Optional[float]:
        """When the step was committed (``.metadata``'s mtime), else the directory's mtime."""
        for p in (os.path.join(self.location(step), _METADATA), self.location(step)):
            with suppress(FileNotFoundError):
                return os.stat(p).st_mtime
        return None

    def read_info(self, step: int) -> Optional[dict[str, Any]]:
        """The step's ``hp-dcp-step.json`` (``{"step", "saved_at", "metrics"}``), or ``None``."""
        try:
            doc = json.loads(Path(self.location(step), INFO_FILE).read_bytes())
        except (FileNotFoundError, NotADirectoryError, ValueError, UnicodeDecodeError):
            return None
        return doc if isinstance(doc, dict) else None

    def write_info(self, step: int, info: dict[str, Any]) -> None:
        """Write the step's info file atomically before its save starts (the commit carries
        it into the new checkpoint); creates ``root`` and the step directory as needed."""
        directory = Path(self.location(step))
        directory.mkdir(parents=True, exist_ok=True)
        text = json.dumps(info, sort_keys=True).encode()
        write_file_atomic(directory / INFO_FILE, lambda f: f.write(text), sync=False, unique_temp=True)

    def remove_step(self, step: int) -> bool:
        """Delete ``step`` crash-safely (renamed to a hidden ``.step_N.hp-dcp-old-*`` name
        first); False (nothing done) while a save into it or a :meth:`reading` of it runs,
        or when it is gone."""
        trash = self._hidden(step, f"old-retired-{os.getpid()}-{time.time_ns()}")
        with self._save_lock(step) as held:
            if not held:
                return False
            with _exclusive_flock(self._hidden(step, "readlock"), unlink=True) as free:
                if not free or not _move_away(self.location(step), trash):
                    return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    @contextmanager
    def _save_lock(self, step: int) -> Iterator[bool]:
        """Yields True holding ``step``'s save lock (a new save of it fails meanwhile), False when a save holds it."""
        lock = SaveLock(self.root / step_name(step))
        try:
            lock.acquire()
        except ConcurrentSaveError:
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    @contextmanager
    def reading(self, step: int) -> Iterator[None]:
        """Hold ``step`` against :meth:`remove_step` (a shared ``flock``) while it is loaded;
        :class:`CheckpointNotFoundError` when it is no longer complete once the lock is held."""
        path = self._hidden(step, "readlock")
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:  # a read-only root (an evaluation job): nobody deletes there
                logger.debug("no read lock for %s: %s", self.location(step), exc)
                if not self.is_complete(step):
                    raise CheckpointNotFoundError(f"checkpoint {self.location(step)} is not complete") from None
                yield
                return
            fcntl.flock(fd, fcntl.LOCK_SH)
            with suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)  # a remover unlinked it meanwhile: lock the new file
        try:
            if not self.is_complete(step):
                raise CheckpointNotFoundError(f"checkpoint {self.location(step)} was removed before it could be loaded")
            yield
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last reader removes the file
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            except OSError:
                pass  # another reader holds it, or it is gone already
            finally:
                os.close(fd)

    def find_leftovers(self, *, protected: frozenset[int] = frozenset(), older_than: Optional[int] = None,
                       max_step: Optional[int] = None, grace: float = 0.0,
                       check_running: bool = True) -> list[Leftover]:
        """What dead saves left under ``root``, for steps not in ``protected``: hidden staging/old
        directories, unheld lock files, mailbox/temp files in complete steps, and step directories
        without ``.metadata`` below ``older_than`` unless they hold ``{rank}.metadata`` files.
        Skipped: held steps, entries newer than ``grace`` s, steps above ``max_step``.
        ``check_running=False`` probes no lock."""
        try:
            entries = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return []
        now = time.time()

        @functools.cache
        def save_running(step: int) -> bool:
            return not _lock_free(self._hidden(step, "lock"))

        def busy(step: int, path: str) -> bool:
            return (step in protected or (grace > 0 and now - _newest_mtime(path) < grace)
                    or (check_running and save_running(step)))

        out: list[Leftover] = []
        for entry in entries:
            hidden = _HIDDEN.match(entry.name)
            step = int(hidden.group(1)) if hidden else parse_step_name(entry.name)
            if step is None or (max_step is not None and step > max_step):
                continue
            if hidden:
                kind = hidden.group(2)
                if kind in ("lock", "readlock"):  # a lock file is left over once nobody holds it
                    in_use = not check_running or step in protected or (
                        save_running(step) if kind == "lock" else not _lock_free(self._hidden(step, kind)))
                    if not in_use:
                        out.append(Leftover(step, kind, entry.path, 0))
                elif not busy(step, entry.path):
                    out.append(Leftover(step, kind, entry.path, _tree_bytes(entry.path)))
                continue
            if not entry.is_dir(follow_symlinks=False):
                continue
            try:
                names = os.listdir(entry.path)
            except FileNotFoundError:
                continue
            if _METADATA in names:
                stray = [n for n in names if _MAILBOX.match(n)]
                if stray and not busy(step, entry.path):
                    paths = tuple(os.path.join(entry.path, n) for n in stray)
                    out.append(Leftover(step, "mailbox", entry.path, sum(_tree_bytes(p) for p in paths), paths))
                continue
            if older_than is None or step >= older_than or busy(step, entry.path):
                continue
            rank_local = [n for n in names if _RANK_METADATA.match(n)]
            if rank_local:
                logger.warning("%s has no %s but holds a checkpoint saved without collectives (%s); left alone",
                               entry.path, _METADATA, ", ".join(sorted(rank_local)[:5]))
                continue
            out.append(Leftover(step, "incomplete", entry.path, _tree_bytes(entry.path)))
        return sorted(out, key=lambda x: (x.step, x.kind, x.location))

    def remove_leftover(self, item: Leftover) -> bool:
        """Remove ``item`` (re-checking the save lock); False when it is in use or gone."""
        if item.kind == "readlock":
            with _exclusive_flock(self._hidden(item.step, "readlock"), unlink=True) as free:
                return free
        with self._save_lock(item.step) as held:
            if not held:
                return False
            if item.kind == "lock":
                return True  # releasing the lock on the way out unlinks its file
            if item.kind == "mailbox":
                for p in item.paths:
                    with suppress(FileNotFoundError):
                        os.unlink(p)
                return True
            if item.kind == "incomplete":
                if os.path.exists(os.path.join(item.location, _METADATA)):
                    return False  # a save completed it meanwhile
                trash = self._hidden(item.step, f"old-incomplete-{os.getpid()}-{time.time_ns()}")
                if not _move_away(item.location, trash):
                    return False
                shutil.rmtree(trash, ignore_errors=True)
                return True
            shutil.rmtree(item.location, ignore_errors=True)
            return not os.path.exists(item.location)


def step_storage_for(root: Union[str, os.PathLike]) -> StepStorage:
    """The step storage of a manager root: :class:`FileSystemSteps` for a path, else the one the
    backend of the URL's scheme registers.  Raises ``UnknownSchemeError`` (a ``ValueError``)
    naming the package to install for a scheme without a backend, ``ValueError`` for a backend
    without step storage."""
    text = os.fspath(root)
    if url_scheme(text) == "file":
        return FileSystemSteps(local_path(text))
    backend = backend_for(text)
    if backend.steps is None:
        raise ValueError(f"the storage backend for {backend.scheme}:// has no step storage; CheckpointManager "
                         f"cannot manage {text}")
    steps: StepStorage = backend.steps(text)
    return steps
