"""Host memory as the reader and writer use it: :class:`PinnedBuffer`, and whether a save
writes 2 MiB folios (:func:`large_folio_writes`; ``docs/perf/storage.md``)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from hyper_parallel_dcp.core.settings import ALIGNED_WRITES

__all__ = ["VIRTIO_DEVICES", "PinnedBuffer", "accelerator_available", "free_page_reporting", "large_folio_writes"]

#: the size of the one page-locked host buffer device reads and writes go through
PINNED_BUFFER_BYTES = 64 << 20
# a save's file data goes out in writes that end on multiples of LARGE_FOLIO, or of
# SMALL_FOLIO where 2 MiB folios are costly (``large_folio_writes``)
LARGE_FOLIO = 2 << 20
SMALL_FOLIO = 256 << 10
#: where Linux lists a machine's virtio devices
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_BALLOON = 5  # virtio device id of a memory balloon
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING, a bit of the device's negotiated features


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio memory balloon bound to its driver has ``VIRTIO_BALLOON_F_REPORTING``
    negotiated here; ``False`` where ``devices`` cannot be read."""
    try:
        entries = sorted(devices.iterdir())
    except OSError:
        return False
    for device in entries:
        try:
            if int((device / "device").read_text().strip(), 16) != _BALLOON:
                continue
            features = (device / "features").read_text().strip()  # one character per bit, bit 0 first
        except (OSError, ValueError):
            continue
        if features[_F_REPORTING:_F_REPORTING + 1] == "1" and (device / "driver").exists():
            return True
    return False


@functools.cache
def _reporting_here() -> bool:
    return free_page_reporting()


def large_folio_writes() -> bool:
    """``HP_DCP_ALIGNED_WRITES`` resolved: ``1``/``0`` as set; unset or ``auto``: 2 MiB
    writes unless this machine reports free pages to its host (checked once a process)."""
    setting = ALIGNED_WRITES.get()
    return not _reporting_here() if setting is None else setting


def accelerator_available() -> bool:
    return torch.accelerator.is_available()


class PinnedBuffer:
    """One reused host buffer of up to ``capacity`` bytes between files and accelerator
    memory, page-locked where an accelerator is (``pin=None``) or as told."""

    def __init__(self, capacity: int = PINNED_BUFFER_BYTES, pin: Optional[bool] = None) -> None:
        self.capacity = capacity
        self._pin = pin
        self._buffer: Optional[torch.Tensor] = None

    def get(self, nbytes: int) -> torch.Tensor:
        """The buffer (uint8), at least ``min(nbytes, capacity)`` bytes; grown when smaller."""
        want = min(nbytes, self.capacity)
        if self._buffer is None or self._buffer.numel() < want:
            size = max(want, self._buffer.numel() if self._buffer is not None else 0)
            pin = accelerator_available() if self._pin is None else self._pin
            try:
                self._buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
            except RuntimeError:  # no accelerator to pin for: pageable, still reused
                self._buffer = torch.empty(size, dtype=torch.uint8)
        return self._buffer
