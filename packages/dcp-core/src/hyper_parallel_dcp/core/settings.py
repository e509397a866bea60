"""Every environment variable hyper-parallel-dcp reads, one :class:`Setting` each, read when needed;
a bad value raises :class:`SettingError` naming the variable, the value and what it accepts.

Also what two of them switch on: the per-phase timing lines of ``HP_LOG_CONFIG=DCP:INFO``
(``[INFO] [HP-DCP]: [rank=0] >>> func execute_write cost 0.0061 seconds`` on the
``hyper_parallel_dcp.timing`` logger: :func:`phase`, :func:`log_info`), and the test hook of
``HP_DCP_FAULT=<phase>[@<rank>][,...]``: a process SIGKILLs itself at a named phase
(:func:`fault_point`), or a write fails with ``ENOSPC`` (:func:`fault_error`); with
``HP_DCP_FAULT_ONCE=<file>`` only the first process to get there dies.  Phases: :data:`PHASES`."""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Callable, Generic, Iterator, TypeVar

__all__ = [
    "ALIGNED_WRITES",
    "ASYNC_GLOO_PORT",
    "ASYNC_SHUTDOWN_TIMEOUT",
    "ASYNC_TIMEOUT",
    "BROADCASTS_IN_FLIGHT",
    "CHUNK_EXCHANGE",
    "COLLECTIVE_TIMEOUT",
    "DEFAULT_TIMEOUT_S",
    "FAULT",
    "FAULT_ONCE",
    "FILES_KEPT",
    "LOG_CONFIG",
    "MAILBOX_POLL_MAX",
    "OBJECT_LOCK_STALE_AFTER",
    "PHASES",
    "READ_AHEAD",
    "SETTINGS",
    "Setting",
    "SettingError",
    "configure_from_env",
    "fault_error",
    "fault_point",
    "log_info",
    "logger",
    "phase",
]

T = TypeVar("T")

#: Generous by default: a slow filesystem may keep one rank writing for many minutes.
DEFAULT_TIMEOUT_S = 1800.0


class SettingError(ValueError):
    """An environment variable of hyper-parallel-dcp holds a value it does not accept."""


def _number(convert: Callable[[str], T], noun: str, accepts: Callable[[T], bool],
            rule: str) -> Callable[[str, str], T]:
    """A parser: ``convert`` the raw text (else "is not ``noun``"), then check ``accepts``."""

    def parse(name: str, raw: str) -> T:
        try:
            value = convert(raw)
        except ValueError:
            raise SettingError(f"{name}={raw!r} is not {noun}") from None
        if not accepts(value):
            raise SettingError(f"{name}={raw!r}: {rule}")
        return value

    return parse


# NaN is not >= 0
_seconds = _number(float, "a number of seconds", lambda v: v >= 0, "seconds must be a number >= 0")
_positive_int = _number(int, "a whole number", lambda v: v >= 1, "must be at least 1")
_port = _number(int, "a port number", lambda v: 1 <= v <= 65535, "a port is between 1 and 65535")


_FLAG_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False),
               "auto": None}


def _flag_or_auto(name: str, raw: str) -> bool | None:
    if raw.lower() not in _FLAG_WORDS:
        raise SettingError(f"{name}={raw!r}: use 1, 0 or auto")
    return _FLAG_WORDS[raw.lower()]


