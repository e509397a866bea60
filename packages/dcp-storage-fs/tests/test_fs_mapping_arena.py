"""Files mapped in one arena, and column slices of one tensor from several files copied
as one (``MappingArena``, ``PendingCopies.add_mapped`` with a region, the reader's regions).

Every value is checked against what was written; the copies made are counted at
``torch._foreach_copy_``.
"""

from __future__ import annotations

import os

import pytest
import torch

from hyper_parallel_dcp.core.chunks import ChunkBox
from hyper_parallel_dcp.core.layout import TensorShards
from hyper_parallel_dcp.core.load_planning import StandardLoadPlanner
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.testing import run_distributed
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.mapping import FileMapping, MappingArena, wait_for_unmaps
from hyper_parallel_dcp.storage_fs.sinks import PendingCopies

COLS = 256  # int16 rows of 512 bytes


def _write(tmp_path, name: str, rows: int, seed: int, prefix: int = 8):
    values = (torch.arange(rows * COLS, dtype=torch.int32) * 7 + seed).remainder(30011).to(torch.int16)
    path = tmp_path / name
    path.write_bytes(b"h" * prefix + values.numpy().tobytes())
    return values.view(rows, COLS), os.open(path, os.O_RDONLY)


def _mapped_lines(tmp_path) -> int:
    with open("/proc/self/maps") as maps:
        return sum(str(tmp_path) in line for line in maps)


def _reserved_in(start: int, end: int) -> list[str]:
    """The lines of /proc/self/maps of address space reserved without access (an arena's
    ``PROT_NONE`` stretch) that overlap ``[start, end)``."""
    with open("/proc/self/maps") as maps:
        lines = maps.readlines()
    found = []
    for line in lines:
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if fields[1] == "---p" and low < end and high > start:
            found.append(line)
    return found


@pytest.fixture
def files(tmp_path):
    opened = [_write(tmp_path, f"f{i}.bin", rows, seed=i) for i, rows in enumerate((64, 64, 40, 200))]
    yield opened
    for _, fd in opened:
        os.close(fd)


def _slice(mapping: FileMapping, rows: int, r0: int, nrows: int, c0: int, ncols: int) -> torch.Tensor:
    first = r0 * COLS + c0
    found = mapping.slice_at(8, torch.int16, first, (nrows - 1) * COLS + ncols)
    assert found is not None and found[0] is mapping.typed(torch.int16)
    return found[0].as_strided((nrows, ncols), (COLS, 1), found[1])


