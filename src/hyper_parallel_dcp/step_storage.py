"""The storage of a :class:`CheckpointManager` root, ``hp-dcp ls`` and ``hp-dcp clean``.

:class:`FileSystemSteps` is the ``core.backends.StepStorage`` of a filesystem root (``root/step_N``
beside the user's files): its primitives over ``flock`` s and renames; :func:`step_storage_for`
picks an object store's by URL scheme.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import time
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from hyper_parallel_dcp.core.backends import Leftover, StepStorage, backend_for, step_name, url_scheme
from hyper_parallel_dcp.storage_fs.atomic import write_file_atomic
from hyper_parallel_dcp.storage_fs.backend import local_path
from hyper_parallel_dcp.storage_fs.commit import SaveLock

__all__ = ["FileSystemSteps", "step_storage_for"]

logger = logging.getLogger(__name__)


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


class FileSystemSteps(StepStorage):
    """The step directories under a filesystem ``root``; never touches an entry of ``root`` that
    is not ``step_N`` or one of the hidden ``.step_N.hp-dcp-*`` names the save machinery creates.
    Locks are ``flock`` s (released when their process dies); a step is deleted by renaming it
    to a hidden ``.step_N.hp-dcp-old-*`` name first."""

    def __init__(self, root: Union[str, os.PathLike]):
        self.root = Path(root)

    def check_root(self) -> None:
        """Raise ``NotADirectoryError`` naming ``root`` when it exists and is not a directory."""
        if self.root.exists() and not self.root.is_dir():
            raise NotADirectoryError(f"checkpoint manager root {self.root} exists and is not a directory")

    def _check_complete(self, step: int) -> Any:
        # imported here: parsing metadata needs torch, which hp-dcp ls and clean never import
        from hyper_parallel_dcp.storage_fs.integrity import check_complete

        return check_complete(self.location(step))

    def _root_entries(self) -> list[tuple[str, str, bool]]:
        try:
            return [(e.name, e.path, e.is_dir(follow_symlinks=False)) for e in os.scandir(self.root)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _tree(self, location: str) -> list[tuple[str, int, float]]:
        """The directory itself (as ``""``), then every directory and file under it (sizes: the files')."""
        try:
            top = os.lstat(location)
        except FileNotFoundError:
            return []
        out = [("", 0 if stat.S_ISDIR(top.st_mode) else top.st_size, top.st_mtime)]
        for dirpath, dirs, files in os.walk(location):
            for name in dirs + files:
                path = os.path.join(dirpath, name)
                with suppress(FileNotFoundError):
                    st = os.lstat(path)
                    out.append((os.path.relpath(path, location), 0 if name in dirs else st.st_size, st.st_mtime))
        return out

    def _names(self, location: str) -> list[str]:
        try:
            return os.listdir(location)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _modified(self, step: int, name: str) -> Optional[float]:
        try:
            found = os.stat(os.path.join(self.location(step), name))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return found.st_mtime if stat.S_ISREG(found.st_mode) else None

    def _read(self, step: int, name: str) -> Optional[bytes]:
        try:
            return Path(self.location(step), name).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _write(self, step: int, name: str, data: bytes) -> None:
        """Atomically, creating ``root`` and the step directory as needed (the commit carries the file over)."""
        directory = Path(self.location(step))
        directory.mkdir(parents=True, exist_ok=True)
        write_file_atomic(directory / name, lambda f: f.write(data), sync=False, unique_temp=True)

    def _new_save_lock(self, step: int, what: str) -> tuple[Callable[[], None], Callable[[], None]]:
        lock = SaveLock(self.root / step_name(step))
        return lock.acquire, lock.release

    def _readers_excluded(self, step: int) -> AbstractContextManager[bool]:
        return _exclusive_flock(Path(self._beside(step, "readlock")), unlink=True)

    @contextmanager
    def _read_hold(self, step: int) -> Iterator[bool]:
        """A shared ``flock`` on ``.step_N.hp-dcp-readlock``; the last reader removes the file."""
        path = Path(self._beside(step, "readlock"))
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:  # a read-only root (an evaluation job): nobody deletes there
                logger.debug("no read lock for %s: %s", self.location(step), exc)
                yield False
                return
            fcntl.flock(fd, fcntl.LOCK_SH)
            with suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)  # a remover unlinked it meanwhile: lock the new file
        try:
            yield True
        finally:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the last reader removes the file
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            except OSError:
                pass  # another reader holds it, or it is gone already
            finally:
                os.close(fd)

    def _delete(self, step: int) -> bool:
        """Renamed to a hidden ``.step_N.hp-dcp-old-*`` name first, so it is never seen half deleted."""
        trash = self._beside(step, f"old-retired-{os.getpid()}-{time.time_ns()}")
        try:
            os.rename(self.location(step), trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _lock_held(self, location: str) -> bool:
        with _exclusive_flock(Path(location)) as free:
            return not free

    def _remove_beside(self, item: Leftover) -> bool:
        if item.kind == "readlock":
            with _exclusive_flock(Path(item.location), unlink=True) as free:
                return free
        with self._save_lock(item.step, "clean-up") as held:
            if not held or item.kind == "lock":
                return held  # releasing the lock on the way out unlinks its file
            shutil.rmtree(item.location, ignore_errors=True)
            return not os.path.exists(item.location)

    def _remove_files(self, locations: tuple[str, ...]) -> None:
        for path in locations:
            with suppress(FileNotFoundError):
                os.unlink(path)


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
