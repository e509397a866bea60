"""Column slices from a file's mapping: populated ahead while a read walks forwards, the
pending copies sorted as they are added, and a slice's span remembered per (chunk shape,
slice).

Every value is checked against the tensor that was written (bit for bit where the dtype
has payload bits ``copy_`` would not keep).
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.errors import CheckpointFormatError
from hyper_parallel_dcp.core.metadata import MetadataIndex
from hyper_parallel_dcp.core.pipeline import save_state_dict
from hyper_parallel_dcp.core.planner import LoadItemType, ReadItem
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.mapping import FileMapping
from hyper_parallel_dcp.storage_fs.sinks import PendingCopies

COLS = 512  # int16 rows of 1 KiB: 1024 rows a populate block


def _mapped(tmp_path, rows: int, prefix: int):
    values = torch.arange(rows * COLS, dtype=torch.int32).remainder(32749).to(torch.int16).view(rows, COLS)
    path = tmp_path / f"data{rows}_{prefix}.bin"
    path.write_bytes(b"p" * prefix + values.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    mapping = FileMapping.open(fd, os.fstat(fd).st_size)
    assert mapping is not None, "Linux maps files"
    return values, mapping, fd


def _copy_rows(mapping, prefix, rows_total, values, row_ranges, cols=(0, COLS // 2)):
    pending = PendingCopies()
    expected = []
    dests = []
    for r0, r1 in row_ranges:
        lengths = (r1 - r0, cols[1] - cols[0])
        first, span, _ = slice_span((rows_total, COLS), (r0, cols[0]), lengths)
        found = mapping.slice_at(prefix, torch.int16, first, span)
        assert found is not None
        view = found[0].as_strided(lengths, row_major_strides((rows_total, COLS)), found[1])
        dest = torch.empty(lengths, dtype=torch.int16)
        pending.add(dest, view, dest.nbytes)
        dests.append(dest)
        expected.append(values[r0:r1, cols[0]:cols[1]])
    pending.flush()
    for got, want in zip(dests, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [40 * 1024, 40 * 1024 + 7])  # 40 MiB: a whole number of blocks, and not
def test_a_forward_walk_to_the_end_of_the_file_reads_every_value(tmp_path, rows):
    """A walk forwards populates further and further ahead (up to 32 MiB); the last
    populate stops at the end of the file, whether or not it ends on a block."""
    values, mapping, fd = _mapped(tmp_path, rows, prefix=0)
    try:
        step = 300  # slices that straddle blocks
        _copy_rows(mapping, 0, rows, values, [(r, min(r + step, rows)) for r in range(0, rows, step)])
    finally:
        mapping.close()
        os.close(fd)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12 * 1024 - 1), st.integers(1, 2500)), min_size=1, max_size=12))
def test_slices_in_any_order_hold_the_stored_values(tmp_path_factory, slices):
    """Backwards, forwards, jumping over and into populated runs: every slice is right."""
    rows = 12 * 1024 + 3
    values, mapping, fd = _mapped(tmp_path_factory.mktemp("walk"), rows, prefix=6)
    try:
        _copy_rows(mapping, 6, rows, values, [(r0, min(r0 + n, rows)) for r0, n in slices])
    finally:
        mapping.close()
        os.close(fd)


def test_pending_copies_keep_every_bit_of_every_dtype():
    """Small plain-dtype pairs go to one _foreach_copy_, the rest one by one: bool bytes
    other than 0/1, a bf16 copy of 1 MiB or more, a cast, and a sub-byte-free bits16."""
    raw = torch.tensor([0, 1, 2, 255, 7, 0, 9, 128], dtype=torch.uint8)
    big = torch.arange(1 << 20, dtype=torch.int32).remainder(65521).to(torch.int16).view(1024, 1024)
    bf16_src = torch.randn(16, 24).to(torch.bfloat16)
    f32_src = torch.randn(4, 6)
    pairs = [
        (torch.empty(8, dtype=torch.bool), raw.view(torch.bool)),
        (torch.empty(1024, 512, dtype=torch.bfloat16), big.view(torch.bfloat16)[:, 256:768]),
        (torch.empty(16, 12, dtype=torch.bfloat16), bf16_src[:, 6:18]),
        (torch.empty(4, 3, dtype=torch.float64), f32_src[:, 1:4]),
        (torch.empty(4, 3, dtype=torch.float32), f32_src[:, 3:6]),
    ]
    pending = PendingCopies()
    for dest, source in pairs:
        pending.add(dest, source, source.numel() * source.element_size())
    assert len(pending.dests) == 2 and len(pending.others) == 3
    pending.flush()
    assert not pending.dests and not pending.others
    assert torch.equal(pairs[0][0].view(torch.uint8), raw)
    assert torch.equal(pairs[1][0].view(torch.int16), big[:, 256:768])
    assert torch.equal(pairs[2][0].view(torch.int16), bf16_src[:, 6:18].view(torch.int16))
    assert torch.equal(pairs[3][0], f32_src[:, 1:4].double())
    assert torch.equal(pairs[4][0], f32_src[:, 3:6])


def test_mapped_slices_viewed_together_hold_the_stored_values(tmp_path):
    """``add_mapped``: slices of one shape at even spacing (viewed by one ``as_strided`` +
    ``unbind``), at uneven spacing, alone, and of other shapes in the same batch; a bool
    destination (its bytes kept) and a cast go one by one.  Each is checked against the
    stored values."""
    rows = 4096
    values, mapping, fd = _mapped(tmp_path, rows, prefix=2)
    try:
        strides = (COLS, 1)
        pending = PendingCopies()
        checks = []

        def add(r0, nrows, c0, ncols, dtype=torch.int16, dest_dtype=None):
            first = r0 * COLS + c0
            span = (nrows - 1) * COLS + ncols
            found = mapping.slice_at(2, dtype, first, span)
            assert found is not None
            dest = torch.empty((nrows, ncols), dtype=dest_dtype or dtype)
            pending.add_mapped(dest, *found, (nrows, ncols), strides, dest.nbytes)
            checks.append((dest, values[r0:r0 + nrows, c0:c0 + ncols]))

        for r0 in range(0, 2048, 64):  # evenly spaced, interleaved with the groups below
            add(r0, 32, 0, 256)
            add(r0 + 32, 16, 256, 256)
        for r0 in (2100, 2200, 2500, 3900):  # unevenly spaced
            add(r0, 8, 3, 100)
        add(3000, 5, 7, 9)  # alone
        add(3100, 4, 0, 64, dest_dtype=torch.float32)  # a cast
        pending.flush()
        assert not pending.mapped and not pending.dests
        for dest, want in checks:
            if dest.dtype == torch.float32:
                assert torch.equal(dest, want.float())
            else:
                assert torch.equal(dest, want)

        # bool: every byte back as stored (a copy_ into bool would turn 2..255 into 1)
        found = mapping.slice_at(2, torch.bool, 0, 64)
        assert found is not None
        flags = torch.empty(4, 16, dtype=torch.bool)
        pending.add_mapped(flags, *found, (4, 16), (2 * COLS, 1), flags.nbytes)
        pending.flush()
        stored = values.view(torch.uint8).view(rows, 2 * COLS)[:4, :16]
        assert torch.equal(flags.view(torch.uint8), stored)
    finally:
        mapping.close()
        os.close(fd)


def test_a_slice_outside_its_chunk_is_refused_and_not_remembered(tmp_path):
    saved = {f"w{i}": (torch.arange(6 * 8, dtype=torch.float32).view(6, 8) + 100 * i) for i in range(3)}
    save_state_dict(saved, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    reader = FileSystemReader(tmp_path / "ck")
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)

    def item(fqn, offsets, lengths):
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, (0, 0)), (0, 0), MetadataIndex(fqn, (0, 0), 0),
                        offsets, lengths)

    bad = item("w0", (2, 6), (3, 3))
    with pytest.raises(CheckpointFormatError, match="exceeds the stored chunk"):
        reader.read_into(bad, torch.empty(3, 3))
    with pytest.raises(CheckpointFormatError, match="exceeds the stored chunk"):  # still refused
        reader.read_into(item("w2", (2, 6), (3, 3)), torch.empty(3, 3))
    for fqn in saved:  # one slice shape, three chunks: the remembered span serves each
        dest = torch.empty(4, 3)
        reader.read_into(item(fqn, (1, 5), (4, 3)), dest)
        assert torch.equal(dest, saved[fqn][1:5, 5:8]), fqn
    reader.reset()
