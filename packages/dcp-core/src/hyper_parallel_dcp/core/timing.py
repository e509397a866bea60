"""Per-phase timing lines (``[INFO] [HP-DCP]: [rank=0] >>> func execute_write cost 0.0061 seconds``)
on the ``hyper_parallel_dcp.timing`` logger, switched on with ``HP_LOG_CONFIG=DCP:INFO``."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Iterator

from .settings import LOG_CONFIG

__all__ = ["configure_from_env", "logger", "phase"]

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
