"""A read-ahead thread over a storage reader's reads (:class:`ReadAhead`): results come back
strictly in the order given, as the read order is the broadcast order."""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator, Sequence

from hyper_parallel_dcp.core.planner import ReadItem
from hyper_parallel_dcp.core.settings import READ_AHEAD

__all__ = ["ReadAhead"]

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ReadAhead:
    """Iterate ``read_items(items)`` on a daemon thread, at most ``depth`` results ahead;
    its exceptions are re-raised in the consuming thread, ``close()`` stops it.  Raises
    ``ValueError`` for a depth below 1."""

    def __init__(self, read_items: Callable[[Sequence[Any]], Iterator[tuple[ReadItem, Any]]],
                 items: Sequence[Any], depth: int = READ_AHEAD.default) -> None:
        if depth < 1:
            raise ValueError(f"read-ahead depth must be at least 1, got {depth}")
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(read_items, list(items)),
                                        name="hp-dcp-read-ahead", daemon=True)
        self._thread.start()

    def _put(self, value: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, read_items: Callable, items: list[Any]) -> None:
        gen = read_items(items) if items else iter(())
        try:
            for result in gen:
                if not self._put(result):
                    return
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(_Failed(exc))
        finally:
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    def __iter__(self) -> ReadAhead:
        return self

    def __next__(self) -> tuple[ReadItem, Any]:
        if self._finished:
            raise StopIteration
        value = self._queue.get()
        if isinstance(value, _Failed):
            self._finished = True
            raise value.exc
        if value is _DONE:
            self._finished = True
            raise StopIteration
        return value

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; safe to call more than once."""
        self._finished = True
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._queue.get_nowait()
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
