"""Host memory as the reader and writer use it: the page-locked staging buffer, and
whether a save should fill the page cache with 2 MiB folios.

A save's data written in calls that end on 2 MiB boundaries leaves 2 MiB folios in the
page cache, which a reader's mapping maps with one page-table entry each.  Each such folio
takes a free 2 MiB block; a VM whose guest reports free memory to its host
(virtio-balloon free page reporting) has most of those reported, and the host faults each
back in on first touch, which made a process's first 2 MiB-aligned writes cost 5-15× the
CPU of 256 KiB-aligned ones (``docs/perf/storage.md``).  So by default
(``HP_DCP_ALIGNED_WRITES=auto``) saves write 2 MiB-aligned except on such a VM.  The check
reads ``/sys/bus/virtio/devices``: a memory balloon (virtio device id 5) bound to its
driver with ``VIRTIO_BALLOON_F_REPORTING`` (bit 5) negotiated.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Optional

import torch

from hyper_parallel_dcp.core.settings import ALIGNED_WRITES

from .tuning import PINNED_BUFFER_BYTES

__all__ = ["VIRTIO_DEVICES", "PinnedBuffer", "accelerator_available", "free_page_reporting", "large_folio_writes"]

#: where Linux lists a machine's virtio devices
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_BALLOON = 5  # virtio device id of a memory balloon
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING, a bit of the device's negotiated features


def free_page_reporting(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio memory balloon that reports free pages to the host is active here:
    bound to its driver, with ``VIRTIO_BALLOON_F_REPORTING`` negotiated.  ``False`` where
    ``devices`` cannot be read (not Linux, no virtio bus)."""
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
    accelerator = getattr(torch, "accelerator", None)
    return bool(accelerator is not None and accelerator.is_available())


class PinnedBuffer:
    """One reused host buffer of up to ``capacity`` bytes through which bytes move between
    files and accelerator memory, page-locked where an accelerator is (``pin=None``) or
    as told.  Fresh host memory per chunk faults its pages in on first touch and makes an
    unpinned device copy: 1 GiB of device tensors took 0.93 s to a fresh host copy and
    0.02 s to a pinned buffer (H200 host)."""

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