def test_files_share_the_arena_in_slots_that_are_freed_and_taken_again(tmp_path, files):
    """Files fit in slots of the first file's size: each is read through the arena's one
    view; a file larger than a slot, or one more than the slots, is mapped alone; a
    closed file's slot takes the next file.  Closing the arena unmaps every file."""
    slot = 8 + 64 * COLS * 2
    arena = MappingArena.reserve(slot, 2)
    assert arena is not None, "Linux reserves address space"
    # slots on 2 MiB boundaries (a 2 MiB page-cache folio maps with one page-table entry)
    assert arena.base % (2 << 20) == 0 and arena.slot_bytes == 2 << 20
    reserved = arena._reserved
    assert reserved[0] <= arena.base and arena.base + arena.size <= reserved[0] + reserved[1]
    assert _reserved_in(reserved[0], reserved[0] + reserved[1]), "the stretch is reserved"
    (v0, fd0), (v1, fd1), (v2, fd2), (v3, fd3) = files
    m0 = FileMapping.open(fd0, os.fstat(fd0).st_size, arena)
    m1 = FileMapping.open(fd1, os.fstat(fd1).st_size, arena)
    alone = FileMapping.open(fd2, os.fstat(fd2).st_size, arena)  # no free slot
    large = FileMapping.open(fd3, os.fstat(fd3).st_size, arena)  # larger than a slot
    assert m0 and m1 and alone and large
    typed = arena.typed(torch.int16)
    assert m0.typed(torch.int16) is typed and m1.typed(torch.int16) is typed
    assert alone.typed(torch.int16) is not typed and large.typed(torch.int16) is not typed
    for mapping, values in ((m0, v0), (m1, v1), (alone, v2), (large, v3)):
        rows = values.shape[0]
        assert torch.equal(_slice(mapping, rows, 3, rows - 5, 17, 100), values[3:rows - 2, 17:117])
    # the same chunk of two files lies one slot apart
    assert _slice(m1, 64, 0, 1, 0, 1).data_ptr() - _slice(m0, 64, 0, 1, 0, 1).data_ptr() == arena.slot_bytes
    m0.close()
    again = FileMapping.open(fd2, os.fstat(fd2).st_size, arena)  # slot 0 again
    assert again is not None and again.typed(torch.int16) is typed
    assert torch.equal(_slice(again, 40, 0, 40, 0, COLS), v2)
    assert torch.equal(_slice(m1, 64, 0, 64, 0, COLS), v1)  # the other slot is untouched
    m1.close()
    # a free slot, but a file larger than a slot: mapped alone
    big, big_fd = _write(tmp_path, "big.bin", (2 << 20) // (2 * COLS) + 1, seed=5)
    try:
        beyond = FileMapping.open(big_fd, os.fstat(big_fd).st_size, arena)
        assert beyond is not None and beyond.typed(torch.int16) is not typed
        assert torch.equal(_slice(beyond, big.shape[0], 4090, 5, 3, 9), big[4090:4095, 3:12])
        beyond.close()
    finally:
        os.close(big_fd)
    for mapping in (alone, large, again):
        mapping.close()
    arena.close()
    wait_for_unmaps()
    assert _mapped_lines(tmp_path) == 0
    assert _reserved_in(reserved[0], reserved[0] + reserved[1]) == []  # the reservation too
    assert FileMapping.open(fd0, os.fstat(fd0).st_size, arena) is not None  # a closed arena: mapped alone


def _add_region(pending, tensor, offset, dest_strides, mapping, dtype, data_offset, first, span, lengths, strides,
                nbytes) -> bool:
    """Queue a copy into a region as the reader does: the slice's pages populated, then queued."""
    found = mapping.slice_at(data_offset, dtype, first, span)
    if found is None:
        return False
    pending.add_mapped(tensor, *found, lengths, strides, nbytes, region=(offset, dest_strides))
    return True


@pytest.fixture
def counted_copies(monkeypatch):
    shapes: list[list[tuple[int, ...]]] = []
    copy = torch._foreach_copy_

    def counting(dests, sources):
        shapes.append([tuple(d.shape) for d in dests])
        return copy(dests, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", counting)
    return shapes


def test_regions_of_one_tensor_evenly_spaced_in_the_arena_are_one_copy(files, counted_copies):
    """Row blocks of a column slice from two files (in either order), from three files
    evenly and unevenly spaced, two tensors' slices in one flat buffer, and one region
    cast to another dtype: each evenly spaced stretch is one copy, each region left one
    copy; every value lands in place (the flat buffer's gap untouched)."""
    (v0, fd0), (v1, fd1), (v2, fd2), (v3, fd3) = files
    slot = 8 + 200 * COLS * 2
    arena = MappingArena.reserve(slot, 4)
    assert arena is not None
    m = [FileMapping.open(fd, os.fstat(fd).st_size, arena) for fd in (fd0, fd1, fd2, fd3)]
    assert all(m)
    pending = PendingCopies()
    half = COLS // 2
    strides = (COLS, 1)

    def add(dest, block, file, r0, nrows, c0):
        # the first slice of a file populates its pages, the next ones lie in the populated run
        assert _add_region(pending, dest, block * nrows * half, (half, 1), m[file], torch.int16, 8, r0 * COLS + c0,
                                  (nrows - 1) * COLS + half, (nrows, half), strides, nrows * half * 2)

    two = torch.empty(2 * 32, half, dtype=torch.int16)
    add(two, 0, 0, 32, 32, half)
    add(two, 1, 1, 32, 32, half)
    backwards = torch.empty(2 * 16, half, dtype=torch.int16)
    add(backwards, 1, 1, 0, 16, 0)
    add(backwards, 0, 0, 0, 16, 0)
    even = torch.empty(3 * 8, half, dtype=torch.int16)  # files 0, 1, 2: one slot apart
    for block in range(3):
        add(even, block, block, 4, 8, 3)
    uneven = torch.empty(3 * 8, half, dtype=torch.int16)  # files 0, 1, 3: the first two evenly
    for block, file in enumerate((0, 1, 3)):
        add(uneven, block, file, 4, 8, 3)
    # two tensors' column slices in one flat buffer (a flat-parameter optimizer's), with a
    # gap between them: each tensor's two row blocks are one copy
    flat = torch.full((7 + 4 * 4 * half,), -1, dtype=torch.int16)
    for block, (file, r0) in enumerate(((0, 50), (1, 50), (0, 60), (1, 60))):
        assert _add_region(pending, flat, 7 * (block >= 2) + block * 4 * half, (half, 1), m[file], torch.int16, 8,
                                  r0 * COLS, 3 * COLS + half, (4, half), strides, 4 * half * 2)
    pending.flush()
    assert sorted(counted_copies[0]) == sorted([(2, 32, half), (2, 16, half), (3, 8, half), (2, 8, half), (8, half),
                                                (2, 4, half), (2, 4, half)])
    assert torch.equal(two, torch.cat([v0[32:64, half:], v1[32:64, half:]]))
    assert torch.equal(backwards, torch.cat([v0[:16, :half], v1[:16, :half]]))
    assert torch.equal(even, torch.cat([v[4:12, 3:3 + half] for v in (v0, v1, v2)]))
    assert torch.equal(uneven, torch.cat([v[4:12, 3:3 + half] for v in (v0, v1, v3)]))
    blocks = [v[r0:r0 + 4, :half].flatten() for r0 in (50, 60) for v in (v0, v1)]
    assert torch.equal(flat, torch.cat([blocks[0], blocks[1], torch.full((7,), -1, dtype=torch.int16),
                                        blocks[2], blocks[3]]))

    cast = torch.empty(16, half, dtype=torch.float32)  # another dtype: copied alone, cast
    assert _add_region(pending, cast, 0, (half, 1), m[0], torch.int16, 8, 0, 15 * COLS + half, (16, half), strides,
                              16 * half * 2)
    # a slice past the end of the file is refused, nothing queued
    assert not _add_region(pending, cast, 0, (half, 1), m[0], torch.int16, 8, 64 * COLS, COLS, (1, COLS), strides,
                                  COLS * 2)
    pending.flush()
    assert torch.equal(cast, v0[:16, :half].float())
    for mapping in m:
        mapping.close()
    arena.close()


SHAPE = (48, 40)


def _save_rows(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {f"w{i}": distribute_tensor(_full(i), mesh, [Shard(0)]) for i in range(6)}
    state["step"] = 7
    save_state_dict(state, FileSystemWriter(path))


def _full(i: int) -> torch.Tensor:
    return (torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).view(SHAPE) * (i + 1)).to(torch.bfloat16)


class _Committing(StandardLoadPlanner):
    def __init__(self) -> None:
        super().__init__()
        self.committed = 0
        self.seen: list[tuple[str, tuple[int, ...], torch.Tensor]] = []  # what each commit was handed

    def commit_tensor(self, read_item, tensor) -> None:
        self.committed += 1
        self.seen.append((read_item.dest_index.fqn, read_item.dest_offsets, tensor.clone()))


@pytest.mark.distributed
@pytest.mark.parametrize("planner_cls", [StandardLoadPlanner, _Committing])
def test_a_column_slice_of_row_sharded_files_loads_in_one_copy_a_tensor(tmp_path, counted_copies, planner_cls):
    """Shard(0) saved on 2 ranks, a column slice of every tensor loaded in one process:
    each tensor's two row blocks (one from each rank's file) are one copy; a planner that
    changes ``commit_tensor`` sees every read instead (one copy a read).  Both arena
    files are unmapped once the reader is dropped."""
    path = tmp_path / "ck"
    run_distributed(_save_rows, 2, str(path))
    target = {f"w{i}": TensorShards(SHAPE, torch.bfloat16, [(ChunkBox((0, 8), (SHAPE[0], 24)),
                                                             torch.zeros(SHAPE[0], 24, dtype=torch.bfloat16))])
              for i in range(6)}
    target["step"] = 0
    planner = planner_cls()
    reader = FileSystemReader(path)
    load_state_dict(target, reader, planner, no_dist=True)
    for i in range(6):
        assert torch.equal(target[f"w{i}"].pieces[0][1], _full(i)[:, 8:32]), i
    assert planner.loaded_objects == {"step": 7}
    copies = sorted(shape for batch in counted_copies for shape in batch)
    half = SHAPE[0] // 2
    if planner_cls is StandardLoadPlanner:
        assert copies == [(2, half, 24)] * 6
    else:
        assert copies == [(half, 24)] * 12 and planner.committed == 12
        # each read is committed once its values are in place
        for fqn, (row, col), tensor in planner.seen:
            rows, cols = tensor.shape
            expected = _full(int(fqn[1:]))[row:row + rows, 8 + col:8 + col + cols]
            assert torch.equal(tensor, expected), (fqn, row, col)
    assert _mapped_lines(path) == 2
    del reader
    wait_for_unmaps()
    assert _mapped_lines(path) == 0


@pytest.mark.distributed
def test_files_cycling_through_fewer_slots_than_files_load_every_value(tmp_path):
    """Shard(0) saved on 4 ranks, a column slice of every tensor loaded in one process
    that keeps 2 files open: every tensor takes a block from each of the 4 files, so
    files are closed with regions pending and their slots taken by the next file."""
    path = tmp_path / "ck"
    run_distributed(_save_rows, 4, str(path))
    target = {f"w{i}": TensorShards(SHAPE, torch.bfloat16, [(ChunkBox((0, 5), (SHAPE[0], 30)),
                                                             torch.zeros(SHAPE[0], 30, dtype=torch.bfloat16))])
              for i in range(6)}
    reader = FileSystemReader(path)
    reader.files_kept = 2
    load_state_dict(target, reader, no_dist=True)
    for i in range(6):
        assert torch.equal(target[f"w{i}"].pieces[0][1], _full(i)[:, 5:35]), i
    assert reader._arena is not None and reader._arena.size == 2 * reader._arena.slot_bytes
    assert _mapped_lines(path) <= 2