def _text(name: str, raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: ``get()`` returns its parsed value, or ``default`` when unset or blank."""

    name: str
    default: T
    parse: Callable[[str, str], T]
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name, "").strip()
        return _parsed(self, raw) if raw else self.default


@functools.lru_cache(maxsize=256)
def _parsed(setting: Setting, raw: str):  # type: ignore[no-untyped-def]  # Setting[T] -> T
    return setting.parse(setting.name, raw)


COLLECTIVE_TIMEOUT: Setting[float] = Setting(
    "HP_DCP_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_S, _seconds,
    "seconds every rank waits for the others at each checkpoint collective before failing with the "
    "names of the absent ranks (0: no check, wait as long as the collective does)")
ASYNC_TIMEOUT: Setting[float] = Setting(
    "HP_DCP_ASYNC_TIMEOUT", DEFAULT_TIMEOUT_S, _seconds,
    "seconds an async writer process waits for the other ranks' writers (gloo group timeout, "
    "mailbox polling) before failing")
ASYNC_GLOO_PORT: Setting[int] = Setting(
    "HP_DCP_ASYNC_GLOO_PORT", 0, _port,
    "port of the async writers' own gloo group with async_save(use_gloo=True) (default MASTER_PORT + 1)")
ASYNC_SHUTDOWN_TIMEOUT: Setting[float] = Setting(
    "HP_DCP_ASYNC_SHUTDOWN_TIMEOUT", 60.0, _seconds,
    "seconds the training process waits at exit, after the last save landed, for its writer "
    "process to stop before terminating it")
MAILBOX_POLL_MAX: Setting[float] = Setting(
    "HP_DCP_MAILBOX_POLL_MAX", 0.05, _seconds,
    "longest pause, in seconds, between two looks at the async mailbox files (use_gloo=False); "
    "polling starts at 1 ms and backs off to min(this, max(4 ms, 1 ms x world size))")
FILES_KEPT: Setting[int] = Setting(
    "HP_DCP_FILES_KEPT", 8, _positive_int,
    "checkpoint files a FileSystemReader keeps open (least recently used closed first)")
READ_AHEAD: Setting[int] = Setting(
    "HP_DCP_READ_AHEAD", 2, _positive_int,
    "reads the broadcast load's read-ahead thread runs ahead of the broadcasts")
BROADCASTS_IN_FLIGHT: Setting[int] = Setting(
    "HP_DCP_BROADCASTS_IN_FLIGHT", 8, _positive_int,
    "broadcasts a broadcast load keeps outstanding (each holds up to broadcast_batch_bytes of staging)")
ALIGNED_WRITES: Setting[bool | None] = Setting(
    "HP_DCP_ALIGNED_WRITES", None, _flag_or_auto,
    "1: a save sends its data in writes that end on 2 MiB boundaries, so the page cache holds 2 MiB "
    "folios (faster loads from the page cache, resharded ones most); 0: on 256 KiB boundaries; auto "
    "(the default): 2 MiB unless the machine is a VM whose host reclaims free guest memory (virtio-balloon "
    "free page reporting), where each fresh 2 MiB folio costs a host fault")
CHUNK_EXCHANGE: Setting[bool | None] = Setting(
    "HP_DCP_CHUNK_EXCHANGE", None, _flag_or_auto,
    "1: a resharded load with read-once + broadcast reads a stored chunk that several ranks need column "
    "slices of once, as one run, on one of them, and sends the others their pieces; 0: every rank reads its "
    "slices itself; auto (the default): 1 unless the storage reader says that its reads are memory copies "
    "(a FileSystemReader whose files are all in the page cache)")
OBJECT_LOCK_STALE_AFTER: Setting[float] = Setting(
    "HP_DCP_OBJECT_LOCK_STALE_AFTER", 60.0, _seconds,
    "object storage: seconds after which a save's lock object that was not renewed counts as left by a "
    "dead save (taken over by the next save, removed by retention); holders renew it every sixth of that")
FAULT: Setting[str] = Setting(
    "HP_DCP_FAULT", "", _text,
    "test hook: <phase>@<rank>[,...] makes that rank SIGKILL itself at that checkpoint phase "
    "(core.settings.fault_point; for rehearsing failures, never in production)")
FAULT_ONCE: Setting[str] = Setting(
    "HP_DCP_FAULT_ONCE", "", _text,
    "test hook: a file; with HP_DCP_FAULT only the first process to get there dies (it creates the file)")
LOG_CONFIG: Setting[str] = Setting(
    "HP_LOG_CONFIG", "", _text,
    "comma-separated NAME:LEVEL; DCP:INFO turns on the per-phase timing lines")

#: Every setting, in the order ``docs/tuning.md`` lists them.
SETTINGS: tuple[Setting, ...] = (
    LOG_CONFIG, COLLECTIVE_TIMEOUT, ASYNC_TIMEOUT, ASYNC_GLOO_PORT, ASYNC_SHUTDOWN_TIMEOUT, MAILBOX_POLL_MAX,
    FILES_KEPT, READ_AHEAD, BROADCASTS_IN_FLIGHT, CHUNK_EXCHANGE, ALIGNED_WRITES, OBJECT_LOCK_STALE_AFTER, FAULT, FAULT_ONCE,
)


logger = logging.getLogger("hyper_parallel_dcp.timing")
_configured_from: str | None = None


def configure_from_env() -> None:
    """Apply ``HP_LOG_CONFIG`` (comma-separated ``NAME:LEVEL``; ``DCP`` is ours)."""
    global _configured_from
    spec = LOG_CONFIG.get()
    if spec == _configured_from:
        return
    _configured_from = spec
    level = None
    for part in spec.split(","):
        name, _, lvl = part.strip().partition(":")
        if name.strip().upper() == "DCP" and lvl:
            level = logging.getLevelName(lvl.strip().upper())
    if not isinstance(level, int):
        return
    logger.setLevel(level)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(levelname)s] [HP-DCP]: %(message)s"))
        logger.addHandler(handler)


@contextlib.contextmanager
def phase(name: str, rank: int) -> Iterator[None]:
    """Time a phase and log it at INFO (only computed when the logger is enabled)."""
    configure_from_env()
    if not logger.isEnabledFor(logging.INFO):
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        logger.info("[rank=%d] >>> func %s cost %.4f seconds", rank, name, time.perf_counter() - start)


def log_info(rank: int, message: str) -> None:
    configure_from_env()
    logger.info("[rank=%d] %s", rank, message)


PHASES = ("save.setup", "save.plan", "save.write", "save.commit",
          "load.setup", "load.plan", "load.read", "load.broadcast", "local.write", "local.replicate", "local.full")


def _named(phase: str, rank: int) -> bool:
    spec = FAULT.get()
    entries = (entry.strip().partition("@") for entry in spec.split(",") if spec)
    return any(name == phase and (not who or int(who) == rank) for name, _, who in entries)


def fault_error(phase: str, rank: int) -> None:
    """Raise ``OSError(ENOSPC)`` here if ``HP_DCP_FAULT`` names ``phase`` for ``rank`` (a full disk)."""
    if _named(phase, rank):
        raise OSError(errno.ENOSPC, f"No space left on device (injected by HP_DCP_FAULT={FAULT.get()})")


def fault_point(phase: str, rank: int) -> None:
    """Die here if ``HP_DCP_FAULT`` names ``phase`` for ``rank`` (see the module doc)."""
    if _named(phase, rank):
        once = FAULT_ONCE.get()
        if once:
            try:
                fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return
            os.write(fd, repr(time.time()).encode())  # when it fired: time-to-surface is measured from here
            os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)
