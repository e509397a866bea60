"""The streaming safetensors writer and the direct slice reader, in one process."""

from __future__ import annotations

import math
import os
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from hyper_parallel_dcp.core.chunks import slice_span
from hyper_parallel_dcp.core.pipeline import load_state_dict, save_state_dict
from hyper_parallel_dcp.core.testing import FileReads
from hyper_parallel_dcp.storage_fs import FileSystemReader, FileSystemWriter
from hyper_parallel_dcp.storage_fs.mapping import FileMapping
from hyper_parallel_dcp.storage_fs.safetensors_stream import LateDigests, TensorEntry, tensor_bytes, write_safetensors
from hyper_parallel_dcp.storage_fs.sinks import PosixFile, read_slice_into

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.float64]


def _tensor(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def test_stream_writer_keeps_the_given_order_and_safetensors_reads_it(tmp_path):
    tensors = {f"z{i}" if i % 2 else f"a{i}": _tensor((i + 1, 3), DTYPES[i % len(DTYPES)], i) for i in range(9)}
    order = list(tensors)  # deliberately not sorted by name or dtype
    entries = [TensorEntry(k, tensors[k].dtype, tensors[k].shape, (lambda k=k: tensors[k])) for k in order]
    path = tmp_path / "f.safetensors"
    with open(path, "wb") as f:
        placed = write_safetensors(f, entries)
    offsets = [p[0] for p in placed]
    assert offsets == sorted(offsets), "data must be laid out in the order given"
    raw = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(order)
        for key, (offset, length, digest) in zip(order, placed):
            assert torch.equal(f.get_tensor(key), tensors[key])
            assert digest == xxhash.xxh3_64_hexdigest(raw[offset : offset + length])
    assert os.path.getsize(path) == placed[-1][0] + placed[-1][1]


def test_late_digests_hash_stable_chunks_after_the_write_and_copies_at_once(tmp_path):
    stable = _tensor((64, 8), torch.float32, 1)
    transposed = _tensor((8, 16), torch.bfloat16, 2).t()  # written from a contiguous copy
    unstable = _tensor((32,), torch.int64, 3)
    entries = [TensorEntry("a", stable.dtype, stable.shape, lambda: stable, stable=True),
               TensorEntry("b", transposed.dtype, transposed.shape, lambda: transposed, stable=True),
               TensorEntry("c", unstable.dtype, unstable.shape, lambda: unstable, stable=False)]
    late = LateDigests()
    path = tmp_path / "f.safetensors"
    with open(path, "wb") as f:
        placed = write_safetensors(f, entries, late=late)
    raw = path.read_bytes()

    def digest(i):
        return xxhash.xxh3_64_hexdigest(raw[placed[i][0]:placed[i][0] + placed[i][1]])

    # only the stable chunk written from its own bytes waits; the others are hashed already
    assert [p[2] for p in placed] == ["", digest(1), digest(2)]
    transposed.zero_()
    unstable.zero_()  # no longer what the file holds: their digests were taken before
    late.fill(placed)
    assert [p[2] for p in placed] == [digest(0), digest(1), digest(2)]
    assert digest(1) != xxhash.xxh3_64_hexdigest(tensor_bytes(transposed.contiguous()))


def test_a_save_hashes_after_its_files_are_written(tmp_path, monkeypatch):
    from hyper_parallel_dcp.storage_fs import writer

    seen = []
    started = writer._BackgroundSync.__init__

    def record(self, files):
        # the fsync starts with every chunk written and none of the stable ones hashed yet
        seen.append(sorted((f.path.name, f.size) for f in files))
        seen.append(hashed[0])
        started(self, files)

    hashed = [0]
    real = xxhash.xxh3_64_hexdigest

    def counting(data):
        hashed[0] += len(data) == 16 * 4 * 4  # a tensor chunk's bytes (not the object's, not metadata)
        return real(data)

    monkeypatch.setattr(writer._BackgroundSync, "__init__", record)
    monkeypatch.setattr("hyper_parallel_dcp.storage_fs.safetensors_stream.xxhash.xxh3_64_hexdigest", counting)
    sd = {f"w{i}": _tensor((16, 4), torch.float32, i) for i in range(5)}
    sd["step"] = 7
    save_state_dict(sd, FileSystemWriter(tmp_path / "c"), no_dist=True)
    files, hashes_before = seen
    assert [name for name, _ in files] == ["_rank0_.bytes", "_rank0_.safetensors"]
    assert dict(files)["_rank0_.safetensors"] == os.path.getsize(tmp_path / "c" / "_rank0_.safetensors")
    assert hashes_before == 0 and hashed[0] == 5
    out = {f"w{i}": torch.zeros(16, 4) for i in range(5)}
    out["step"] = 0
    load_state_dict(out, FileSystemReader(tmp_path / "c", verify=True), no_dist=True)
    assert all(torch.equal(out[f"w{i}"], sd[f"w{i}"]) for i in range(5)) and out["step"] == 7


def test_a_write_that_fails_before_the_sync_leaves_no_file(tmp_path):
    """The tensors file is written, the objects file fails: nothing is synced or left."""
    from hyper_parallel_dcp.storage_fs import atomic

    sd = {"w": _tensor((16, 4), torch.float32, 0), "bad": lambda: None}  # a lambda does not pickle
    writer = FileSystemWriter(tmp_path / "c")
    with pytest.raises(Exception, match="bad|pickle|lambda"):
        save_state_dict(sd, writer, no_dist=True)
    assert writer._syncing is None
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(atomic.TMP_SUFFIX)]
    assert not (tmp_path / "c" / ".metadata").exists()


