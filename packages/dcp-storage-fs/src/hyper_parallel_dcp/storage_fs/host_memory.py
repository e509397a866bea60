"""Whether a save should fill the page cache with 2 MiB folios on this machine.

A save's data written in calls that end on 2 MiB boundaries leaves 2 MiB folios in the
page cache, which a reader's mapping maps with one page-table entry each: loads from the
page cache get faster, resharded ones most (the issue-size benchmark on the 2-core dev
machine, 2 ranks, Shard(0) -> Shard(1) / same-layout load: 1 GiB dense 1.31 -> 1.20,
2000 × 0.5 MiB 1.37 -> 1.26), and steady-state saves about 10 %.

Each such folio takes a free 2 MiB block.  A VM whose guest reports its free memory to
the host (virtio-balloon free page reporting) has most of its free 2 MiB blocks reported,
and the host faults a reported block back in on first touch: on the dev machine (such a
VM), two processes each writing 125 MiB in 2 MiB-aligned calls took 265-340 ms of CPU
where 256 KiB-aligned calls took 23 ms, and the cost grows with the bytes (256 MiB each:
620-670 ms against 46; 512 MiB: 1.22-1.29 s against 93 ms); 2 ranks' first saves of a
256 MiB state dict in fresh processes took 395-436 ms instead of 168-242.  So by default
(``HP_DCP_ALIGNED_WRITES=auto``) the writer uses 2 MiB everywhere but on such a VM; the
variable overrides it either way.

The check reads ``/sys/bus/virtio/devices``: a memory balloon (virtio device id 5) bound
to its driver whose negotiated features include ``VIRTIO_BALLOON_F_REPORTING`` (bit 5).
Bare metal has no balloon; a container sees its host's devices.
"""

from __future__ import annotations

import functools
from pathlib import Path

from hyper_parallel_dcp.core.settings import ALIGNED_WRITES

__all__ = ["VIRTIO_DEVICES", "free_page_reporting", "large_folio_writes"]

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
            # one character per feature bit, bit 0 first
            features = (device / "features").read_text().strip()
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
