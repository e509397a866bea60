"""A column slice from a file's mapping: blocks whose pages are all in the page cache are
not populated (the copy's faults map them); blocks that are not are populated first.

Every value is checked against the tensor that was written; which blocks were populated
is counted by wrapping the ``madvise`` the mapping calls.
"""

from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.storage_fs import posix
from hyper_parallel_dcp.storage_fs.mapping import FileMapping, wait_for_unmaps

ROWS, COLS = 4096, 512  # int16 rows of 1 KiB: 4 MiB, four populate blocks


@pytest.fixture
def written(tmp_path):
    values = torch.arange(ROWS * COLS, dtype=torch.int32).remainder(32749).to(torch.int16).view(ROWS, COLS)
    path = tmp_path / "data.bin"
    with open(path, "wb") as f:
        f.write(values.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: DONTNEED below can drop them
    fd = os.open(path, os.O_RDONLY)
    yield values, fd
    os.close(fd)


@pytest.fixture
def populate_calls(monkeypatch):
    """The byte ranges the mapping asked the kernel to populate."""
    calls: list[tuple[int, int]] = []
    populate = posix.populate_read

    def counting(addr, length):
        calls.append((addr, length))
        return populate(addr, length)

    monkeypatch.setattr(posix, "populate_read", counting)
    return calls


def _column_slice(mapping: FileMapping, r0: int, r1: int) -> torch.Tensor:
    lengths = (r1 - r0, COLS // 2)
    first, span, _ = slice_span((ROWS, COLS), (r0, 0), lengths)
    found = mapping.slice_at(0, torch.int16, first, span)
    assert found is not None
    return found[0].as_strided(lengths, row_major_strides((ROWS, COLS)), found[1]).clone()


def test_cached_blocks_are_not_populated_and_evicted_ones_are(written, populate_calls):
    values, fd = written
    size = os.fstat(fd).st_size
    assert posix.cached(fd, 0, size), "a file just written is in the page cache"
    mapping = FileMapping.open(fd, size)
    assert mapping is not None, "Linux maps files"
    try:
        assert torch.equal(_column_slice(mapping, 0, ROWS), values[:, :COLS // 2])
        assert populate_calls == []
    finally:
        mapping.close()

    # the second half of the file leaves the page cache: its blocks are populated (read
    # from disk by the call), the first half's still are not.  Mapped pages stay cached:
    # the mapping above is unmapped on a thread first.
    wait_for_unmaps()
    os.posix_fadvise(fd, size // 2, size // 2, os.POSIX_FADV_DONTNEED)
    if posix.cached(fd, size // 2, size // 2):
        pytest.fail("POSIX_FADV_DONTNEED left the clean pages of the second half cached")
    mapping = FileMapping.open(fd, size)
    assert mapping is not None
    try:
        assert torch.equal(_column_slice(mapping, 0, ROWS // 4), values[:ROWS // 4, :COLS // 2])
        assert populate_calls == []
        assert torch.equal(_column_slice(mapping, ROWS // 2, ROWS), values[ROWS // 2:, :COLS // 2])
        assert populate_calls, "the evicted half was populated"
        base = mapping._addr
        assert all(addr - base >= size // 2 for addr, _ in populate_calls)
        assert sum(length for _, length in populate_calls) == size // 2
    finally:
        mapping.close()


def test_without_cachestat_every_block_is_populated(written, populate_calls, monkeypatch):
    """An older kernel (no ``cachestat``): every block is populated, as before."""
    values, fd = written
    monkeypatch.setattr(posix, "_cachestat", None)
    size = os.fstat(fd).st_size
    assert not posix.cached(fd, 0, size)
    mapping = FileMapping.open(fd, size)
    assert mapping is not None
    try:
        assert torch.equal(_column_slice(mapping, 0, ROWS), values[:, :COLS // 2])
        assert sum(length for _, length in populate_calls) == size
    finally:
        mapping.close()


def test_a_refused_cachestat_falls_back_to_populating(written, populate_calls, monkeypatch):
    """A kernel or sandbox that refuses the call (ENOSYS, EPERM under seccomp): the
    mapping populates, and stops asking."""
    values, fd = written
    asked = []

    def refused(*args):
        asked.append(args)
        return -1

    monkeypatch.setattr(posix, "_cachestat", refused)
    size = os.fstat(fd).st_size
    mapping = FileMapping.open(fd, size)
    assert mapping is not None
    try:
        assert torch.equal(_column_slice(mapping, 0, ROWS), values[:, :COLS // 2])
        assert sum(length for _, length in populate_calls) == size
        assert len(asked) == 1 and posix._cachestat is None
    finally:
        mapping.close()
