"""Progress bar and the summary of a conversion (tensors, bytes, time, throughput)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from hyper_parallel_dcp.core.errors import format_bytes

__all__ = ["ConversionReport", "format_bytes", "progress_bar"]


@dataclass
class ConversionReport:
    """What a conversion did: ``tensors`` and ``bytes`` written, wall ``seconds``, ``files``
    written to ``destination`` (names relative to it)."""

    source: str
    destination: str
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    files: list[str] = field(default_factory=list)
    objects: int = 0

    @property
    def throughput(self) -> float:
        """Bytes per second (0 when nothing was timed)."""
        return self.bytes / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        """One line: tensors, objects, bytes, seconds, throughput, destination and files."""
        extra = f", {self.objects} non-tensor entries" if self.objects else ""
        return (f"{self.tensors} tensors{extra}, {format_bytes(self.bytes)} in {self.seconds:.2f} s "
                f"({format_bytes(self.throughput)}/s) -> {self.destination} ({len(self.files)} files)")


@contextlib.contextmanager
def progress_bar(report: ConversionReport, total_bytes: int, desc: str, enabled: bool) -> Iterator[Callable[[int], None]]:
    """Yield ``advance(nbytes)``, which counts bytes into ``report`` and onto a tqdm bar (only
    when ``enabled`` and stderr is a terminal); ``report.seconds`` is set on exit.  The
    converter sets ``report.tensors`` (a tensor may be written in several blocks)."""
    bar: Optional[Any] = None
    if enabled and sys.stderr.isatty():  # a bar redrawn into a log file is noise
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                   dynamic_ncols=True)
    start = time.perf_counter()

    def advance(nbytes: int) -> None:
        report.bytes += nbytes
        if bar is not None:
            bar.update(nbytes)

    try:
        yield advance
    finally:
        report.seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
