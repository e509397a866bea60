"""The reader's batches: adjacent contiguous reads in one ``preadv``, column slices copied
from the file's mapping in one ``_foreach_copy_`` (pages populated a block at a time).

Values are checked against the saved tensors; read calls are counted at the system call
(``FileReads``).  The two-rank test loads with one file kept open, so the copies pending
from one file must be done before it closes.
"""

from __future__ import annotations

import os
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hyper_parallel_dcp.core.chunks import row_major_strides, slice_span
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.testing import FileReads, run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.mapping import FileMapping, wait_for_unmaps
from hyper_parallel_dcp.storage_fs.sinks import DeviceReads, PendingCopies

ROWS, COLS = 1536, 1024  # int16: 3 MiB, three populate blocks


@pytest.fixture(scope="module")
def mapped_file(tmp_path_factory):
    values = torch.arange(ROWS * COLS, dtype=torch.int32).remainder(30011).to(torch.int16).view(ROWS, COLS)
    path = tmp_path_factory.mktemp("map") / "data.bin"
    prefix = b"x" * 6  # the data does not start on a page
    path.write_bytes(prefix + values.numpy().tobytes())
    fd = os.open(path, os.O_RDONLY)
    mapping = FileMapping.open(fd, os.fstat(fd).st_size)
    assert mapping is not None, "Linux maps files"
    yield values, mapping, len(prefix)
    mapping.close()
    os.close(fd)


@st.composite
def boxes(draw):
    r0 = draw(st.integers(0, ROWS - 1))
    c0 = draw(st.integers(0, COLS - 1))
    return (r0, c0), (draw(st.integers(1, ROWS - r0)), draw(st.integers(1, COLS - c0)))


@settings(max_examples=60, deadline=None)
@given(st.lists(boxes(), min_size=1, max_size=6))
def test_slices_across_populate_blocks_hold_the_stored_values(mapped_file, batch):
    """Slices anywhere in a 3 MiB file (inside one 1 MiB block, across two or three, over
    blocks an earlier slice populated) copied in one batch equal indexing the tensor."""
    values, mapping, prefix = mapped_file
    pending, dests, expected = PendingCopies(), [], []
    for offsets, lengths in batch:
        first, span, _ = slice_span((ROWS, COLS), offsets, lengths)
        found = mapping.slice_at(prefix, torch.int16, first, span)
        assert found is not None
        view = found[0].as_strided(lengths, row_major_strides((ROWS, COLS)), found[1])
        dests.append(torch.empty(lengths, dtype=torch.int16))
        pending.add(dests[-1], view, dests[-1].nbytes)
        expected.append(values[offsets[0]:offsets[0] + lengths[0], offsets[1]:offsets[1] + lengths[1]])
    pending.flush()
    for got, want in zip(dests, expected):
        assert torch.equal(got, want)


def _data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_same_layout_load_reads_adjacent_chunks_in_few_calls(tmp_path):
    count = 300
    saved = {f"t{i:03d}": torch.full((3, 5), float(i)) + torch.arange(15.0).view(3, 5) for i in range(count)}
    save_state_dict(saved, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    target = {k: torch.zeros(3, 5) for k in saved}
    data_file = next((tmp_path / "ck").glob("*.safetensors"))
    start = _data_start(data_file)
    with FileReads() as reads:
        load_state_dict(target, FileSystemReader(tmp_path / "ck"), no_dist=True)
    for k, v in saved.items():
        assert torch.equal(target[k], v), k
    calls = [r for r in reads.records if r[0] == str(data_file.resolve()) and r[1] >= start]
    assert sum(r[2] for r in calls) == count * 15 * 4
    # stored in the order they are read, 300 chunks go in batches of at most 256 reads
    assert len(calls) == 2


def test_a_stream_hands_out_reads_once_their_batch_is_complete(tmp_path):
    saved = {f"t{i}": torch.arange(12.0).view(3, 4) + i for i in range(8)}
    save_state_dict(saved, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    reader = FileSystemReader(tmp_path / "ck")
    from hyper_parallel_dcp.core.load_planning import StandardLoadPlanner
    from hyper_parallel_dcp.core.storage import resolve_destinations

    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, is_coordinator=True)
    target = {k: torch.zeros(3, 4) for k in saved}
    planner = StandardLoadPlanner()
    planner.set_up_planner(target, metadata, is_coordinator=True)
    plan = planner.create_local_plan()
    stream = reader.read_stream(resolve_destinations(planner, reader.sort_items(plan.items)))
    first, dest = next(stream)
    assert first.dest_index.fqn == "t0" and dest is target["t0"]
    for k in saved:  # one batch: every read is done when the first is handed out
        assert torch.equal(target[k], saved[k]), k
    assert [item.dest_index.fqn for item, _ in stream] == [f"t{i}" for i in range(1, 8)]
    reader.reset()


def _full(i: int, rows: int, cols: int) -> torch.Tensor:
    return (torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) * 0.5 + i).to(torch.bfloat16)


