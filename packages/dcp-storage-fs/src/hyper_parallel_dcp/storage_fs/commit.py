"""Crash-safe commit of a checkpoint directory: :func:`commit_directory` (one
``renameat2(RENAME_EXCHANGE)`` where the kernel has it), :func:`wait_for_removals`,
:func:`remove_stale_staging`, and :class:`SaveLock` against concurrent saves."""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Optional

from hyper_parallel_dcp.core.errors import ConcurrentSaveError

from . import posix
from .atomic import fsync_dir
from .layout import is_checkpoint_artifact, lock_path, staging_dir, stale_prefixes

__all__ = ["SaveLock", "commit_directory", "is_checkpoint_artifact", "remove_stale_staging", "staging_dir",
           "wait_for_removals"]


def remove_stale_staging(target: Path, keep: Optional[str] = None) -> list[Path]:
    """Delete the staging and trash directories beside ``target`` but ``keep``'s, holding its
    :class:`SaveLock`; returns what was removed."""
    removed: list[Path] = []
    prefixes = stale_prefixes(target)
    kept = staging_dir(target, keep).name if keep is not None else None
    try:
        entries = list(os.scandir(target.parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefixes) and entry.name != kept and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed


class SaveLock:
    """An exclusive ``flock`` beside the target; released on close or process death."""

    def __init__(self, target: Path):
        self.target = target
        self.path = lock_path(target)
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = ""
                with contextlib.suppress(OSError):
                    holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                os.close(fd)
                if exc.errno in (errno.EAGAIN, errno.EACCES):
                    raise ConcurrentSaveError(
                        f"another save into {self.target} is in progress ({holder or 'holder unknown'}); "
                        "two saves into one directory at once are refused"
                    ) from None
                raise
            # a holder unlinks the file on release: a locked unlinked inode means start over
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        info = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)  # while still locked: leave no lock file behind
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            finally:
                os.close(self.fd)
                self.fd = None


def commit_directory(staging: Path, target: Path) -> None:
    """Put the complete ``staging`` directory at ``target``, replacing an old checkpoint;
    files in ``target`` that are not checkpoint artifacts are carried over (hard links)."""
    fsync_dir(staging)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"checkpoint path {target} exists and is not a directory")
    if target.is_dir():
        try:
            entries = list(os.scandir(target))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if is_checkpoint_artifact(entry.name):
                continue
            dst = staging / entry.name
            if entry.is_dir(follow_symlinks=False):
                shutil.copytree(entry.path, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry.path, dst)
        if not entries:
            try:
                os.rename(staging, target)  # replaces an empty directory atomically
                fsync_dir(target.parent)
                return
            except OSError:
                pass
        if posix.exchange(staging, target):
            fsync_dir(target.parent)
            _remove_in_background(staging)  # the old checkpoint, now at the staging path
            return
        trash = target.parent / f".{target.name}.hp-dcp-old-{os.getpid()}-{time.time_ns()}"
        os.rename(target, trash)
        os.rename(staging, target)
        fsync_dir(target.parent)
        _remove_in_background(trash)
        return
    os.rename(staging, target)
    fsync_dir(target.parent)


_removals: list[threading.Thread] = []
_removals_lock = threading.Lock()


def _remove_in_background(path: Path) -> None:
    """``rmtree(path)`` on a daemon thread (a replaced checkpoint: no reader can reach it)."""
    thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                              name="hp-dcp-remove-replaced", daemon=True)
    with _removals_lock:
        _removals[:] = [t for t in _removals if t.is_alive()]
        _removals.append(thread)
    thread.start()


def wait_for_removals(timeout: Optional[float] = None) -> bool:
    """Whether the replaced checkpoints this process deletes are gone within ``timeout`` s (``None``: wait)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _removals_lock:
        pending = list(_removals)
    for thread in pending:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)


atexit.register(wait_for_removals)


def _link_or_copy(src: str, dst: str | os.PathLike) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
