"""A background read-ahead over a storage reader's reads.

The thread runs the read step of the normal read path (``StorageReader.read_stream``:
``reader.read_into`` straight into the destination views, ``read_object`` for objects) a
couple of items ahead of the main thread, which drives the broadcasts.
Results come back strictly in the order given: the read order is the broadcast order,
and splitting the two was measured slower (see the user guide), so this is a FIFO, not a
completion table.  The thread touches only the reader and the destinations (resolved
beforehand), never the planner.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator, Sequence

from hyper_parallel_dcp.core.planner import ReadItem
from hyper_parallel_dcp.core.settings import READ_AHEAD

__all__ = ["ReadAhead"]

_DONE = object()
# Kept small: a couple of reads ahead keep the reader busy while the main thread
# launches broadcasts, and the reads stay close to the broadcast order (measured best).
# The executor passes HP_DCP_READ_AHEAD; this is its default.
DEFAULT_DEPTH = READ_AHEAD.default


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class ReadAhead:
    """Iterate ``read_items(items)`` on a daemon thread, at most ``depth`` results ahead.

    ``read_items`` is any function returning an iterator over ``items`` (the broadcast
    executor passes its reader's ``read_stream``).  Yields
    exactly what it yields, in its order; an exception raised by the reader is re-raised
    in the consuming thread at the position where it happened.
    ``close()`` (also on ``with`` exit) stops the thread; the generator is closed on the
    thread that ran it.
    """

    def __init__(self, read_items: Callable[[Sequence[Any]], Iterator[tuple[ReadItem, Any]]],
                 items: Sequence[Any], depth: int = DEFAULT_DEPTH) -> None:
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
        if value is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(value, _Failed):
            self._finished = True
            raise value.exc
        return value

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; safe to call more than once."""
        self._finished = True
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