SHAPES = [(8, 64)] * 30 + [(256, 1024), (6, 10)]


def _save_rows(rank: int, world_size: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    state = {f"w{i}": distribute_tensor(_full(i, *shape), mesh, [Shard(0)]) for i, shape in enumerate(SHAPES)}
    save_state_dict(state, FileSystemWriter(path))


def _load(rank: int, world_size: int, path: str, dim: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    target = {f"w{i}": distribute_tensor(torch.zeros(shape, dtype=torch.bfloat16), mesh, [Shard(dim)])
              for i, shape in enumerate(SHAPES)}
    reader = FileSystemReader(path)
    assert reader.files_kept == 1
    load_state_dict(target, reader)
    for i, shape in enumerate(SHAPES):
        assert torch.equal(target[f"w{i}"].full_tensor(), _full(i, *shape)), i
    return reader.bytes_read


@pytest.mark.distributed
def test_resharded_load_with_one_file_open_copies_before_closing(tmp_path):
    """Shard(0) saved on 2 ranks (one file each), loaded as Shard(1): every column slice
    alternates between the two files, and with one file kept open each switch closes the
    file whose slices are still waiting in the batch."""
    path = str(tmp_path / "ck")
    run_distributed(_save_rows, 2, path)
    env = {"HP_DCP_FILES_KEPT": "1"}
    spanned = run_distributed(_load, 2, path, 1, env=env)
    # each rank's column half of every row-half chunk spans its rows but the last one's tail
    per_rank = sum((r // 2 * c - c // 2) * 2 * 2 for r, c in SHAPES)
    assert spanned == [per_rank, per_rank]
    run_distributed(_load, 2, path, 0, env=env)


def test_a_dropped_reader_unmaps_its_files(tmp_path):
    from hyper_parallel_dcp.core.chunks import ChunkBox
    from hyper_parallel_dcp.core.layout import TensorShards

    full = torch.arange(64 * 32, dtype=torch.float32).view(64, 32)
    save_state_dict({"w": full}, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    column = torch.zeros(64, 4)

    def mapped() -> int:
        with open("/proc/self/maps") as maps:
            return sum(str(tmp_path / "ck") in line for line in maps)

    reader = FileSystemReader(tmp_path / "ck")
    load_state_dict({"w": TensorShards((64, 32), torch.float32, [(ChunkBox((0, 4), (64, 4)), column)])},
                    reader, no_dist=True)
    assert torch.equal(column, full[:, 4:8])
    assert mapped() == 1  # the column slice was copied from a mapping of the file
    del reader  # no reset(): the mapping goes with the reader, unmapped on a thread
    wait_for_unmaps()
    assert mapped() == 0


def test_device_reads_fill_their_destinations_through_one_buffer(tmp_path):
    """``DeviceReads`` (the accelerator path), driven here with host destinations and an
    unpinned buffer of 1000 bytes: adjacent ranges joined, two files, a slice larger than
    the buffer streamed in parts, a fill split over threads; every byte checked."""
    data = [torch.randint(-(2**15), 2**15, (5000,), dtype=torch.int16, generator=torch.Generator().manual_seed(s))
            for s in (1, 2)]
    fds = []
    for i, values in enumerate(data):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(values.numpy().tobytes())
        fds.append(os.open(path, os.O_RDONLY))
    try:
        reads = DeviceReads(capacity=1000, pin=False)
        reads._SPLIT = 96  # several threads fill a buffer of 1000 bytes
        # (file, first element, elements): adjacent, a jump, the other file, one larger than the buffer
        wanted = [(0, 0, 100), (0, 100, 50), (0, 400, 7), (1, 3, 200), (0, 157, 0), (1, 1000, 2100), (0, 4990, 10)]
        dests = [torch.full((n,), -1, dtype=torch.int16) for _, _, n in wanted]
        for (f, first, _), dest in zip(wanted, dests):
            assert reads.add(fds[f], f"f{f}.bin", first * 2, dest, torch.int16)
        assert not reads.add(fds[0], "f0.bin", 0, torch.empty(4, 4, dtype=torch.int16).t(), torch.int16)
        assert not reads.add(fds[0], "f0.bin", 0, torch.empty(4, dtype=torch.int32), torch.int16)
        reads.flush()
        reads.wait()
        for (f, first, n), dest in zip(wanted, dests):
            assert torch.equal(dest, data[f][first:first + n]), (f, first, n)
        # a read past the end of a file names it
        with pytest.raises(Exception, match="f1.bin is truncated"):
            reads.add(fds[1], "f1.bin", 9990, torch.empty(8, dtype=torch.int16), torch.int16)
            reads.flush()
    finally:
        for fd in fds:
            os.close(fd)