def test_stream_writer_rejects_data_that_differs_from_the_plan(tmp_path):
    entry = TensorEntry("w", torch.float32, (2, 3), lambda: torch.zeros(3, 2), label="'w' chunk at [0, 0]")
    with open(tmp_path / "f", "wb") as f, pytest.raises(ValueError, match="'w' chunk at"):
        write_safetensors(f, [entry])


@st.composite
def slices(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    offsets, lengths = [], []
    for d in shape:
        o = draw(st.integers(0, d - 1))
        offsets.append(o)
        lengths.append(draw(st.integers(1, d - o)))
    return shape, tuple(offsets), tuple(lengths), draw(st.sampled_from(DTYPES)), draw(st.booleans())


@settings(max_examples=150, deadline=None)
@given(slices())
def test_read_slice_into_matches_indexing(tmp_path_factory, case):
    shape, offsets, lengths, dtype, strided_dest = case
    chunk = _tensor(shape, dtype, 7)
    path = tmp_path_factory.mktemp("r") / "chunk.bin"
    prefix = b"\x01" * 13  # the chunk does not start at offset 0 of the file
    path.write_bytes(prefix + bytes(tensor_bytes(chunk.contiguous())))
    if strided_dest:
        dest = torch.zeros(tuple(reversed(lengths)), dtype=dtype).permute(*reversed(range(len(lengths))))
    else:
        dest = torch.zeros(lengths, dtype=dtype)
    fd = os.open(path, os.O_RDONLY)
    try:
        with FileReads() as reads:
            spanned = read_slice_into(PosixFile(fd, str(path)), len(prefix), shape, dtype, offsets, lengths, dest)
    finally:
        os.close(fd)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    assert torch.equal(dest, chunk[index])
    # The reported span is what the system calls really read: from the slice's first
    # element to its last, in row-major order (computed here from the chunk's strides).
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = sum(o * st_ for o, st_ in zip(offsets, strides))
    last = sum((o + n - 1) * st_ for o, n, st_ in zip(offsets, lengths, strides))
    assert [(off, n) for _, off, n in reads.records] == [(len(prefix) + first * dtype.itemsize,
                                                          (last - first + 1) * dtype.itemsize)]
    assert spanned == reads.bytes_from(lambda p, o: True)
    _, span, contiguous = slice_span(shape, offsets, lengths)
    assert contiguous == (span == math.prod(lengths))


@settings(max_examples=150, deadline=None)
@given(slices())
def test_mapped_slice_read_matches_indexing(tmp_path_factory, case):
    """Slices loaded by the reader, column slices copied from a mapping of the file, hold the
    same values, and the span reported is the same as when read with ``preadv``; nothing
    goes through ``preadv`` except a slice contiguous in the file into a contiguous target."""
    from hyper_parallel_dcp.core.chunks import ChunkBox
    from hyper_parallel_dcp.core.layout import TensorShards

    shape, offsets, lengths, dtype, strided_dest = case
    chunk = _tensor(shape, dtype, 11)
    root = tmp_path_factory.mktemp("m") / "ck"
    save_state_dict({"c": chunk}, FileSystemWriter(root), no_dist=True)
    if strided_dest:
        dest = torch.zeros(tuple(reversed(lengths)), dtype=dtype).permute(*reversed(range(len(lengths))))
    else:
        dest = torch.zeros(lengths, dtype=dtype)
    first, span, contiguous = slice_span(shape, offsets, lengths)
    reader = FileSystemReader(root)
    with FileReads() as reads:
        load_state_dict({"c": TensorShards(shape, dtype, [(ChunkBox(offsets, lengths), dest)])}, reader, no_dist=True)
    index = tuple(slice(o, o + n) for o, n in zip(offsets, lengths))
    assert torch.equal(dest, chunk[index])
    assert reader.bytes_read == span * dtype.itemsize
    via_preadv = contiguous and dest.is_contiguous()
    assert _data_bytes_read(reads, root) == (reader.bytes_read if via_preadv else 0)


def test_mapping_refuses_a_range_past_the_end(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(range(64)))
    fd = os.open(path, os.O_RDONLY)
    mapping = FileMapping.open(fd, 64)
    try:
        assert mapping is not None
        assert mapping.slice_at(0, torch.int16, 0, 32) is not None
        # 40 int16 elements need 80 bytes: the file has 64, so no view (and no SIGBUS)
        assert mapping.slice_at(0, torch.int16, 0, 40) is None
        # a slice not aligned to its element size: a view would need a copy (read instead)
        assert mapping.slice_at(13, torch.int16, 0, 4) is None
        assert mapping.slice_at(12, torch.int16, 0, 4) is not None
        assert FileMapping.open(fd, 0) is None  # an empty file is not mapped
    finally:
        mapping.close()
        os.close(fd)



def _data_start(path) -> int:
    """First byte after a safetensors file's header (u64 length + JSON), read here by hand."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def _data_bytes_read(reads: FileReads, root) -> int:
    """Bytes really read from the checkpoint's data files (safetensors headers excluded)."""
    starts = {str(p.resolve()): _data_start(p) if p.suffix == ".safetensors" else 0
              for p in root.iterdir() if p.name.startswith("_rank")}
    return reads.bytes_from(lambda path, offset: path in starts and offset >= starts[path])


def test_reader_counts_only_the_rows_a_row_slice_needs(tmp_path):
    full = _tensor((64, 32), torch.float32, 3)
    save_state_dict({"w": full, "meta": {"step": 5}}, FileSystemWriter(tmp_path / "ck"), no_dist=True)
    rows = torch.zeros(16, 32)
    from hyper_parallel_dcp.core import RaggedShard

    target = {"w": RaggedShard.from_rows(rows, (64, 32), row_start=8), "meta": {"step": 0}}
    reader = FileSystemReader(tmp_path / "ck")
    with FileReads() as reads:
        load_state_dict(target, reader, no_dist=True)
    assert torch.equal(rows, full[8:24])
    assert target["meta"] == {"step": 5}
    pickled = reader.metadata.storage_data  # the object's bytes are read too
    object_bytes = sum(info.length for idx, info in pickled.items() if idx.fqn == "meta.step")
    assert reader.bytes_read == 16 * 32 * 4 + object_bytes
    assert _data_bytes_read(reads, tmp_path / "ck") == reader.bytes_read

    from hyper_parallel_dcp.core.chunks import ChunkBox
    from hyper_parallel_dcp.core.layout import TensorShards

    for mapped in (False, True):
        column = torch.zeros(64, 4)
        reader = FileSystemReader(tmp_path / "ck")
        with FileReads() as reads, pytest.MonkeyPatch.context() as mp:
            if not mapped:  # through the span buffer, whose preadv the test sees
                mp.setattr(FileMapping, "open", classmethod(lambda cls, *args, **kwargs: None))
            load_state_dict({"w": TensorShards((64, 32), torch.float32, [(ChunkBox((0, 4), (64, 4)), column)])},
                            reader, no_dist=True)
        assert torch.equal(column, full[:, 4:8])
        # a column slice spans every row it touches: from (0, 4) to (63, 7)
        assert reader.bytes_read == (63 * 32 + 8 - 4) * 4
        # copied from the file's mapping, the slice makes no read call at all
        assert _data_bytes_read(reads, tmp_path / "ck") == (0 if mapped else reader.bytes_read)
